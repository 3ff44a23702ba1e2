"""Lab 01's workloads, and what the engine does with them, step by step.

The checks of lab 01 (``tinyserve.labs.lab01``) run the student's functions
next to the engine's real ``Scheduler``. This module holds the engine's side:
seeded workloads chosen so that the engine never preempts, the engine's own
step loop on them with a fake model (``engine_trace``), and that trace replayed
as either function the student writes, to test the other one alone (no second
implementation of the lab's answer ships in the package).
"""

from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass, field

from tinyserve.core import EngineCore, VirtualClock
from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.request import Request, SamplingParams
from tinyserve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tinyserve.tokenizer import load_default_tokenizer

EOS = load_default_tokenizer().eos_token_id      # the shipped tokenizer's <|eos|>


# ---- workloads ----------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0
    ignore_eos: bool = True
    eos_at: int | None = None     # output index at which the fake model says EOS

    def new_request(self) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)
        return Request(self.request_id, list(self.prompt), params,
                       arrival_time=float(self.arrival_step), eos_token_id=EOS)


@dataclass
class Workload:
    name: str
    config: SchedulerConfig
    num_blocks: int
    specs: list[Spec]
    # Filled by simulating the engine: which limit stopped admission, per step.
    binding: set[str] = field(default_factory=set)
    num_steps: int = 0


def fake_token(spec: Spec, index: int) -> int:
    """The 'model' of the step-by-step checks: a fixed token per (request, position)."""
    if spec.eos_at is not None and index == spec.eos_at:
        return EOS
    return 10 + (int(spec.request_id) * 7919 + index * 104729) % 2000


PROFILES = {
    # name: (seats, budget range, block_size, blocks range or None, prompt range, max_tokens range)
    "seats": ((2, 3), (256, 256), 16, None, (3, 20), (1, 24)),
    "budget": ((6, 6), (8, 20), 8, None, (5, 40), (1, 12)),
    "blocks": ((6, 6), (64, 64), 4, (10, 16), (3, 14), (1, 10)),
    "mixed": ((4, 4), (16, 28), 4, (16, 26), (3, 24), (1, 16)),
}


def _random_workload(profile: str, seed: int, num_requests: int = 14) -> Workload:
    seats, budget, block_size, blocks, prompt, out = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")
    specs = []
    for i in range(num_requests):
        max_tokens = rng.randint(*out)
        stop = rng.random() < 0.3 and max_tokens > 2
        specs.append(Spec(str(i), tuple(rng.randrange(10, 2000) for _ in range(rng.randint(*prompt))),
                          max_tokens, arrival_step=rng.randint(0, 8) if i else 0,
                          ignore_eos=not stop, eos_at=rng.randrange(1, max_tokens - 1) if stop else None))
    specs.sort(key=lambda s: s.arrival_step)       # the queue is in arrival order
    longest = max(len(s.prompt) + s.max_tokens for s in specs)
    num_blocks = rng.randint(*blocks) if blocks else 256
    num_blocks = max(num_blocks, blocks_for(longest, block_size))
    config = SchedulerConfig(max_num_seqs=rng.randint(*seats), max_num_batched_tokens=rng.randint(*budget),
                             block_size=block_size, batching="continuous", enable_chunked_prefill=True)
    return Workload(f"{profile}-{seed}", config, num_blocks, specs)


@functools.lru_cache(maxsize=None)
def workloads(per_profile: int = 3) -> tuple[Workload, ...]:
    """Seeded workloads, each free of preemption and each stopped by its profile's limit."""
    chosen = []
    for profile in PROFILES:
        seed, found = 0, 0
        while found < per_profile:
            w = _random_workload(profile, seed)
            seed += 1
            trace = engine_trace(w)
            if trace.num_preemptions or (profile != "mixed" and profile not in w.binding):
                continue
            chosen.append(w)
            found += 1
    return tuple(chosen)


