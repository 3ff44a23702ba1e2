"""The one step loop every engine runs: schedule → execute → update → retire.

``EngineCore`` owns the scheduler and the KV block manager and drives them one
step at a time. What a step *costs* and which token it *samples* is the
executor's business, behind one interface::

    executor.execute(plan) -> {request_id: sampled token}   # for requests that emit one
    executor.release(request_id)                            # a request left: drop its state
    executor.last_prepare_time                              # host seconds of the last execute

* ``executor.ModelExecutor`` runs the real model; the clock is wall time.
* ``sim.SimExecutor`` prices the step from the roofline and moves a
  ``VirtualClock`` forward by that much, so "now" after execute is the step's end.
* the lab checks plug in a fake model that returns a fixed token per position.

The scheduler never knows which one it has, so the real engine, the simulator
and the labs' reference make exactly the same decisions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.metrics import StepStats
from tinyserve.request import Request
from tinyserve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

# Steps kept in ``EngineCore.step_stats`` by default: enough for every notebook
# plot, bounded so that a long-lived server does not grow without limit.
DEFAULT_STEP_STATS_WINDOW = 10_000


class Executor(Protocol):
    # Seconds the last ``execute`` spent laying out its inputs on the host (0 for
    # executors with no such work): ``StepStats.prepare_time``.
    last_prepare_time: float

    def execute(self, plan: SchedulerOutput) -> dict[str, int]: ...

    def release(self, request_id: str) -> None: ...


class VirtualClock:
    """A clock that only moves when told to (the simulator's)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class StepResult:
    plan: SchedulerOutput
    sampled: dict[str, int]          # request id -> the token it emitted this step
    finished: list[Request]          # retired this step, their blocks already freed
    stats: StepStats


class EngineCore:
    """Scheduler + block manager + an executor, stepped by ``step()``.

    ``step_stats`` keeps the last ``step_stats_window`` steps (``None``: all of
    them, as the simulator needs for its summaries). ``check_invariants`` audits
    every KV block after every step (slow; for tests).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, executor: Executor,
                 clock: Callable[[], float], *,
                 step_stats_window: int | None = DEFAULT_STEP_STATS_WINDOW,
                 record_batches: bool = True, check_invariants: bool = False):
        self.config, self.block_manager, self.executor = config, block_manager, executor
        self.clock = clock
        self.scheduler = Scheduler(config, block_manager)
        self.step_stats: deque[StepStats] = deque(maxlen=step_stats_window)
        self.num_steps = 0
        self.record_batches, self.check_invariants = record_batches, check_invariants

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject a request the engine could never finish, before it takes a seat.

        A request stops at ``max_model_len`` tokens (finish reason "length"), so only
        the prompt itself must fit the context.
        """
        config, num_kv_blocks = self.config, self.block_manager.num_blocks
        if num_prompt_tokens > config.max_model_len:
            raise ValueError(f"prompt is {num_prompt_tokens} tokens, longer than the model's "
                             f"context (max_model_len={config.max_model_len})")
        total = min(num_prompt_tokens + max_tokens, config.max_model_len)
        need = blocks_for(total, config.block_size)
        if need > num_kv_blocks:
            raise ValueError(f"request needs {need} KV blocks ({total} tokens) but the cache has "
                             f"only num_kv_blocks={num_kv_blocks}")
        if not config.enable_chunked_prefill and total > config.max_num_batched_tokens:
            # Without chunking a prompt (or its recompute after preemption) must fit one step.
            raise ValueError(f"request of up to {total} tokens exceeds max_num_batched_tokens="
                             f"{config.max_num_batched_tokens}; enable_chunked_prefill or raise "
                             "the budget")

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is (its blocks freed); None if it is unknown."""
        request = self.scheduler.abort(request_id, self.clock())
        if request is not None:
            self.executor.release(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        start = self.clock()
        plan = self.scheduler.schedule(start)
        if plan.is_empty and not plan.preempted and self.scheduler.has_unfinished_requests():
            # Only a policy that admits nobody gets here: check_fits let in only requests
            # that fit an empty cache and budget. Name the request it leaves waiting.
            waiting = self.scheduler.waiting
            head = repr(waiting[0].request_id) if waiting else "none"
            raise RuntimeError(f"engine stalled: nothing can be scheduled; the request at the "
                               f"head of the queue ({head}) waits, and policy "
                               f"{self.scheduler.policy.name!r} admitted nobody")
        planned = self.clock()
        sampled = self.executor.execute(plan)
        ran = self.clock()
        finished = self.scheduler.update(plan, sampled, ran)
        for request in finished:
            self.executor.release(request.request_id)
        end = self.clock()
        stats = self._stats(plan, start, end - start, (planned - start) + (end - ran))
        self.step_stats.append(stats)
        self.num_steps += 1
        if self.check_invariants:
            self.block_manager.check_integrity()
        return StepResult(plan, sampled, finished, stats)

    def steps_since(self, num_steps: int) -> list[StepStats]:
        """Stats of the steps run after the first ``num_steps`` (e.g. ``core.num_steps``
        read before a measurement)."""
        count = self.num_steps - num_steps
        if count > len(self.step_stats):
            raise ValueError(f"only the last {len(self.step_stats)} steps are kept, "
                             f"{count} were asked for")
        return list(self.step_stats)[len(self.step_stats) - count:]

    def _stats(self, plan: SchedulerOutput, start: float, duration: float,
               schedule_time: float) -> StepStats:
        bm, tokens = self.block_manager, plan.num_scheduled_tokens
        decode = sum(1 for s in plan.scheduled if s.is_decode)
        prepare = self.executor.last_prepare_time
        return StepStats(
            start=start, duration=duration, schedule_time=schedule_time, prepare_time=prepare,
            num_running=plan.num_running, num_waiting=plan.num_waiting,
            num_scheduled_tokens=tokens, num_prefill_tokens=tokens - decode,
            num_decode_tokens=decode, num_preempted=len(plan.preempted),
            num_used_blocks=bm.num_used_blocks, kv_usage=bm.usage,
            batch=[(s.request.request_id, s.num_new_tokens) for s in plan.scheduled]
            if self.record_batches else [])
