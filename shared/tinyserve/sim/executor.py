"""The simulator's executor: prices a step from a cost model instead of running it.

    step time = cost_model.step_time(...) + overhead

With the default cost model, the pure roofline, that is
``max(bytes moved / bandwidth, FLOPs / peak) + overhead``: the bytes are the
weights (read once per step, however many tokens) plus every scheduled
request's KV cache, the FLOPs 2 per parameter per token plus attention over
each token's context. The formula lives in ``tinyserve.hardware``, the one
roofline of the package; ``tinyserve.sim.cost_model`` adds calibrated models.
"""

from __future__ import annotations

from tinyserve.core import VirtualClock
from tinyserve.hardware import HardwareSpec, ModelSpec, weight_read_time
from tinyserve.scheduler import SchedulerOutput
from tinyserve.sim.cost_model import CostModel, StepShape, get_cost_model

# What the simulated model "samples": any id works, since every request runs for
# exactly its output length (ignore_eos).
SIM_TOKEN = 7


class SimExecutor:
    """Stands in for ``ModelExecutor``: prices a step instead of running it, and moves
    ``clock`` forward by that price (so the step ends when the hardware would finish it)."""

    last_prepare_time = 0.0     # host work is part of the priced step

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, dtype: str = "fp16",
                 overhead: float = 0.0, clock: VirtualClock | None = None,
                 cost_model: str | CostModel = "roofline"):
        if overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {overhead!r}")
        self.hardware, self.model, self.dtype = hardware, model, dtype
        self.cost_model = get_cost_model(cost_model)
        self.clock = VirtualClock() if clock is None else clock
        self.overhead = overhead
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
        return self.time_for(tokens, kv_tokens, pairs, len(plan.scheduled))

    @property
    def weight_time(self) -> float:
        """The floor of every step: reading each weight once."""
        return weight_read_time(self.hardware, self.model, self.dtype)

    def time_for(self, tokens: int, kv_tokens: int, pairs: int, num_seqs: int = 1) -> float:
        """Time of a step computing ``tokens`` new tokens of ``num_seqs`` sequences, reading
        ``kv_tokens`` tokens of KV cache, with ``pairs`` (query, key) attention pairs:
        the cost model's price + overhead."""
        step = StepShape(tokens, kv_tokens, pairs, num_seqs)
        return self.cost_model.step_time(self.hardware, self.model, self.dtype, step) + self.overhead

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        self.clock.advance(self.step_time(plan))
        return {item.request.request_id: SIM_TOKEN for item in plan.scheduled if item.samples}

    def release(self, request_id: str) -> None:
        self.preloaded.discard(request_id)