# ---- the engine's side --------------------------------------------------------------

@dataclass
class StepRecord:
    plan: list[tuple[str, int]]
    running: list[str]          # after planning
    waiting: list[str]
    free_blocks: int            # after planning
    finished: list[str]         # retired by the engine at the end of the step


@dataclass
class Trace:
    steps: list[StepRecord]
    outputs: dict[str, list[int]]
    num_preemptions: int


class TraceExecutor:
    """The fake model as an executor of ``core.EngineCore``; it also records, between
    planning and the update, what the step looked like (the lab compares against it)."""

    last_prepare_time = 0.0     # no inputs to lay out

    def __init__(self, w: Workload, specs: dict[str, Spec]):
        self.w, self.specs = w, specs
        self.scheduler: Scheduler | None = None
        self.records: list[StepRecord] = []

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        sched, cfg = self.scheduler, self.w.config
        if sched.waiting:
            left = cfg.max_num_batched_tokens - plan.num_scheduled_tokens
            self.w.binding.add("seats" if len(sched.running) >= cfg.max_num_seqs
                               else "budget" if left == 0 else "blocks")
        self.records.append(StepRecord(
            [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled],
            [r.request_id for r in sched.running], [r.request_id for r in sched.waiting],
            sched.block_manager.num_free_blocks, []))
        return {s.request.request_id: fake_token(self.specs[s.request.request_id],
                                                 len(s.request.output_token_ids))
                for s in plan.scheduled if s.samples}

    def release(self, request_id: str) -> None:
        pass


def engine_trace(w: Workload) -> Trace:
    """Run the engine's own step loop on a workload with the fake model; record every step."""
    specs = {s.request_id: s for s in w.specs}
    requests = {rid: s.new_request() for rid, s in specs.items()}
    executor, clock = TraceExecutor(w, specs), VirtualClock()     # time = the step's index
    core = EngineCore(w.config, BlockManager(w.num_blocks, w.config.block_size), executor, clock)
    executor.scheduler = core.scheduler
    pending = deque(w.specs)
    while pending or core.has_unfinished_requests():
        step = len(executor.records)
        clock.now = float(step)
        while pending and pending[0].arrival_step <= step:
            core.add_request(requests[pending.popleft().request_id])
        result = core.step()
        executor.records[-1].finished = [r.request_id for r in result.finished]
        if step > 10_000:
            raise RuntimeError(f"engine did not finish workload {w.name}")
    w.num_steps = len(executor.records)
    return Trace(executor.records, {rid: r.output_token_ids for rid, r in requests.items()},
                 core.scheduler.num_preemptions)


# ---- the engine's decisions as the partner of the function under test ----------------

def is_finished(request: Request, config: SchedulerConfig) -> bool:
    return bool(request.output_token_ids) and request.check_stop(config.max_model_len) is not None


def replayed_step(trace: Trace):
    """A ``continuous_step`` that replays the engine's own plans from ``trace``, step by step:
    the partner of the student's ``retire`` while that one is tested alone."""
    records = iter(trace.steps)

    def step(running, waiting, block_manager, config):
        record = next(records)
        while waiting and waiting[0].request_id in record.running:     # admitted, in FCFS order
            running.append(waiting.popleft())
        by_id = {r.request_id: r for r in running}
        plan = [(by_id[rid], n) for rid, n in record.plan]
        for r, n in plan:
            block_manager.allocate(r.request_id, r.num_computed_tokens + n)
        return plan

    return step


def replayed_retire(trace: Trace):
    """A ``retire`` that takes out what the engine retired at the end of the previous step
    (nothing before the first): the partner of the student's ``continuous_step``."""
    retired = iter([[]] + [record.finished for record in trace.steps])

    def retire(running, block_manager, config):
        ids = set(next(retired))
        finished = [r for r in running if r.request_id in ids]
        for r in finished:
            running.remove(r)
            block_manager.free(r.request_id)
        return finished

    return retire
