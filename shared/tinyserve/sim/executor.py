"""The simulator's executor: prices a step from the roofline instead of running it.

    step time = max(bytes moved / bandwidth, FLOPs / peak) + overhead

where the bytes are the weights (read once per step, however many tokens) plus
every scheduled request's KV cache, and the FLOPs are 2 per parameter per
token plus attention over each token's context.
"""

from __future__ import annotations

from tinyserve.core import VirtualClock
from tinyserve.hardware import HardwareSpec, ModelSpec, kv_bytes_per_token, weight_bytes
from tinyserve.scheduler import SchedulerOutput

# What the simulated model "samples": any id works, since every request runs for
# exactly its output length (ignore_eos).
SIM_TOKEN = 7


class SimExecutor:
    """Stands in for ``ModelExecutor``: prices a step instead of running it, and moves
    ``clock`` forward by that price (so the step ends when the hardware would finish it)."""

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, dtype: str = "fp16",
                 overhead: float = 0.0, clock: VirtualClock | None = None):
        if overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {overhead!r}")
        self.hardware, self.model, self.dtype = hardware, model, dtype
        self.clock = VirtualClock() if clock is None else clock
        self.overhead = overhead
        bandwidth, peak = hardware.memory_bandwidth, hardware.peak_flops(dtype)
        self.weight_time = weight_bytes(model, dtype) / bandwidth
        self.kv_time_per_token = kv_bytes_per_token(model, dtype) / bandwidth
        self.compute_time_per_token = 2 * model.num_parameters / peak
        # QK^T and PV: 2 matmuls x 2 FLOPs x hidden per (query, key) pair per layer.
        self.attention_time_per_pair = 4 * model.num_layers * model.hidden_size / peak
        # Requests whose prompt KV arrived from elsewhere (disaggregated prefill):
        # their prompt tokens are written into the cache, not computed.
        self.preloaded: set[str] = set()

    def step_time(self, plan: SchedulerOutput) -> float:
        if plan.is_empty:
            return 0.0
        tokens = kv_tokens = pairs = 0
        for item in plan.scheduled:
            n, done = item.num_new_tokens, item.request.num_computed_tokens
            if n > 1 and item.request.request_id in self.preloaded:
                kv_tokens += n                   # receive the KV; compute only the last token
                n, done = 1, done + n - 1
            tokens += n
            kv_tokens += done + n                # attention reads the whole context
            pairs += n * done + n * (n + 1) // 2  # each new token attends to all before it
        return self.time_for(tokens, kv_tokens, pairs)

    def time_for(self, tokens: int, kv_tokens: int, pairs: int) -> float:
        """Time of a step computing ``tokens`` new tokens, reading ``kv_tokens`` tokens
        of KV cache, with ``pairs`` (query, key) attention pairs: roofline + overhead."""
        memory = self.weight_time + kv_tokens * self.kv_time_per_token
        compute = tokens * self.compute_time_per_token + pairs * self.attention_time_per_pair
        return max(memory, compute) + self.overhead

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self.clock.advance(self.step_time(plan))
        return {item.request.request_id: SIM_TOKEN for item in plan.scheduled if item.samples}

    def release(self, request_id: str) -> None:
        self.preloaded.discard(request_id)
