"""Serving at GPU scale on a laptop: the real scheduler on a virtual clock.

``simulate`` runs the very ``Scheduler`` and ``BlockManager`` the engine runs,
with the model replaced by ``SimExecutor``: instead of computing logits it
returns how long the step would take on the given hardware, from the roofline
of ``tinyserve.hardware``:

    step time = max(bytes moved / bandwidth, FLOPs / peak) + overhead

where the bytes are the weights (read once per step, however many tokens) plus
every scheduled request's KV cache, and the FLOPs are 2 per parameter per
token plus attention over each token's context. The clock then jumps by that
time. Arrivals, queueing, chunked prefill, preemption and prefix caching all
happen exactly as in the engine; only the arithmetic is skipped, so 10,000
requests of a 7B model on an A100 take seconds, not hours.

    from tinyserve.sim import simulate
    from tinyserve.workload import make_workload
    result = simulate(make_workload("mixed", 1000, rate=20), hardware="A100_SXM_80GB")
    result.summary(ttft_slo=0.5, tpot_slo=0.05)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tinyserve.hardware import (HardwareSpec, ModelSpec, LLAMA_7B, MODELS, get_hardware,
                                kv_bytes_per_token, weight_bytes)
from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.metrics import RequestMetrics, StepStats, request_metrics, summarize
from tinyserve.request import Request, SamplingParams
from tinyserve.scheduler import Policy, Scheduler, SchedulerConfig, SchedulerOutput
from tinyserve.workload import RequestSpec, prompt_token_ids

# What the simulated model "samples": any id works, since every request runs for
# exactly its output length (ignore_eos).
SIM_TOKEN = 7


class SimExecutor:
    """Stands in for ``ModelExecutor``: prices a step instead of running it."""

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, dtype: str = "fp16",
                 overhead: float = 0.0):
        if overhead < 0:
            raise ValueError(f"overhead must be >= 0, got {overhead!r}")
        self.hardware, self.model, self.dtype = hardware, model, dtype
        self.overhead = overhead
        bandwidth, peak = hardware.memory_bandwidth, hardware.peak_flops(dtype)
        self.weight_time = weight_bytes(model, dtype) / bandwidth
        self.kv_time_per_token = kv_bytes_per_token(model, dtype) / bandwidth
        self.compute_time_per_token = 2 * model.num_parameters / peak
        # QK^T and PV: 2 matmuls x 2 FLOPs x hidden per (query, key) pair per layer.
        self.attention_time_per_pair = 4 * model.num_layers * model.hidden_size / peak

    def step_time(self, plan: SchedulerOutput) -> float:
        if plan.is_empty:
            return 0.0
        tokens = kv_tokens = pairs = 0
        for item in plan.scheduled:
            n, done = item.num_new_tokens, item.request.num_computed_tokens
            tokens += n
            kv_tokens += done + n                # attention reads the whole context
            pairs += n * done + n * (n + 1) // 2  # each new token attends to all before it
        memory = self.weight_time + kv_tokens * self.kv_time_per_token
        compute = tokens * self.compute_time_per_token + pairs * self.attention_time_per_pair
        return max(memory, compute) + self.overhead

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        return {item.request.request_id: SIM_TOKEN for item in plan.scheduled if item.samples}


@dataclass
class SimOutput:
    request_id: str
    spec: RequestSpec
    metrics: RequestMetrics
    finish_reason: str | None


@dataclass
class SimResult:
    """What ``simulate`` returns: per-request outputs (in input order) and per-step stats."""
    outputs: list[SimOutput]
    steps: list[StepStats]
    num_kv_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    unfinished: int = 0                    # requests still queued or running at max_time
    config: dict = field(default_factory=dict)

    def __iter__(self):
        return iter(self.outputs)

    def __len__(self):
        return len(self.outputs)

    def __getitem__(self, index):
        return self.outputs[index]

    @property
    def metrics(self) -> list[RequestMetrics]:
        return [o.metrics for o in self.outputs]

    def summary(self, ttft_slo: float | None = None, tpot_slo: float | None = None,
                e2e_slo: float | None = None) -> dict[str, float]:
        s = summarize(self.metrics, ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)
        busy = [st for st in self.steps if st.num_scheduled_tokens]
        s["num_steps"] = len(self.steps)
        s["mean_step_time"] = (sum(st.duration for st in busy) / len(busy)) if busy else float("nan")
        s["mean_batch_size"] = (sum(st.num_running for st in busy) / len(busy)) if busy else 0.0
        s["max_queue_length"] = max((st.num_waiting for st in self.steps), default=0)
        s["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        s["num_preemptions"] = self.num_preemptions
        s["unfinished"] = self.unfinished
        return s


def default_num_kv_blocks(hardware: HardwareSpec, model: ModelSpec, dtype: str, block_size: int,
                          memory_utilization: float = 0.9) -> int:
    """Blocks that fit in the device memory left after the weights (as vLLM sizes its cache)."""
    free = hardware.memory_size * memory_utilization - weight_bytes(model, dtype)
    blocks = int(free // (kv_bytes_per_token(model, dtype) * block_size))
    if blocks < 1:
        raise ValueError(f"{model.name} in {dtype} does not fit in {hardware.name}'s memory")
    return blocks


def _resolve(hardware, model) -> tuple[HardwareSpec, ModelSpec]:
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"model: unknown model {model!r}; choose one of {sorted(MODELS)}")
        model = MODELS[model]
    return hardware, model


def simulate(requests: Sequence[RequestSpec], hardware: HardwareSpec | str = "A100_SXM_80GB",
             model: ModelSpec | str = LLAMA_7B, dtype: str = "fp16", *,
             max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, block_size: int = 16,
             num_kv_blocks: int | None = None, batching: str = "continuous",
             policy: str | Policy = "fcfs", enable_chunked_prefill: bool = True,
             enable_prefix_caching: bool = False, max_model_len: int = 4096,
             overhead: float = 0.0, output_len_hint: bool = False,
             max_time: float | None = None, record_batches: bool = False,
             check_invariants: bool = False) -> SimResult:
    """Serve ``requests`` on simulated ``hardware`` with the real scheduler.

    Engine knobs have the engine's names and meanings. ``output_len_hint=True``
    tells each request its true output length (an oracle for shortest-job-first).
    ``max_time`` stops the clock early (an overloaded system never drains);
    requests not finished by then are counted in ``unfinished``.
    ``check_invariants`` audits every KV block after every step (slow; for tests).
    """
    hardware, model = _resolve(hardware, model)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             block_size=block_size, batching=batching, policy=policy,
                             enable_chunked_prefill=enable_chunked_prefill,
                             max_model_len=max_model_len)
    if num_kv_blocks is None:
        num_kv_blocks = default_num_kv_blocks(hardware, model, dtype, block_size)
    block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
    scheduler = Scheduler(config, block_manager)
    executor = SimExecutor(hardware, model, dtype, overhead)

    specs = sorted(enumerate(requests), key=lambda pair: pair[1].arrival)
    for index, spec in specs:
        _check_fits(spec, index, config, num_kv_blocks)

    requests_by_index: dict[int, Request] = {}
    steps: list[StepStats] = []
    clock, next_arrival = 0.0, 0
    while next_arrival < len(specs) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests() and specs[next_arrival][1].arrival > clock:
            clock = specs[next_arrival][1].arrival            # idle: jump to the next arrival
        if max_time is not None and clock >= max_time:
            break
        while next_arrival < len(specs) and specs[next_arrival][1].arrival <= clock:
            index, spec = specs[next_arrival]
            request = Request(str(index), prompt_token_ids(spec, index),
                              SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                              arrival_time=spec.arrival, priority=spec.priority,
                              output_len_hint=spec.output_len if output_len_hint else None)
            request.queued_time = spec.arrival
            requests_by_index[index] = request
            scheduler.add_request(request)
            next_arrival += 1
        plan = scheduler.schedule(clock)
        if plan.is_empty and not plan.preempted:
            if next_arrival == len(specs):
                raise RuntimeError("simulation stalled: requests wait but nothing can be scheduled")
            clock = max(clock, specs[next_arrival][1].arrival)
            continue
        duration = executor.step_time(plan)
        start, clock = clock, clock + duration
        scheduler.update(plan, executor.execute(plan), clock)
        steps.append(_step_stats(plan, start, duration, block_manager, record_batches))
        if check_invariants:
            block_manager.check_integrity()
    if not scheduler.has_unfinished_requests() and block_manager.num_used_blocks:
        raise RuntimeError(f"{block_manager.num_used_blocks} KV blocks still held after the last request")

    outputs = []
    for index, spec in enumerate(requests):
        request = requests_by_index.get(index)
        if request is None:          # never arrived before max_time
            request = Request(str(index), [SIM_TOKEN], SamplingParams(max_tokens=spec.output_len),
                              arrival_time=spec.arrival)
        outputs.append(SimOutput(str(index), spec, request_metrics(request), request.finish_reason))
    unfinished = sum(1 for o in outputs if o.metrics.finished_time is None)
    return SimResult(outputs, steps, num_kv_blocks, block_manager.prefix_cache_hit_rate,
                     scheduler.num_preemptions, unfinished,
                     config=dict(hardware=hardware.name, model=model.name, dtype=dtype,
                                 **vars(config) | {"policy": scheduler.policy.name}))


def _check_fits(spec: RequestSpec, index: int, config: SchedulerConfig, num_kv_blocks: int) -> None:
    total = spec.prompt_len + spec.output_len
    if total > config.max_model_len:
        raise ValueError(f"request {index}: prompt_len + output_len = {total} exceeds "
                         f"max_model_len={config.max_model_len}")
    if blocks_for(total, config.block_size) > num_kv_blocks:
        raise ValueError(f"request {index} needs {blocks_for(total, config.block_size)} KV blocks "
                         f"but the cache has only num_kv_blocks={num_kv_blocks}")
    if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
        raise ValueError(f"request {index} of {total} tokens exceeds max_num_batched_tokens="
                         f"{config.max_num_batched_tokens}; enable_chunked_prefill or raise the budget")


def _step_stats(plan: SchedulerOutput, start: float, duration: float, bm: BlockManager,
                record_batches: bool) -> StepStats:
    decode = sum(1 for s in plan.scheduled if s.is_decode)
    tokens = plan.num_scheduled_tokens
    return StepStats(start=start, duration=duration, schedule_time=0.0, prepare_time=0.0,
                     num_running=plan.num_running, num_waiting=plan.num_waiting,
                     num_scheduled_tokens=tokens, num_prefill_tokens=tokens - decode,
                     num_decode_tokens=decode, num_preempted=len(plan.preempted),
                     num_used_blocks=bm.num_used_blocks, kv_usage=bm.usage,
                     batch=[(s.request.request_id, s.num_new_tokens) for s in plan.scheduled]
                     if record_batches else [])
