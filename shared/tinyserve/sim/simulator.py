"""Serving at GPU scale on a laptop: the engine's core loop on a virtual clock.

``simulate`` runs the very ``EngineCore`` (scheduler and block manager) the
engine runs, with the model replaced by ``sim.executor.SimExecutor``: instead
of computing logits it returns how long the step would take on the given
hardware, from a cost model (by default the pure roofline of
``tinyserve.hardware``; ``cost_model="vllm-like"`` is calibrated to published
vLLM measurements, see ``sim.cost_model``), and the clock jumps by that time.
Arrivals, queueing, chunked prefill, preemption and prefix caching all
happen exactly as in the engine; only the arithmetic is skipped, so 10,000
requests of a 7B model on an A100 take seconds, not hours.

    from tinyserve.sim import simulate
    from tinyserve.workload import make_workload
    result = simulate(make_workload("mixed", 1000, rate=20), hardware="A100_SXM_80GB")
    result.summary(ttft_slo=0.5, tpot_slo=0.05)

``max_concurrency`` drives it as a closed loop, the way ``vllm bench serve
--max-concurrency N`` does: at most N requests are in flight, and a request
whose arrival time has come waits for a free slot; its TTFT counts from the
moment it gets one.

``frontend_time`` puts an API server in front of the engine: every request first
takes that many seconds of its one thread (HTTP, tokenizing, handing the request
to the engine), one request after another in arrival order, and only then joins
the engine's queue; ``frontend_latency`` more seconds pass on its way there that
do not hold the thread (the hop to the engine process; requests overlap in it).
Its TTFT still counts from its arrival at the server, so a burst of requests
waits in this queue too, as behind ``vllm serve``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from tinyserve.core import EngineCore, VirtualClock
from tinyserve.hardware import (HardwareSpec, ModelSpec, LLAMA_7B, MODELS, get_hardware,
                                kv_bytes_per_token, weight_bytes)
from tinyserve.kv_cache import BlockManager
from tinyserve.metrics import RequestMetrics, StepStats, request_metrics, summarize
from tinyserve.request import Request, SamplingParams
from tinyserve.policies import Policy
from tinyserve.scheduler import SchedulerConfig
from tinyserve.sim.cost_model import CostModel
from tinyserve.sim.executor import SIM_TOKEN, SimExecutor
from tinyserve.workload import RequestSpec, prompt_token_ids


@dataclass
class SimOutput:
    request_id: str
    spec: RequestSpec
    metrics: RequestMetrics
    finish_reason: str | None
    replica: int | None = None       # which replica served it (tinyserve.sim.cluster)


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
        s.update(step_summary(self.steps))
        s["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        s["num_preemptions"] = self.num_preemptions
        s["unfinished"] = self.unfinished
        s.update(load_stats(self))
        return s


def step_summary(steps: list[StepStats]) -> dict[str, float]:
    """Per-step keys of a summary (over one replica's steps, or every replica's)."""
    busy = [st for st in steps if st.num_scheduled_tokens]
    return {"num_steps": len(steps),
            "mean_step_time": sum(st.duration for st in busy) / len(busy) if busy else float("nan"),
            "mean_batch_size": sum(st.num_running for st in busy) / len(busy) if busy else 0.0,
            "max_queue_length": max((st.num_waiting for st in steps), default=0)}


def load_stats(result: "SimResult") -> dict[str, float]:
    """Summary keys that ``diagnose.diagnose`` reads to tell queueing from slow steps.

    * ``mean_queue_time``: arrival → first scheduled step, over completed requests.
    * ``arrival_rate``: offered requests per second over the arrival window.
    * ``queue_growth_rate``: least-squares slope of the waiting-queue length against
      time while requests still arrive (requests/s): ~0 below capacity, about
      arrival rate - service rate above it.
    * ``mean_kv_usage``: mean fraction of KV blocks in use over busy steps.
    * ``prefill_token_share``: prefill tokens / all scheduled tokens.
    """
    nan = float("nan")
    queue = [m.queue_time for m in result.metrics
             if m.finished_time is not None and m.queue_time is not None]
    arrivals = sorted(o.spec.arrival for o in result.outputs)
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    window = [(st.start, st.num_waiting) for st in result.steps if arrivals and st.start <= arrivals[-1]]
    growth = 0.0
    if len(window) >= 2:
        t = [w[0] for w in window]
        q = [w[1] for w in window]
        t_mean, q_mean = sum(t) / len(t), sum(q) / len(q)
        var = sum((x - t_mean) ** 2 for x in t)
        if var > 0:
            growth = sum((x - t_mean) * (y - q_mean) for x, y in zip(t, q)) / var
    busy = [st for st in result.steps if st.num_scheduled_tokens]
    scheduled = sum(st.num_scheduled_tokens for st in busy)
    return {
        "mean_queue_time": sum(queue) / len(queue) if queue else nan,
        "arrival_rate": (len(arrivals) - 1) / span if span > 0 else float("inf"),
        "queue_growth_rate": growth,
        "mean_kv_usage": sum(st.kv_usage for st in busy) / len(busy) if busy else 0.0,
        "prefill_token_share": sum(st.num_prefill_tokens for st in busy) / scheduled if scheduled else 0.0,
    }


def default_num_kv_blocks(hardware: HardwareSpec, model: ModelSpec, dtype: str, block_size: int,
                          memory_utilization: float = 0.9) -> int:
    """Blocks that fit in the device memory left after the weights (as vLLM sizes its cache)."""
    free = hardware.memory_size * memory_utilization - weight_bytes(model, dtype)
    blocks = int(free // (kv_bytes_per_token(model, dtype) * block_size))
    if blocks < 1:
        raise ValueError(f"{model.name} in {dtype} does not fit in {hardware.name}'s memory")
    return blocks


def resolve_hardware_and_model(hardware, model) -> tuple[HardwareSpec, ModelSpec]:
    """Specs from preset names (``"A100_SXM_80GB"``, ``"llama-7b"``) or specs as given."""
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"model: unknown model {model!r}; choose one of {sorted(MODELS)}")
        model = MODELS[model]
    return hardware, model


class SimEngine:
    """One simulated replica: ``core.EngineCore`` running ``SimExecutor`` on its own clock.

    ``add`` queues a request; ``advance_to(t)`` runs steps until the replica is
    idle or its clock reaches ``t`` (a step that starts before ``t`` runs to its
    end, as on a real GPU). ``simulate`` drives one; ``tinyserve.sim.cluster`` many.
    """

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, dtype: str = "fp16", *,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, block_size: int = 16,
                 num_kv_blocks: int | None = None, batching: str = "continuous",
                 policy: str | Policy = "fcfs", enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = False, max_model_len: int = 4096,
                 overhead: float = 0.0, cost_model: str | CostModel = "roofline",
                 output_len_hint: bool = False,
                 record_batches: bool = False, check_invariants: bool = False):
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, batching=batching, policy=policy,
            enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len)
        if num_kv_blocks is None:
            num_kv_blocks = default_num_kv_blocks(hardware, model, dtype, block_size)
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.virtual_clock = VirtualClock()
        self.executor = SimExecutor(hardware, model, dtype, overhead, self.virtual_clock, cost_model)
        # Every step is kept: the summaries need the whole run.
        self.core = EngineCore(self.config, self.block_manager, self.executor, self.virtual_clock,
                               step_stats_window=None, record_batches=record_batches,
                               check_invariants=check_invariants)
        self.scheduler = self.core.scheduler
        self.steps = self.core.step_stats
        self.hardware, self.model, self.dtype = hardware, model, dtype
        self.output_len_hint = output_len_hint
        self.requests: dict[str, Request] = {}

    @property
    def clock(self) -> float:
        """This replica's time: the end of its last step, or its last idle arrival."""
        return self.virtual_clock.now

    @property
    def num_outstanding(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def check_fits(self, spec: RequestSpec, request_id: str) -> None:
        try:
            self.core.check_fits(spec.prompt_len, spec.output_len)
        except ValueError as e:
            raise ValueError(f"request {request_id}: {e}") from None

    def add(self, spec: RequestSpec, request_id: str, token_ids: list[int] | None = None,
            arrival: float | None = None, output_len: int | None = None,
            ready: float | None = None) -> Request:
        """Queue a request (``token_ids`` default to the workload's deterministic prompt).

        ``arrival`` is when the client sent it (its TTFT counts from there); ``ready``,
        when it reaches the engine (later, behind an API server; default: ``arrival``)."""
        output_len = spec.output_len if output_len is None else output_len
        request = Request(request_id,
                          prompt_token_ids(spec, int(request_id)) if token_ids is None else token_ids,
                          SamplingParams(max_tokens=output_len, ignore_eos=True),
                          arrival_time=spec.arrival if arrival is None else arrival,
                          priority=spec.priority,
                          output_len_hint=output_len if self.output_len_hint else None)
        request.queued_time = request.arrival_time
        if not self.scheduler.has_unfinished_requests():                # an idle replica waits
            self.virtual_clock.now = max(self.virtual_clock.now,
                                         request.arrival_time if ready is None else ready)
        self.core.add_request(request)
        self.requests[request_id] = request
        return request

    def warm_up(self, specs: Sequence[RequestSpec]) -> None:
        """Serve ``specs`` (all at once) and forget them, all but what they left in the
        prefix cache: a benchmark run a second time on a server that just ran it. The
        clock, steps, requests and hit and preemption counts start over; request ids
        (so token ids) are the ones the measured run gives the same specs."""
        for index, spec in enumerate(specs):
            self.add(spec, str(index), arrival=0.0)
        self.drain()
        self.steps.clear()
        self.requests.clear()
        self.virtual_clock.now = 0.0
        self.block_manager.num_hit_tokens = self.block_manager.num_queried_tokens = 0
        self.scheduler.num_preemptions = 0

    def step(self) -> list[Request]:
        """Run one step at the replica's clock; return the requests it finished."""
        return self.core.step().finished

    def advance_to(self, t: float) -> list[Request]:
        finished = []
        while self.clock < t and self.scheduler.has_unfinished_requests():
            finished += self.step()
        return finished

    def drain(self, max_time: float | None = None) -> list[Request]:
        finished = self.advance_to(float("inf") if max_time is None else max_time)
        if not self.scheduler.has_unfinished_requests() and self.block_manager.num_used_blocks:
            raise RuntimeError(f"{self.block_manager.num_used_blocks} KV blocks still held "
                               f"after the last request")
        return finished

    def result(self, specs: Sequence[RequestSpec]) -> "SimResult":
        """Outputs in the order of ``specs`` (request ids are their indices)."""
        outputs = []
        for index, spec in enumerate(specs):
            request = self.requests.get(str(index))
            if request is None:          # never arrived before max_time
                request = Request(str(index), [SIM_TOKEN], SamplingParams(max_tokens=spec.output_len),
                                  arrival_time=spec.arrival)
            outputs.append(SimOutput(str(index), spec, request_metrics(request), request.finish_reason))
        unfinished = sum(1 for o in outputs if o.metrics.finished_time is None)
        config = dict(hardware=self.hardware.name, model=self.model.name, dtype=self.dtype,
                      cost_model=self.executor.cost_model.name,
                      **vars(self.config) | {"policy": self.scheduler.policy.name})
        return SimResult(outputs, list(self.steps), self.block_manager.num_blocks,
                         self.block_manager.prefix_cache_hit_rate, self.scheduler.num_preemptions,
                         unfinished, config=config)


def simulate(requests: Sequence[RequestSpec], hardware: HardwareSpec | str = "A100_SXM_80GB",
             model: ModelSpec | str = LLAMA_7B, dtype: str = "fp16", *,
             max_time: float | None = None, max_concurrency: int | None = None,
             frontend_time: float = 0.0, frontend_latency: float = 0.0,
             warmup: Sequence[RequestSpec] = (), **engine_kwargs) -> SimResult:
    """Serve ``requests`` on simulated ``hardware`` with the real scheduler.

    ``engine_kwargs`` are ``SimEngine``'s: the engine's knobs with the engine's
    names and meanings (max_num_seqs, max_num_batched_tokens, block_size,
    num_kv_blocks, batching, policy, enable_chunked_prefill,
    enable_prefix_caching, max_model_len), plus ``cost_model`` (``"roofline"``,
    the default, ``"vllm-like"`` or a ``sim.cost_model`` object), ``overhead``
    (seconds added to every step), ``output_len_hint=True`` (tell each request
    its true output length: an oracle for shortest-job-first), ``record_batches``
    (keep every step's batch) and ``check_invariants`` (audit every KV block
    after every step; slow, for tests). ``max_time`` stops the clock early (an
    overloaded system never drains); requests not finished by then count as
    ``unfinished``. ``max_concurrency`` keeps at most that many requests in
    flight (a closed loop, as ``vllm bench serve --max-concurrency``).
    ``frontend_time``: seconds of serial API-server work per request before it
    reaches the engine, and ``frontend_latency`` seconds more on its way there
    that overlap across requests (see the module doc; 0, the default, is an
    offline engine). ``warmup``: requests served first and left out of the result,
    but not out of the prefix cache (``SimEngine.warm_up``), as when a benchmark
    runs again on the server that just ran it.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
    for name, value in (("frontend_time", frontend_time), ("frontend_latency", frontend_latency)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    hardware, model = resolve_hardware_and_model(hardware, model)
    engine = SimEngine(hardware, model, dtype, **engine_kwargs)
    for index, spec in enumerate(requests):
        engine.check_fits(spec, str(index))
    if warmup:
        engine.warm_up(warmup)
    # The times at which a client slot frees up; an open loop has one per request.
    free_slots = [0.0] * (max_concurrency or len(requests))
    frontend_free = 0.0                  # when the API server's thread is next idle
    for index, spec in sorted(enumerate(requests), key=lambda pair: pair[1].arrival):
        if max_time is not None and spec.arrival >= max_time:
            break
        for done in engine.advance_to(spec.arrival):
            heapq.heappush(free_slots, done.finished_time)
        while not free_slots:
            for done in engine.step():
                heapq.heappush(free_slots, done.finished_time)
        arrival = max(spec.arrival, heapq.heappop(free_slots))
        if max_time is not None and arrival >= max_time:
            break
        ready = arrival
        if frontend_time or frontend_latency:
            frontend_free = max(frontend_free, arrival) + frontend_time
            ready = frontend_free + frontend_latency
            for done in engine.advance_to(ready):
                heapq.heappush(free_slots, done.finished_time)
        engine.add(spec, str(index), arrival=arrival, ready=ready)
    engine.drain(max_time)
    return engine.result(requests)
