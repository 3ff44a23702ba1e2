"""Checks that the lab notebooks call (``from tinyserve.labs import check_...``).

Each check runs the student's function(s) on seeded workloads next to the
engine's real ``Scheduler`` and compares them step by step. On the first
difference it raises ``AssertionError`` with a hint in Chinese and English that
names the step, the request, what was expected and what the function did.

Lab 01 (continuous batching) asks for two functions:

* ``retire(running, block_manager, config) -> list[Request]``: take finished
  requests out of ``running`` (the others keep their order), free their KV
  blocks, return them.
* ``continuous_step(running, waiting, block_manager, config) -> [(Request, n)]``:
  plan one step: running requests first, in order, each ``min(tokens left,
  budget left)`` tokens; then admit from the head of ``waiting`` while there is
  a seat, budget and the blocks for its first chunk; stop at the first request
  that does not fit. Allocate the blocks of everything planned.

That is ``Scheduler.schedule`` in continuous mode with chunked prefill, minus
preemption: every workload here is chosen so that the engine never preempts.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass, field

from tinyserve.core import EngineCore, VirtualClock
from tinyserve.kv_cache import BlockManager, blocks_for
from tinyserve.request import Request, SamplingParams
from tinyserve.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["check_retire", "check_continuous_step", "check_end_to_end"]

EOS = 2046          # the shipped tokenizer's <|eos|>


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


# ---- reference pieces (used to isolate the function under test) ---------------------

def is_finished(request: Request, config: SchedulerConfig) -> bool:
    return bool(request.output_token_ids) and request.check_stop(config.max_model_len) is not None


def reference_retire(running, block_manager, config):
    finished = [r for r in running if is_finished(r, config)]
    for r in finished:
        running.remove(r)
        block_manager.free(r.request_id)
    return finished


def reference_step(running, waiting, block_manager, config):
    plan, budget = [], config.max_num_batched_tokens
    for r in running:
        if budget == 0:
            break
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        block_manager.allocate(r.request_id, r.num_computed_tokens + n)
        plan.append((r, n))
        budget -= n
    while waiting and len(running) < config.max_num_seqs and budget > 0:
        r = waiting[0]
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        if not block_manager.can_allocate(r.request_id, r.num_computed_tokens + n):
            break
        running.append(waiting.popleft())
        block_manager.allocate(r.request_id, r.num_computed_tokens + n)
        plan.append((r, n))
        budget -= n
    return plan


# ---- hints --------------------------------------------------------------------------

def fail(step: int | None, zh: str, en: str):
    where_zh = f"第 {step} 步：" if step is not None else ""
    where_en = f"step {step}: " if step is not None else ""
    raise AssertionError(f"{where_zh}{zh}\n/ {where_en}{en}")


def _why_finished(request: Request) -> str:
    if request.output_token_ids and request.output_token_ids[-1] == request.eos_token_id \
            and not request.sampling_params.ignore_eos:
        return "生成了结束符 EOS / it emitted EOS"
    return (f"已生成 max_tokens={request.sampling_params.max_tokens} 个 token "
            f"/ it reached max_tokens={request.sampling_params.max_tokens}")


def _call(fn, name, step, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except AssertionError:
        raise
    except RuntimeError as e:
        if "out of KV blocks" in str(e):
            fail(step, f"{name} 分配块时块不够用了（{e}）。接纳请求之前先用 "
                       "block_manager.can_allocate(request_id, num_tokens) 检查空闲块，放不下就停止接纳",
                 f"{name} ran out of KV blocks while allocating ({e}). Before admitting a request, "
                 "check block_manager.can_allocate(request_id, num_tokens); stop admitting when it is False")
        raise AssertionError(f"第 {step} 步：{name} 抛出了 {type(e).__name__}: {e}\n"
                             f"/ step {step}: {name} raised {type(e).__name__}: {e}") from e
    except Exception as e:
        raise AssertionError(f"第 {step} 步：{name} 抛出了 {type(e).__name__}: {e}\n"
                             f"/ step {step}: {name} raised {type(e).__name__}: {e}") from e


# ---- the student's side, step by step -----------------------------------------------

@dataclass
class Snapshot:
    """State before planning a step, to explain a wrong plan."""
    running: list[str]
    waiting: list[str]
    free_blocks: int
    tables: dict[str, int]          # blocks held per request
    left: dict[str, int]            # tokens not yet computed per request
    computed: dict[str, int]        # tokens already in the cache per request


def _snapshot(running, waiting, bm) -> Snapshot:
    reqs = list(running) + list(waiting)
    return Snapshot([r.request_id for r in running], [r.request_id for r in waiting], bm.num_free_blocks,
                    {r.request_id: len(bm.block_table(r.request_id)) for r in reqs},
                    {r.request_id: r.num_tokens - r.num_computed_tokens for r in reqs},
                    {r.request_id: r.num_computed_tokens for r in reqs})


def _validate_plan(plan, running, bm, config, step, before: Snapshot, requests):
    if not isinstance(plan, (list, tuple)):
        fail(step, f"continuous_step 应返回 [(request, num_new_tokens), ...] 列表，而它返回了 {type(plan).__name__}",
             f"continuous_step must return a list of (request, num_new_tokens), got {type(plan).__name__}")
    seen = set()
    for item in plan:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Request)
                and isinstance(item[1], int) and not isinstance(item[1], bool)):
            fail(step, f"计划里的每一项应是 (Request, int)，而你返回了 {item!r}",
                 f"each plan entry must be a (Request, int) pair, got {item!r}")
        r, n = item
        rid = r.request_id
        if rid in seen:
            fail(step, f"请求 {rid} 在计划里出现了两次", f"request {rid} appears twice in the plan")
        seen.add(rid)
        if rid not in requests or requests[rid] is not r:
            fail(step, f"计划里的请求 {rid} 不是这次负载里的请求对象", f"request {rid} in the plan is not one of this workload's requests")
        if rid not in before.left:
            fail(step, f"请求 {rid} 这一步之前既不在 running 也不在 waiting 中（已经完成，或还没到达），不能进入计划",
                 f"request {rid} was neither running nor waiting before this step (finished, or not arrived yet): "
                 "it cannot be planned")
        if n < 1:
            fail(step, f"请求 {rid} 被安排了 {n} 个 token：进入计划的请求至少要算 1 个 token，没事可做就不要放进计划",
                 f"request {rid} is planned for {n} tokens: a planned request computes at least 1 token; leave it out otherwise")
        if n > before.left[rid]:
            fail(step, f"请求 {rid} 只剩 {before.left[rid]} 个 token 没算，你却安排了 {n} 个",
                 f"request {rid} has only {before.left[rid]} tokens left to compute, you planned {n}")
        if r not in running:
            fail(step, f"请求 {rid} 在计划里，但不在 running 中：接纳的请求要 append 到 running（并从 waiting 里取出）",
                 f"request {rid} is planned but not in running: append admitted requests to running (and take them out of waiting)")
    for rid, computed in before.computed.items():
        if requests[rid].num_computed_tokens != computed:
            fail(step, f"请求 {rid} 的 num_computed_tokens 被改了（{computed} → {requests[rid].num_computed_tokens}）："
                       "调度器只做计划和分配块，这个计数由执行完这一步之后的代码更新",
                 f"request {rid}'s num_computed_tokens changed ({computed} -> {requests[rid].num_computed_tokens}): "
                 "the scheduler only plans and allocates; the count is updated after the step runs")
    if len(running) > config.max_num_seqs:
        fail(step, f"running 里有 {len(running)} 个请求，超过了座位数 max_num_seqs={config.max_num_seqs}：座位满了就不能再接纳",
             f"running holds {len(running)} requests, more than max_num_seqs={config.max_num_seqs}: "
             "do not admit when every seat is taken")
    total = sum(n for _, n in plan)
    if total > config.max_num_batched_tokens:
        fail(step, f"这一步共安排了 {total} 个 token，超过了 token 预算 max_num_batched_tokens="
                   f"{config.max_num_batched_tokens}：每个请求最多拿 min(剩余 token, 剩余预算)，预算用完就停",
             f"the step plans {total} tokens, more than the token budget max_num_batched_tokens="
             f"{config.max_num_batched_tokens}: give each request min(tokens left, budget left) and stop at 0")
    for r, n in plan:
        need = blocks_for(r.num_computed_tokens + n, config.block_size)
        have = len(bm.block_table(r.request_id))
        if have < need:
            fail(step, f"请求 {r.request_id} 这一步要写到第 {r.num_computed_tokens + n} 个 token，需要 {need} 个块，"
                       f"却只有 {have} 个：调用 block_manager.allocate(request_id, num_computed_tokens + n)",
                 f"request {r.request_id} computes up to token {r.num_computed_tokens + n} and needs {need} blocks "
                 f"but holds {have}: call block_manager.allocate(request_id, num_computed_tokens + n)")


def _explain_plan(got, want, before: Snapshot, config, step):
    """Raise with the reason for the first difference between two plans of (id, n)."""
    budget = config.max_num_batched_tokens
    seats = len(before.running)
    free = before.free_blocks
    for i in range(max(len(got), len(want))):
        g = got[i] if i < len(got) else None
        e = want[i] if i < len(want) else None
        if g == e:
            rid, n = e
            if rid not in before.running:
                seats += 1
            free -= blocks_for(before.computed[rid] + n, config.block_size) - before.tables[rid]
            budget -= n
            continue
        if e is not None and e[0] in before.running:
            rid, n = e
            if g is not None and g[0] == rid:
                fail(step, f"正在运行的请求 {rid} 还剩 {before.left[rid]} 个 token、预算还剩 {budget}，"
                           f"应安排 min({before.left[rid]}, {budget}) = {n} 个 token，你安排了 {g[1]} 个",
                     f"running request {rid} has {before.left[rid]} tokens left and {budget} budget is left: "
                     f"plan min({before.left[rid]}, {budget}) = {n} tokens, you planned {g[1]}")
            fail(step, f"正在运行的请求 {rid} 应排在计划的第 {i + 1} 位（预算还剩 {budget}）。规则：先按 running 的顺序"
                       f"给在跑的请求排 token，再接纳新请求；你的计划是 {got}，应为 {want}",
                 f"running request {rid} should be entry {i + 1} of the plan ({budget} budget left). Rule: running "
                 f"requests first, in running order, then admissions; your plan is {got}, expected {want}")
        if e is None:        # the student admitted one more than the engine
            rid = g[0]
            admitted = len([x for x in want if x[0] not in before.running])
            head = before.waiting[admitted] if admitted < len(before.waiting) else None
            if seats >= config.max_num_seqs:
                fail(step, f"接纳了请求 {rid}，但座位已满（{seats}/{config.max_num_seqs}，max_num_seqs）",
                     f"admitted request {rid} but every seat was taken ({seats}/{config.max_num_seqs}, max_num_seqs)")
            if budget <= 0:
                fail(step, f"接纳了请求 {rid}，但这一步的 token 预算（max_num_batched_tokens={config.max_num_batched_tokens}）已经用完",
                     f"admitted request {rid} but the step's token budget (max_num_batched_tokens="
                     f"{config.max_num_batched_tokens}) was used up")
            if head is not None and rid != head:
                fail(step, f"接纳了请求 {rid}，但队头是请求 {head}，而它放不下。先来先服务：队头放不下就停止接纳，不要跳过它",
                     f"admitted request {rid} while the head of the queue, request {head}, did not fit. First come, "
                     f"first served: stop admitting at the first request that does not fit; never skip it")
            n_head = min(before.left[rid], budget)
            need = blocks_for(before.computed[rid] + n_head, config.block_size) - before.tables[rid]
            fail(step, f"接纳了请求 {rid}，但它的前 {n_head} 个 token 需要 {need} 个新块，只剩 {free} 个空闲块："
                       "接纳前用 block_manager.can_allocate 检查，放不下就停止接纳",
                 f"admitted request {rid}, but its first {n_head} tokens need {need} new blocks and only {free} are "
                 "free: check block_manager.can_allocate before admitting and stop when it is False")
        if g is None or (g[0] != e[0] and e[0] not in before.running):
            rid, n = e
            if g is not None and g[0] not in before.running and g[0] in before.waiting:
                fail(step, f"应接纳队头的请求 {rid}，你接纳了请求 {g[0]}：按 waiting 的顺序（先来先服务）从队头取",
                     f"the head of the queue, request {rid}, should be admitted, you admitted request {g[0]}: "
                     "take requests from the head of waiting (first come, first served)")
            fail(step, f"请求 {rid} 本该被接纳：还有空座位（{seats}/{config.max_num_seqs}）、预算 {budget} 个 token、"
                       f"{free} 个空闲块，足够它的前 {n} 个 token。只要三者都够，就继续从队头接纳",
                 f"request {rid} should have been admitted: a seat was free ({seats}/{config.max_num_seqs}), "
                 f"{budget} budget tokens and {free} free blocks were left, enough for its first {n} tokens. "
                 "Keep admitting from the head of waiting while all three allow")
        rid, n = e
        fail(step, f"新接纳的请求 {rid} 还剩 {before.left[rid]} 个 token、预算还剩 {budget}，应安排 min(...) = {n} 个，"
                   f"你安排了 {g[1]} 个（预算不够时只预填充一部分：分块预填充）",
             f"newly admitted request {rid} has {before.left[rid]} tokens left and {budget} budget left: plan "
             f"min(...) = {n} tokens, you planned {g[1]} (when the budget is short, prefill only a chunk)")
    fail(step, f"计划应为 {want}，你的是 {got}", f"expected plan {want}, got {got}")


def _apply(plan, step, specs, sample=None):
    """Advance the planned requests as the model would; return (request, token) emitted."""
    emitted = []
    for r, n in plan:
        remaining = r.num_tokens - r.num_computed_tokens
        r.num_computed_tokens += n
        if n == remaining:
            token = sample[r.request_id] if sample else fake_token(specs[r.request_id], len(r.output_token_ids))
            r.output_token_ids.append(token)
            emitted.append((r, token))
    return emitted


def drive(w: Workload, retire, step_fn, trace: Trace, who: str = "continuous_step"):
    """Run the student's functions on a workload, comparing each step with the engine's trace."""
    cfg = w.config
    bm = BlockManager(w.num_blocks, cfg.block_size)
    specs = {s.request_id: s for s in w.specs}
    requests = {rid: s.new_request() for rid, s in specs.items()}
    pending = deque(w.specs)
    running: list[Request] = []
    waiting: deque[Request] = deque()
    prev_finished: list[str] = []
    step = 0
    while True:
        while pending and pending[0].arrival_step <= step:
            waiting.append(requests[pending.popleft().request_id])
        _check_retire_step(retire, running, bm, cfg, step, prev_finished)
        if not (pending or running or waiting):
            break
        if step >= len(trace.steps):
            left = [r.request_id for r in running] + [r.request_id for r in waiting]
            fail(step, f"引擎在 {len(trace.steps)} 步内已经做完，你的调度器还剩请求 {left} 没完成"
                       "（完成的请求有没有退出？等待的请求有没有被接纳？）",
                 f"the engine finished in {len(trace.steps)} steps, yours still has requests {left} "
                 "(are finished requests retired? are waiting ones admitted?)")
        before = _snapshot(running, waiting, bm)
        plan = _call(step_fn, who, step, running, waiting, bm, cfg)
        _validate_plan(plan, running, bm, cfg, step, before, requests)
        record = trace.steps[step]
        got = [(r.request_id, n) for r, n in plan]
        if got != record.plan:
            _explain_plan(got, record.plan, before, cfg, step)
        if [r.request_id for r in running] != record.running:
            fail(step, f"计划正确，但 running 变成了 {[r.request_id for r in running]}，应为 {record.running}："
                       "新接纳的请求 append 到 running 末尾，并从 waiting 队头 popleft",
                 f"the plan is right but running is {[r.request_id for r in running]}, expected {record.running}: "
                 "append admitted requests to the end of running and popleft them from waiting")
        if [r.request_id for r in waiting] != record.waiting:
            fail(step, f"计划正确，但 waiting 变成了 {[r.request_id for r in waiting]}，应为 {record.waiting}",
                 f"the plan is right but waiting is {[r.request_id for r in waiting]}, expected {record.waiting}")
        if bm.num_free_blocks != record.free_blocks:
            fail(step, f"计划正确，但空闲块有 {bm.num_free_blocks} 个，应为 {record.free_blocks} 个："
                       "只为计划里的 token 分配块（allocate 到 num_computed_tokens + n），不要多分",
                 f"the plan is right but {bm.num_free_blocks} blocks are free, expected {record.free_blocks}: "
                 "allocate blocks for the planned tokens only (up to num_computed_tokens + n)")
        _apply(plan, step, specs)
        prev_finished = record.finished
        step += 1
    # The engine retired the last requests at the end of its last step.
    if step != len(trace.steps):
        fail(step, f"你的调度器在 {step} 步后停下，引擎用了 {len(trace.steps)} 步",
             f"your scheduler stopped after {step} steps, the engine took {len(trace.steps)}")
    outputs = {rid: r.output_token_ids for rid, r in requests.items()}
    if outputs != trace.outputs:
        fail(None, "输出的 token 与引擎不同", "output tokens differ from the engine's")
    bm.check_integrity()
    if bm.num_free_blocks != w.num_blocks:
        fail(None, f"全部请求完成后还有 {w.num_blocks - bm.num_free_blocks} 个块没有归还",
             f"{w.num_blocks - bm.num_free_blocks} blocks are still held after every request finished")
    return step


def _check_retire_step(retire, running, bm, cfg, step, expected_ids):
    before = list(running)
    held = {r.request_id: len(bm.block_table(r.request_id)) for r in before}
    free_before = bm.num_free_blocks
    out = _call(retire, "retire", step, running, bm, cfg)
    _check_retire_result(out, before, running, bm, cfg, step, held, free_before, expected_ids)


def _check_retire_result(out, before, running, bm, cfg, step, held, free_before, expected_ids=None):
    if not isinstance(out, (list, tuple)):
        fail(step, f"retire 应返回刚退出的请求列表，而它返回了 {type(out).__name__}",
             f"retire must return the list of requests it retired, got {type(out).__name__}")
    finished = [r for r in before if is_finished(r, cfg)]
    if expected_ids is not None:
        assert [r.request_id for r in finished] == list(expected_ids), "internal: harness out of sync with the engine"
    for r in finished:
        if r in running:
            fail(step, f"请求 {r.request_id} 已生成完毕（{_why_finished(r)}）但仍在 running 中——完成的请求要在这一步就退出并释放块（原地从列表中移除：running.remove(request)）",
                 f"request {r.request_id} finished ({_why_finished(r).split(' / ')[1]}) but is still in running — "
                 "retire finished requests and free their blocks (remove them from the list in place: running.remove(request))")
        if bm.block_table(r.request_id):
            fail(step, f"请求 {r.request_id} 已退出，但它的 {held[r.request_id]} 个 KV 块没有归还："
                       "调用 block_manager.free(request.request_id)",
                 f"request {r.request_id} was retired but its {held[r.request_id]} KV blocks were not freed: "
                 "call block_manager.free(request.request_id)")
    for r in before:
        if r not in finished and r not in running:
            done = len(r.output_token_ids)
            fail(step, f"请求 {r.request_id} 还没完成（已生成 {done}/{r.sampling_params.max_tokens} 个 token）却被移出了 running",
                 f"request {r.request_id} is not finished ({done}/{r.sampling_params.max_tokens} tokens) "
                 "but was taken out of running")
        if r not in finished and len(bm.block_table(r.request_id)) != held[r.request_id]:
            fail(step, f"请求 {r.request_id} 还在运行，它的块却被释放了：只释放退出请求的块",
                 f"request {r.request_id} is still running but its blocks were freed: free only retired requests' blocks")
    if list(running) != [r for r in before if r not in finished]:
        fail(step, f"留下的请求要保持原来的顺序：应为 {[r.request_id for r in before if r not in finished]}，"
                   f"实际是 {[r.request_id for r in running]}（调度器按这个顺序分配预算；原地修改 running，不要新建列表）",
             f"keep the remaining requests in their order: expected {[r.request_id for r in before if r not in finished]}, "
             f"got {[r.request_id for r in running]} (the budget is handed out in this order; change running in place)")
    if [getattr(r, "request_id", r) for r in out] != [r.request_id for r in finished]:
        fail(step, f"retire 应返回刚退出的请求 {[r.request_id for r in finished]}（按它们在 running 中的顺序），"
                   f"你返回了 {[getattr(r, 'request_id', r) for r in out]}",
             f"retire must return the requests it retired, {[r.request_id for r in finished]} (in running order), "
             f"got {[getattr(r, 'request_id', r) for r in out]}")
    freed = sum(held[r.request_id] for r in finished)
    if bm.num_free_blocks != free_before + freed:
        fail(step, f"退出请求共持有 {freed} 个块，空闲块应从 {free_before} 变为 {free_before + freed}，实际是 {bm.num_free_blocks}",
             f"the retired requests held {freed} blocks: free blocks should go from {free_before} to "
             f"{free_before + freed}, got {bm.num_free_blocks}")
    bm.check_integrity()


# ---- the checks ---------------------------------------------------------------------

def _unit_retire_cases(retire):
    """Hand-made situations, each with one kind of finished / unfinished request."""
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    bm = BlockManager(32, 4)

    def make(rid, prompt, max_tokens, outputs, computed=None, ignore_eos=True):
        r = Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    0.0, eos_token_id=EOS)
        r.output_token_ids = list(outputs)
        r.num_computed_tokens = r.num_tokens - 1 if computed is None else computed
        bm.allocate(rid, max(r.num_computed_tokens, 1))
        return r

    running = [
        make("0", 5, 3, [11, 12, 13]),                    # reached max_tokens
        make("1", 6, 4, [11, 12]),                        # still decoding
        make("2", 3, 9, [11, EOS], ignore_eos=False),      # emitted EOS
        make("3", 9, 5, [], computed=4),                  # still prefilling: no output yet
        make("4", 4, 6, [EOS, 11], ignore_eos=True),       # EOS is ignored: keeps going
        make("5", 7, 1, [11]),                            # a one-token request
    ]
    cases = [("mixed", running), ("empty", [])]
    for name, running in cases:
        before = list(running)
        held = {r.request_id: len(bm.block_table(r.request_id)) for r in before}
        free_before = bm.num_free_blocks
        out = _call(retire, "retire", None, running, bm, cfg)
        _check_retire_result(out, before, running, bm, cfg, None, held, free_before)


def check_retire(retire):
    """Check ``retire(running, block_manager, config) -> list[Request]``."""
    _unit_retire_cases(retire)
    ws = workloads()
    for w in ws:
        drive(w, retire, reference_step, engine_trace(w), who="continuous_step (reference)")
    print(f"✓ retire 通过：手工用例 + {len(ws)} 个随机负载，与引擎逐步一致 "
          f"/ retire passed hand-made cases and {len(ws)} random workloads")


def _unit_step_cases(step_fn):
    """Small situations where one limit decides, with a targeted hint each."""
    def run_case(name, config, num_blocks, running_specs, waiting_specs):
        bm_ref, bm = BlockManager(num_blocks, config.block_size), BlockManager(num_blocks, config.block_size)

        def build(bm_):
            running, waiting = [], deque()
            for rid, prompt, computed, outputs in running_specs:
                r = Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=50), 0.0, eos_token_id=EOS)
                r.output_token_ids = list(outputs)
                r.num_computed_tokens = computed
                bm_.allocate(rid, computed)
                running.append(r)
            for rid, prompt in waiting_specs:
                waiting.append(Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=50), 0.0,
                                       eos_token_id=EOS))
            return running, waiting

        ref_running, ref_waiting = build(bm_ref)
        want = [(r.request_id, n) for r, n in reference_step(ref_running, ref_waiting, bm_ref, config)]
        running, waiting = build(bm)
        requests = {r.request_id: r for r in list(running) + list(waiting)}
        before = _snapshot(running, waiting, bm)
        plan = _call(step_fn, "continuous_step", None, running, waiting, bm, config)
        _validate_plan(plan, running, bm, config, None, before, requests)
        got = [(r.request_id, n) for r, n in plan]
        if got != want:
            try:
                _explain_plan(got, want, before, config, None)
            except AssertionError as e:
                raise AssertionError(f"[{name}] {e}") from None
        if [r.request_id for r in running] != [r.request_id for r in ref_running] or \
                [r.request_id for r in waiting] != [r.request_id for r in ref_waiting]:
            fail(None, f"[{name}] 计划正确，但 running/waiting 不对：应为 {[r.request_id for r in ref_running]} / "
                       f"{[r.request_id for r in ref_waiting]}",
                 f"[{name}] the plan is right but running/waiting are wrong: expected "
                 f"{[r.request_id for r in ref_running]} / {[r.request_id for r in ref_waiting]}")
        if bm.num_free_blocks != bm_ref.num_free_blocks:
            fail(None, f"[{name}] 空闲块 {bm.num_free_blocks} 个，应为 {bm_ref.num_free_blocks} 个",
                 f"[{name}] {bm.num_free_blocks} free blocks, expected {bm_ref.num_free_blocks}")

    cfg = lambda seats, budget, bs=4: SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget, block_size=bs)
    # Seats: two decoding, room for one more.
    run_case("seats", cfg(3, 100), 64, [("0", 5, 5, [11]), ("1", 6, 6, [11])], [("2", 4), ("3", 4)])
    # Budget: the second prompt only gets a chunk, the third nothing.
    run_case("budget", cfg(8, 16), 64, [], [("0", 10), ("1", 10), ("2", 10)])
    # Running first: a half-prefilled request continues before anyone is admitted.
    run_case("running first", cfg(8, 14), 64, [("0", 20, 8, []), ("1", 5, 5, [11])], [("2", 6)])
    # Blocks: the head needs 3 blocks, 2 are free; the next one would fit but must wait.
    run_case("blocks (FCFS)", cfg(8, 64), 4, [("0", 7, 7, [11])], [("1", 10), ("2", 3)])


def check_continuous_step(continuous_step):
    """Check ``continuous_step(running, waiting, block_manager, config) -> [(Request, n)]``."""
    _unit_step_cases(continuous_step)
    ws = workloads()
    steps = 0
    for w in ws:
        steps += drive(w, reference_retire, continuous_step, engine_trace(w))
    binding = sorted(set().union(*(w.binding for w in ws)))
    print(f"✓ continuous_step 通过：手工用例 + {len(ws)} 个随机负载（{steps} 步，座位/预算/块都曾是瓶颈："
          f"{', '.join(binding)}），与引擎的 Scheduler 逐步一致 "
          f"/ continuous_step matches the engine's Scheduler on every step")


# ---- end to end, with the real model ------------------------------------------------

def end_to_end_workload():
    """16 requests for the `tiny` model: mostly short, a few long; seats, budget and blocks all bind."""
    rng = random.Random("lab01-e2e-20")     # seed picked so that all three limits bind, no preemption
    prompts, params = [], []
    for i in range(16):
        prompts.append([rng.randrange(10, 2000) for _ in range(rng.randint(4, 36))])
        long = i % 5 == 2
        params.append(SamplingParams(max_tokens=rng.randint(20, 32) if long else rng.randint(2, 8),
                                     ignore_eos=True))
    config = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=12)
    return prompts, params, config


def run_student(model, prompts, params, config, retire, continuous_step, engine_stats=None):
    """Drive the real model with the student's functions; return (outputs, step batches, blocks held)."""
    from tinyserve.executor import ModelExecutor

    cfg = SchedulerConfig(max_num_seqs=config["max_num_seqs"],
                          max_num_batched_tokens=config["max_num_batched_tokens"],
                          block_size=config["block_size"], max_model_len=model.config.max_position_embeddings)
    num_blocks = config["num_kv_blocks"]
    bm = BlockManager(num_blocks, cfg.block_size)
    executor = ModelExecutor(model, num_blocks, cfg.block_size)
    requests = [Request(str(i), list(p), sp, 0.0, eos_token_id=EOS) for i, (p, sp) in enumerate(zip(prompts, params))]
    by_id = {r.request_id: r for r in requests}
    waiting, running = deque(requests), []
    batches, held = [], []
    limit = 20 * len(engine_stats) if engine_stats else 10_000
    while waiting or running:
        step = len(batches)
        if step > limit:
            fail(step, "运行了太多步还没结束：完成的请求有没有退出？等待的请求有没有被接纳？",
                 "too many steps without finishing: are finished requests retired? are waiting ones admitted?")
        before_running = list(running)
        held_before = {r.request_id: len(bm.block_table(r.request_id)) for r in running}
        free_before = bm.num_free_blocks
        out = _call(retire, "retire", step, running, bm, cfg)
        _check_retire_result(out, before_running, running, bm, cfg, step, held_before, free_before)
        if not (waiting or running):
            break
        before = _snapshot(running, waiting, bm)
        plan = _call(continuous_step, "continuous_step", step, running, waiting, bm, cfg)
        _validate_plan(plan, running, bm, cfg, step, before, by_id)
        if not plan:
            fail(step, "还有请求没完成，continuous_step 却返回了空计划（死锁）", "requests remain but continuous_step planned nothing (deadlock)")
        got = [(r.request_id, n) for r, n in plan]
        if engine_stats is not None:
            want = [tuple(x) for x in engine_stats[step].batch] if step < len(engine_stats) else []
            if got != want:
                fail(step, f"与引擎不同：引擎这一步的批是 {want}，你的是 {got}（先运行前面的 check 找出原因）",
                     f"differs from the engine: its batch this step is {want}, yours is {got} "
                     "(run the earlier checks to find out why)")
        items = [ScheduledRequest(r, n, list(bm.block_table(r.request_id)),
                                  samples=n == r.num_tokens - r.num_computed_tokens) for r, n in plan]
        sampled = executor.execute(SchedulerOutput(scheduled=items))
        held.append(bm.num_used_blocks)
        _apply(plan, step, None, sample=sampled)
        batches.append(got)
    bm.check_integrity()
    if bm.num_free_blocks != num_blocks:
        fail(None, f"全部请求完成后还有 {num_blocks - bm.num_free_blocks} 个块没有归还",
             f"{num_blocks - bm.num_free_blocks} blocks are still held after every request finished")
    return [r.output_token_ids for r in requests], batches, held


def check_end_to_end(retire, continuous_step, plot=True):
    """Serve a workload on the real `tiny` model with the student's scheduler; compare with LLM.generate."""
    import torch

    from tinyserve.engine import LLM

    prompts, params, config = end_to_end_workload()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: extra threads only add noise when the CPU is shared
    try:
        llm = LLM(model="tiny", seed=0, enable_chunked_prefill=True, batching="continuous", **config)
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.step_stats
        assert llm.engine.scheduler.num_preemptions == 0, "internal: the end-to-end workload must not preempt"
        outputs, batches, held = run_student(llm.model, prompts, params, config, retire, continuous_step, stats)
    finally:
        torch.set_num_threads(threads)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got != want:
            fail(None, f"请求 {i} 的输出与 LLM.generate 不同：{got[:8]}… vs {want[:8]}…",
                 f"request {i}'s output differs from LLM.generate: {got[:8]}… vs {want[:8]}…")
    if len(batches) != len(stats):
        fail(None, f"你的调度器用了 {len(batches)} 步，引擎用了 {len(stats)} 步",
             f"your scheduler took {len(batches)} steps, the engine {len(stats)}")
    if plot:
        import matplotlib.pyplot as plt

        from tinyserve.book import plots
        fig, axes = plt.subplots(2, 1, figsize=(10, 4), dpi=90, sharex=True)
        plots.gantt(batches, ax=axes[0], num_seats=config["max_num_seqs"], title="your continuous batching")
        axes[0].set_xlabel("")
        plots.kv_blocks_timeline({"your scheduler": held}, capacity=config["num_kv_blocks"], ax=axes[1])
        axes[1].set_xlim(0, len(batches))
        fig.tight_layout()
        plt.show()
    print(f"✓ 端到端通过：{len(prompts)} 个请求在 tiny 模型上 {len(batches)} 步完成，输出与 LLM.generate 逐 token 相同，"
          f"块全部归还 / end to end: same tokens as LLM.generate, same {len(batches)} steps, every block returned")
    return {"steps": len(batches), "batches": batches, "blocks_in_use": held}


# ---- lab 02: fused add + RMSNorm in Triton ------------------------------------------
#
# Lab 02 asks for three pieces:
#
# * ``fused_bytes(shape, dtype) -> int``: bytes the fused kernel reads and writes.
# * ``add_rmsnorm_kernel[(n_rows,)](x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
#   n_cols, eps, BLOCK_N=...)``: one program per row of contiguous [n_rows, n_cols]
#   tensors; ``new_res = x + res``, ``out = w * rmsnorm(new_res)`` normalised in fp32.
# * ``add_rmsnorm(x, residual, weight, eps) -> (out, new_residual)``: the launcher.
#
# The kernel is launched by the check itself, on tensors followed by a guard
# region, so a load or store past the end of a row shows up as a wrong value
# or a changed guard instead of silently corrupting memory. Without a GPU it
# runs in Triton's interpreter (about a millisecond per program): small shapes.

__all__ += ["check_fused_bytes", "check_add_rmsnorm_kernel", "check_add_rmsnorm"]

_GUARD = 256                  # elements after each tensor (> any BLOCK_N - n_cols here)


def _kernel_device() -> str:
    from tinyserve import kernels as K
    return "cpu" if K.interpreting() else "cuda"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_fused_bytes(fused_bytes):
    """Check ``fused_bytes(shape, dtype) -> int`` against ``kernels.bytes_moved(..., "fused", ...)``."""
    import math

    import torch

    from tinyserve import kernels as K

    cases = [((4, 8), torch.float32), ((37, 781), torch.float16), ((2, 5, 300), torch.float32),
             ((32, 4096), torch.float16), ((2048, 4096), torch.bfloat16)]
    for shape, dtype in cases:
        want = K.bytes_moved("add_rmsnorm", "fused", shape, dtype)
        got = fused_bytes(shape, dtype)
        if not isinstance(got, int) or isinstance(got, bool):
            try:
                got = int(got) if float(got) == int(got) else got
            except (TypeError, ValueError):
                pass
        if got == want:
            continue
        e = torch.empty((), dtype=dtype).element_size()
        m, n = math.prod(shape[:-1]), shape[-1]
        mn = m * n
        where_zh, where_en = f"shape={shape}, dtype={_dtype_name(dtype)}：", f"shape={shape}, dtype={_dtype_name(dtype)}: "
        hints = [
            (4 * mn + n, "你数的是元素个数，不是字节：乘上每个元素的字节数 dtype 的 element_size()",
             "you counted elements, not bytes: multiply by the element size of dtype"),
            (2 * mn * e + n * e, "只数了读，没数写：融合 kernel 还要写出 out 和 new_residual 两个张量",
             "you counted the reads only: the fused kernel also writes out and new_residual"),
            (2 * mn * e, "只数了写，没数读：它要读 x、residual（各 m×n 个元素）和 weight（n 个元素）",
             "you counted the writes only: it also reads x and residual (m×n elements each) and weight (n)"),
            (4 * mn * e, "漏了 weight：每次调用都要读一次 weight（n 个元素，只算一次）",
             "weight is missing: each call reads weight once (n elements, counted once)"),
            (4 * mn * e + mn * e, "weight 按行重复算了：它只有 n 个元素，读一次（之后在缓存里）",
             "weight counted once per row: it has n elements and is read once (then cached)"),
            (3 * mn * e + n * e, "漏了一个写：融合 kernel 写出两个张量，out 和 new_residual = x + residual",
             "one write is missing: the fused kernel writes two tensors, out and new_residual = x + residual"),
            (4 * mn * 4 + n * 4, "按 fp32 数了字节：字节数取决于 dtype（fp16/bf16 每个元素 2 字节）",
             "you counted fp32 bytes: the size depends on dtype (2 bytes per element in fp16/bf16)"),
        ]
        for value, zh, en in hints:
            if got == value and value != want:
                fail(None, where_zh + f"你的结果 {got}，应为 {want}。{zh}", where_en + f"got {got}, expected {want}. {en}")
        fail(None, where_zh + f"你的结果 {got}，应为 {want}（读 x、residual 各 m×n 个元素和 weight 的 n 个，"
                              "写 out、new_residual 各 m×n 个；乘以每个元素的字节数）",
             where_en + f"got {got}, expected {want} (read m×n elements of x and of residual plus n of weight; "
                        "write m×n of out and of new_residual; times the bytes per element)")
    print("✓ fused_bytes 通过：与 kernels.bytes_moved('add_rmsnorm', 'fused', ...) 一致 "
          "/ fused_bytes matches kernels.bytes_moved('add_rmsnorm', 'fused', ...)")


def _guarded(values, device, fill):
    """A contiguous tensor with ``values`` followed by ``_GUARD`` elements of ``fill``; (view, buffer)."""
    import torch
    buf = torch.full((values.numel() + _GUARD,), fill, dtype=values.dtype, device=device)
    view = buf[:values.numel()].view(values.shape)
    view.copy_(values)
    return view, buf


def _rms_f64(h, weight, eps, *, divisor=None, eps_mode="inside"):
    """out = weight * h / rms(h), in float64, with an optional mistake (to name the student's)."""
    import torch
    h = h.double()
    n = h.shape[-1] if divisor is None else divisor
    var = (h * h).sum(-1, keepdim=True) / n
    if eps_mode == "inside":
        normed = h * torch.rsqrt(var + eps)
    elif eps_mode == "outside":
        normed = h / (var.sqrt() + eps)
    else:
        normed = h * torch.rsqrt(var)
    return normed * (weight.double() if weight is not None else 1.0)


def _kernel_cases():
    import torch
    return [
        # name, rows, cols, dtype, scale, eps
        ("power-of-two width", 4, 64, torch.float32, 1.0, 1e-5),
        ("irregular width", 37, 781, torch.float32, 1.0, 1e-5),
        ("tiny values (eps matters)", 6, 100, torch.float32, 1e-3, 1e-5),
        ("fp16", 19, 300, torch.float16, 1.0, 1e-5),
        ("fp16, large values", 8, 1000, torch.float16, 16.0, 1e-6),
    ]


_TOL = {"torch.float32": dict(atol=1e-5, rtol=1e-5), "torch.float16": dict(atol=1e-2, rtol=1e-2)}


def _close(a, b, dtype) -> bool:
    import torch
    tol = _TOL[str(dtype)]
    a, b = a.double().cpu(), b.double().cpu()
    return bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, **tol))


def _run_student_kernel(kernel, x, res, w, eps, device):
    import torch

    from tinyserve.kernels.triton_setup import next_power_of_2
    m, n = x.shape
    sentinel = -1234.0
    xv, _ = _guarded(x, device, float("nan"))
    rv, _ = _guarded(res, device, float("nan"))
    wv, _ = _guarded(w, device, float("nan"))
    out, out_buf = _guarded(torch.full_like(x, sentinel), device, sentinel)
    new_res, res_buf = _guarded(torch.full_like(x, sentinel), device, sentinel)
    try:
        kernel[(m,)](xv, rv, wv, out, new_res, n, eps, BLOCK_N=next_power_of_2(n))
    except NotImplementedError:
        raise
    except Exception as e:                       # the interpreter wraps what the kernel raised
        text = f"{type(e).__name__}: {e}"
        if "NotImplementedError" in text:
            raise NotImplementedError("add_rmsnorm_kernel 还没有写 / add_rmsnorm_kernel is not written yet") from None
        raise AssertionError(f"启动 kernel 时出错（{text}）。kernel 的参数应为 (x_ptr, res_ptr, w_ptr, out_ptr, "
                             f"new_res_ptr, n_cols, eps, BLOCK_N)，每个程序处理一行\n"
                             f"/ launching the kernel failed ({text}). Its parameters must be (x_ptr, res_ptr, "
                             f"w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK_N), one program per row") from e
    if device == "cuda":
        torch.cuda.synchronize()
    guards_ok = bool((out_buf[m * n:] == sentinel).all()) and bool((res_buf[m * n:] == sentinel).all())
    return out.cpu(), new_res.cpu(), guards_ok


def _diagnose_out(got, x, res, w, eps, n, block_n, dtype, case):
    """Raise with the most likely mistake behind a wrong ``out``."""
    import torch
    h = x.double() + res.double()
    candidates = [
        (_rms_f64(x, w, eps), "只对 x 做了归一化，忘了先加 residual：应归一化 h = x + residual",
         "you normalised x alone: normalise h = x + residual"),
        (_rms_f64(h, None, eps), "忘了乘 weight：out = weight * h / rms(h)",
         "weight is missing: out = weight * h / rms(h)"),
        (_rms_f64(h, w, eps, eps_mode="outside"), "eps 放错了位置：应是 1 / sqrt(mean(h²) + eps)，"
         "而不是 1 / (sqrt(mean(h²)) + eps)", "eps is in the wrong place: use 1 / sqrt(mean(h²) + eps), "
         "not 1 / (sqrt(mean(h²)) + eps)"),
        (_rms_f64(h, w, eps, eps_mode="none"), "忘了 eps：应是 1 / sqrt(mean(h²) + eps)",
         "eps is missing: use 1 / sqrt(mean(h²) + eps)"),
        (_rms_f64(h, w, eps, divisor=1), "求的是平方和，不是平均：除以 n_cols",
         "you took the sum of squares, not the mean: divide by n_cols"),
    ]
    if block_n != n:
        candidates.append((_rms_f64(h, w, eps, divisor=block_n),
                           f"平均值除以了 BLOCK_N={block_n}，应除以真实宽度 n_cols={n}（补齐的位置是 0，不算数）",
                           f"the mean divides by BLOCK_N={block_n}: divide by the real width n_cols={n} "
                           "(the padded lanes are zeros and do not count)"))
    for cand, zh, en in candidates:
        if _close(got, cand, dtype):
            fail(None, f"[{case}] out 不对：{zh}", f"[{case}] out is wrong: {en}")
    if dtype == torch.float16:                 # every fp32 case (irregular widths too) passed before
        fail(None, f"[{case}] fp32 的用例都通过了，fp16 的没有：平方和在 fp16 里溢出了（最大约 65504）或丢了精度。"
                   "先用 .to(tl.float32) 把 h 转成 fp32，再平方、求和、开方；存回时再转回",
             f"[{case}] the fp32 cases pass but fp16 does not: the sum of squares overflowed fp16 (max about 65504) "
             "or lost precision. Convert h with .to(tl.float32) before squaring, summing and taking the root; "
             "cast back on store")
    if block_n != n and not bool(torch.isfinite(got.double()).all()):
        fail(None, f"[{case}] out 里出现了 nan：宽度 {n} 不是 2 的幂，kernel 读到了行尾之外。"
                   f"tl.load 要带 mask=cols < n_cols 和 other=0.0",
             f"[{case}] out has nan: width {n} is not a power of two and the kernel read past the row. "
             "Give tl.load mask=cols < n_cols and other=0.0")
    want = _rms_f64(h, w, eps)
    err = (got.double() - want).abs().max().item()
    fail(None, f"[{case}] out 与 float64 参考值最大相差 {err:.3g}（容差 {_TOL[str(dtype)]}）。"
               "检查：h = x + residual 转成 fp32，var = sum(h*h) / n_cols，rstd = 1/sqrt(var + eps)，"
               "out = weight * h * rstd，带 mask 存回",
         f"[{case}] out differs from the float64 reference by up to {err:.3g} (tolerance {_TOL[str(dtype)]}). "
         "Check: h = x + residual in fp32, var = sum(h*h) / n_cols, rstd = 1/sqrt(var + eps), "
         "out = weight * h * rstd, stored with the mask")


def check_add_rmsnorm_kernel(kernel):
    """Launch the student's ``add_rmsnorm_kernel[(n_rows,)](...)`` on irregular shapes, fp32 and fp16."""
    import torch

    from tinyserve.kernels.triton_setup import next_power_of_2

    device = _kernel_device()
    gen = torch.Generator().manual_seed(2)
    passed = []
    for case, m, n, dtype, scale, eps in _kernel_cases():
        x = (torch.randn(m, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
        res = (torch.randn(m, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
        w = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
        out, new_res, guards_ok = _run_student_kernel(kernel, x, res, w, eps, device)
        block_n = next_power_of_2(n)
        h = x.double() + res.double()
        if not guards_ok:
            fail(None, f"[{case}] kernel 写到了张量末尾之外：宽度 {n} 的行被补齐到 BLOCK_N={block_n}，"
                       "tl.store 要带 mask=cols < n_cols",
                 f"[{case}] the kernel wrote past the end of the tensor: rows of width {n} are padded to "
                 f"BLOCK_N={block_n}; give tl.store mask=cols < n_cols")
        if bool((new_res == -1234.0).all()):
            fail(None, f"[{case}] new_residual 没有被写：用 tl.store(new_res_ptr + offs, h, mask=mask) 存下 x + residual",
                 f"[{case}] new_residual was never written: tl.store(new_res_ptr + offs, h, mask=mask) the sum x + residual")
        if not _close(new_res, h, dtype):
            if _close(new_res, x, dtype):
                hint = ("new_residual 存成了 x，应是 x + residual", "new_residual holds x; it must be x + residual")
            elif _close(new_res, out, dtype):
                hint = ("new_residual 存成了归一化后的结果，应是归一化之前的和 x + residual",
                        "new_residual holds the normalised output; it must be the sum x + residual, before normalising")
            elif block_n != n and not bool(torch.isfinite(new_res.double()).all()):
                hint = (f"宽度 {n} 不是 2 的幂，kernel 读到了行尾之外：tl.load 要带 mask=cols < n_cols 和 other=0.0",
                        f"width {n} is not a power of two and the kernel read past the row: "
                        "give tl.load mask=cols < n_cols and other=0.0")
            else:
                hint = ("new_residual 应是 x + residual（每行的每个有效位置都要存）",
                        "new_residual must be x + residual (stored at every valid position of every row)")
            fail(None, f"[{case}] {hint[0]}", f"[{case}] {hint[1]}")
        if (out == -1234.0).any():
            rows = sorted({int(r) for r in (out == -1234.0).nonzero()[:, 0]})
            fail(None, f"[{case}] out 有没写到的位置（第 {rows[:5]} 行）：每个程序处理一行 row = tl.program_id(0)，"
                       "整行都要存",
                 f"[{case}] some of out was never written (rows {rows[:5]}): each program handles row = "
                 "tl.program_id(0) and stores the whole row")
        if not _close(out, _rms_f64(h, w, eps), dtype):
            _diagnose_out(out, x, res, w, eps, n, block_n, dtype, case)
        passed.append((case, m, n, dtype))
    shapes = ", ".join(f"{m}×{n} {_dtype_name(d)}" for _, m, n, d in passed)
    print(f"✓ add_rmsnorm_kernel 通过：{len(passed)} 组形状（{shapes}），与 float64 参考值一致，没有越界读写 "
          f"/ add_rmsnorm_kernel matches float64 on every shape, with no access past the rows")
    _report_bytes()


def _report_bytes():
    import torch

    from tinyserve import kernels as K
    print("省下的字节 / bytes saved (7B model, hidden 4096, fp16):")
    for label, shape in (("decode batch 32", (32, 4096)), ("prefill chunk 2048", (2048, 4096))):
        unfused = K.bytes_moved("add_rmsnorm", "unfused", shape, torch.float16)
        fused = K.bytes_moved("add_rmsnorm", "fused", shape, torch.float16)
        print(f"  {label:<19} unfused {unfused / 2**20:7.2f} MiB -> fused {fused / 2**20:6.2f} MiB: "
              f"{(unfused - fused) / 2**20:7.2f} MiB saved per call, {unfused / fused:.2f}x fewer bytes")


def check_add_rmsnorm(add_rmsnorm):
    """Check the launcher ``add_rmsnorm(x, residual, weight, eps) -> (out, new_residual)``
    on leading dims and irregular widths against ``tinyserve.kernels.add_rmsnorm_triton``."""
    import torch

    from tinyserve import kernels as K

    device = _kernel_device()
    gen = torch.Generator().manual_seed(3)
    cases = [((3, 5, 50), torch.float32), ((2, 129), torch.float16), ((1, 1, 1000), torch.float32)]
    for shape, dtype in cases:
        x = torch.randn(shape, generator=gen).to(dtype).to(device)
        res = torch.randn(shape, generator=gen).to(dtype).to(device)
        w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
        try:
            got = add_rmsnorm(x, res, w, 1e-5)
        except NotImplementedError:
            raise
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            if "NotImplementedError" in text:
                raise NotImplementedError("还有没写完的部分 / something is not written yet") from None
            raise AssertionError(f"shape={shape}: add_rmsnorm 抛出了 {text}\n/ shape={shape}: add_rmsnorm raised {text}") from e
        where = f"shape={shape}, {_dtype_name(dtype)}"
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(None, f"{where}：add_rmsnorm 应返回 (out, new_residual) 两个张量", f"{where}: add_rmsnorm must return (out, new_residual)")
        out, new_res = got
        want_out, want_res = K.add_rmsnorm_triton(x, res, w, 1e-5)
        for name, t in (("out", out), ("new_residual", new_res)):
            if tuple(t.shape) != tuple(shape):
                fail(None, f"{where}：{name} 的形状是 {tuple(t.shape)}，应与 x 相同：算完后 .view(x.shape) 变回去",
                     f"{where}: {name} has shape {tuple(t.shape)}; it must have x's shape: .view(x.shape) at the end")
        tol = _TOL[str(dtype)]
        if _close(out, want_res, dtype) and _close(new_res, want_out, dtype):
            fail(None, f"{where}：返回顺序反了，应为 (out, new_residual)", f"{where}: swapped results; return (out, new_residual)")
        if not (torch.allclose(new_res.double().cpu(), want_res.double().cpu(), **tol)
                and torch.allclose(out.double().cpu(), want_out.double().cpu(), **tol)):
            fail(None, f"{where}：结果与 tinyserve.kernels.add_rmsnorm_triton 不同。网格应为 (n_rows,)，"
                       f"n_rows 是去掉最后一维后所有维的乘积；BLOCK_N = triton.next_power_of_2(n_cols)；"
                       "先 reshape(-1, n_cols).contiguous()",
                 f"{where}: differs from tinyserve.kernels.add_rmsnorm_triton. The grid must be (n_rows,), "
                 "n_rows the product of all but the last dim; BLOCK_N = triton.next_power_of_2(n_cols); "
                 "reshape(-1, n_cols).contiguous() first")
    print("✓ add_rmsnorm 通过：任意前导维度、非 2 的幂宽度，与 tinyserve.kernels.add_rmsnorm_triton 一致 "
          "/ add_rmsnorm matches tinyserve.kernels.add_rmsnorm_triton on leading dims and irregular widths")


# ---- lab 03: the batch-size crossover ---------------------------------------------------
#
# Lab 03 asks for four functions (seconds, bytes, FLOP/s, as in tinyserve.hardware):
#
# * ``weight_read_time(hw, model, dtype)``: every parameter read once, bytes / bandwidth.
# * ``per_request_compute_time(hw, model, dtype)``: 2 FLOPs per parameter at peak.
# * ``crossover_batch(hw, model, dtype)``: the ratio of the two.
# * ``find_knee(batch_sizes, step_times) -> float``: the knee of a flat-then-linear fit;
#   ``max(batch_sizes)`` when the curve does not rise; ValueError on bad input.
#
# The references are ``tinyserve.hardware``'s functions of the same names
# (``find_knee`` via ``fit_knee``). The last check measures the student's own
# machine: ceilings with ``measure_device``, then a sweep of a stack of matmuls.

__all__ += ["check_weight_read_time", "check_per_request_compute_time", "check_crossover",
            "check_find_knee", "check_my_machine"]


def _lab03_cases():
    """(label, hw, model, dtype): the chapter's case first, then ones that catch shortcuts."""
    from tinyserve import hardware as H
    toy = H.HardwareSpec("toy-accelerator", {"fp32": 1.3e12, "fp16": 5.2e12, "int8": 10.4e12},
                         memory_bandwidth=37e9, memory_size=16e9)
    return [
        ("A100 + 7B, fp16", H.A100_SXM_80GB, H.LLAMA_7B, "fp16"),
        ("A100 + 7B, fp32", H.A100_SXM_80GB, H.LLAMA_7B, "fp32"),
        ("H200 + 7B, fp16", H.H200, H.LLAMA_7B, "fp16"),
        ("H100 + 70B, bf16", H.H100_SXM, H.LLAMA_70B, "bf16"),
        ("H200 + 13B, fp8", H.H200, H.LLAMA_13B, "fp8"),
        ("toy + 13B, int8", toy, H.LLAMA_13B, "int8"),
    ]


def _as_number(value, name, label):
    import math
    try:
        x = float(value)
    except (TypeError, ValueError):
        fail(None, f"[{label}] {name} 应返回一个数（float），得到的是 {type(value).__name__}: {value!r}",
             f"[{label}] {name} must return a number (a float), got {type(value).__name__}: {value!r}")
    if not math.isfinite(x):
        fail(None, f"[{label}] {name} 返回了 {x}", f"[{label}] {name} returned {x}")
    return x


def _call3(fn, name, label, *args):
    try:
        return fn(*args)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        if "NotImplementedError" in text:
            raise NotImplementedError("还有没写完的部分 / something is not written yet") from None
        raise AssertionError(f"[{label}] {name} 抛出了 {text}\n/ [{label}] {name} raised {text}") from e


def _fmt_time(seconds: float) -> str:
    a = abs(seconds)
    if a >= 1:
        return f"{seconds:.3g} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds:.3g} s"


def _match_hint(got, want, hints, label, name, unit_fmt):
    """Raise with the hint whose wrong value matches ``got``; else a generic one."""
    for value, zh, en in hints:
        if value is not None and abs(value - want) > 1e-9 * abs(want) and abs(got - value) <= 1e-6 * abs(value):
            fail(None, f"[{label}] {name} 得到 {unit_fmt(got)}，应为 {unit_fmt(want)}：{zh}",
                 f"[{label}] {name}: got {unit_fmt(got)}, expected {unit_fmt(want)}: {en}")


def check_weight_read_time(weight_read_time):
    """``weight_read_time(hw, model, dtype)`` = parameters x bytes per parameter / bandwidth, in seconds."""
    from tinyserve import hardware as H
    for label, hw, model, dtype in _lab03_cases():
        got = _as_number(_call3(weight_read_time, "weight_read_time", label, hw, model, dtype),
                         "weight_read_time", label)
        want = H.weight_read_time(hw, model, dtype)
        if abs(got - want) <= 5e-4 * want:      # float rounding, and the chapter's rounded 153
            continue
        n, bw, e = model.num_parameters, hw.memory_bandwidth, H.bytes_per_element(dtype)
        hints = [
            (n / bw, "是不是把每个参数的字节数算成了 1？字节数取决于 dtype：hardware.bytes_per_element(dtype)",
             "did you count 1 byte per parameter? It depends on dtype: hardware.bytes_per_element(dtype)"),
            (2 * n / bw, f"每个参数固定算了 2 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
             f"did you hard-code 2 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
            (4 * n / bw, f"每个参数固定算了 4 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
             f"did you hard-code 4 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
            (want * 1e3, "这是毫秒，不是秒：返回秒（不要乘 1000）",
             "that is in milliseconds: return seconds (do not multiply by 1000)"),
            (want * 1e6, "这是微秒，不是秒：返回秒", "that is in microseconds: return seconds"),
            (want * 1e9, "带宽按 GB/s 的数值用了？hw.memory_bandwidth 已经是字节每秒",
             "did you use the bandwidth in GB/s? hw.memory_bandwidth is already in bytes per second"),
            (bw / (n * e), "除反了：时间 = 字节数 / 带宽", "upside down: time = bytes / bandwidth"),
            (2 * n / hw.peak_flops(dtype), "这是计算时间（2 FLOPs × 参数量 / 峰值算力），不是读权重的时间：字节数 / 带宽",
             "that is the compute time (2 FLOPs x parameters / peak): the read time is bytes / bandwidth"),
        ]
        _match_hint(got, want, hints, label, "weight_read_time", _fmt_time)
        fail(None, f"[{label}] weight_read_time 得到 {_fmt_time(got)}，应为 {_fmt_time(want)}"
                   f"（{n:.3g} 个参数 × {e} 字节 / {bw / 1e9:.4g} GB/s）",
             f"[{label}] weight_read_time: got {_fmt_time(got)}, expected {_fmt_time(want)} "
             f"({n:.3g} parameters x {e} bytes / {bw / 1e9:.4g} GB/s)")
    a100 = H.weight_read_time(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    print(f"✓ weight_read_time 通过：A100 上 7B fp16 每步读权重 {a100 * 1e3:.2f} ms（本章的 6.9 ms），"
          f"{len(_lab03_cases())} 组硬件/模型/dtype 都对 "
          f"/ weight_read_time passed: {a100 * 1e3:.2f} ms per step for 7B fp16 on an A100")


def check_per_request_compute_time(per_request_compute_time):
    """``per_request_compute_time(hw, model, dtype)`` = 2 x parameters / peak FLOP/s of dtype, in seconds."""
    from tinyserve import hardware as H
    for label, hw, model, dtype in _lab03_cases():
        got = _as_number(_call3(per_request_compute_time, "per_request_compute_time", label, hw, model, dtype),
                         "per_request_compute_time", label)
        want = H.per_request_compute_time(hw, model, dtype)
        if abs(got - want) <= 5e-4 * want:      # float rounding, and the chapter's rounded 153
            continue
        n, peak = model.num_parameters, hw.peak_flops(dtype)
        hints = [
            (n / peak, "少了因子 2：每个参数对一个新 token 做一次乘法和一次加法，是 2 FLOPs",
             "a factor 2 is missing: each parameter does a multiply and an add per new token, 2 FLOPs"),
            (want * 1e3, "这是毫秒，不是秒：返回秒", "that is in milliseconds: return seconds"),
            (want * 1e6, "这是微秒，不是秒：返回秒（不要乘 1e6）",
             "that is in microseconds: return seconds (do not multiply by 1e6)"),
            (2 * n / hw.flops.get("fp16", float("nan")),
             f"总是用了 fp16 的峰值：要用这个 dtype 的峰值 hw.peak_flops(dtype)（{dtype}）",
             f"you always used the fp16 peak: use the peak of this dtype, hw.peak_flops(dtype) ({dtype})"),
            (2 * n * H.bytes_per_element(dtype) / peak, "计算量与字节数无关：每个参数 2 FLOPs，不要乘每个参数的字节数",
             "FLOPs do not depend on bytes: 2 FLOPs per parameter, do not multiply by bytes per parameter"),
            (peak / (2 * n), "除反了：时间 = FLOPs / 峰值算力", "upside down: time = FLOPs / peak FLOP/s"),
        ]
        _match_hint(got, want, hints, label, "per_request_compute_time", _fmt_time)
        fail(None, f"[{label}] per_request_compute_time 得到 {_fmt_time(got)}，应为 {_fmt_time(want)}"
                   f"（2 × {n:.3g} FLOPs / {peak / 1e12:.4g} TFLOP/s）",
             f"[{label}] per_request_compute_time: got {_fmt_time(got)}, expected {_fmt_time(want)} "
             f"(2 x {n:.3g} FLOPs / {peak / 1e12:.4g} TFLOP/s)")
    a100 = H.per_request_compute_time(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    print(f"✓ per_request_compute_time 通过：A100 上 7B fp16 每多一条请求多算 {a100 * 1e6:.1f} µs（本章的 45 µs）"
          f" / per_request_compute_time passed: {a100 * 1e6:.1f} µs per extra request for 7B fp16 on an A100")


def check_crossover(crossover_batch):
    """``crossover_batch(hw, model, dtype)`` = weight_read_time / per_request_compute_time
    (153 for the chapter's A100 + 7B fp16, about 206 on an H200)."""
    from tinyserve import hardware as H
    for label, hw, model, dtype in _lab03_cases():
        got = _as_number(_call3(crossover_batch, "crossover_batch", label, hw, model, dtype),
                         "crossover_batch", label)
        want = H.crossover_batch(hw, model, dtype)
        if abs(got - want) <= 5e-4 * want:      # float rounding, and the chapter's rounded 153
            continue
        e = H.bytes_per_element(dtype)
        ridge = hw.ridge_point(dtype)          # peak / bandwidth = crossover x 2 / e
        fmt = lambda x: f"{x:.4g}"             # noqa: E731
        hints = [
            (ridge / 2, "是不是把每个参数的字节数算成了 1？交叉点 = 峰值/带宽 × 每参数字节数 / 2",
             "did you count 1 byte per parameter? crossover = peak / bandwidth x bytes per parameter / 2"),
            (ridge * 2 / 2 if e != 2 else None,
             f"每个参数固定算了 2 字节（或直接返回了算力带宽比 peak/bandwidth）？两者只在 2 字节的 dtype 下相等；{dtype} 每个参数 {e} 字节",
             f"did you hard-code 2 bytes per parameter (or return the ridge point peak / bandwidth)? They agree only "
             f"for 2-byte dtypes; {dtype} has {e}"),
            (want * 2, "大了一倍：是不是每个参数的计算量只算了 1 FLOP（应为 2：一次乘、一次加）？"
                       "或者每个参数的字节数算多了一倍？",
             "twice too large: did you count 1 FLOP per parameter (it is 2: a multiply and an add), "
             "or twice the bytes per parameter?"),
            (ridge * 4 / 2 if e != 4 else None,
             f"每个参数固定算了 4 字节？{dtype} 每个参数 {e} 字节：用 hardware.bytes_per_element(dtype)",
             f"did you hard-code 4 bytes per parameter? {dtype} has {e}: use hardware.bytes_per_element(dtype)"),
            (want / 2, "小了一半：是不是每个参数的字节数算少了一半，或者算成了 4 FLOPs？",
             "half of it: too few bytes per parameter, or 4 FLOPs per parameter?"),
            (1 / want, "除反了：交叉点 = 读权重的时间 / 每条请求的计算时间",
             "upside down: crossover = weight read time / compute time per request"),
            (want * 1e3, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
            (want / 1e3, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
            (want * 1e6, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
            (want / 1e6, "单位不一致：两个时间要都用秒", "mixed units: both times must be in seconds"),
        ]
        if abs(got - 153.0) < 1.5 and abs(want - 153.0) > 1.5:
            fail(None, f"[{label}] crossover_batch 得到 {got:.4g}，应为 {want:.4g}：153 只对本章的 A100 + fp16 成立，"
                       "要从 hw、model、dtype 算出来，不要写死",
                 f"[{label}] crossover_batch: got {got:.4g}, expected {want:.4g}: 153 holds only for the chapter's "
                 "A100 in fp16; compute it from hw, model and dtype instead of hard-coding it")
        _match_hint(got, want, hints, label, "crossover_batch", fmt)
        fail(None, f"[{label}] crossover_batch 得到 {got:.4g}，应为 {want:.4g}"
                   f"（= 读权重的时间 / 每条请求的计算时间；先让前面两个检查通过）",
             f"[{label}] crossover_batch: got {got:.4g}, expected {want:.4g} "
             "(= weight read time / compute time per request; make the two checks above pass first)")
    a100 = H.crossover_batch(H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    h200 = H.crossover_batch(H.H200, H.LLAMA_7B, "fp16")
    fp32 = H.crossover_batch(H.A100_SXM_80GB, H.LLAMA_7B, "fp32")
    print(f"✓ crossover_batch 通过：A100 + 7B fp16 为 {a100:.0f}（本章的 153），H200 约 {h200:.0f}；"
          f"A100 fp32 只有 {fp32:.1f}（fp32 没有张量核心，峰值低得多，字节却多一倍）\n"
          f"  / crossover_batch passed: {a100:.0f} for 7B fp16 on an A100 (the chapter's 153), about {h200:.0f} "
          f"on an H200, {fp32:.1f} in fp32 on an A100")


# -- find_knee --

def _hinge_curve(b, knee, floor):
    import numpy as np
    return floor * np.maximum(1.0, np.asarray(b, dtype=float) / knee)


def _knee_cases():
    """(label, batch_sizes, step_times, true knee or None for flat), seeded."""
    import numpy as np
    rng = np.random.default_rng(2024)
    geo = np.unique(np.round(np.geomspace(1, 1024, 24)))
    pow2 = 2.0 ** np.arange(0, 11)
    cases = [("clean, knee 153", geo, _hinge_curve(geo, 153, 6.9e-3), 153.0)]
    for knee, b, noise in ((16, geo, 0.05), (153, geo, 0.05), (184, geo, 0.05),
                           (153, pow2, 0.03), (40, np.arange(4, 129, 4.0), 0.05)):
        for rep in range(2):
            t = _hinge_curve(b, knee, 6.9e-3) * (1 + noise * rng.standard_normal(b.size))
            cases.append((f"knee {knee}, {noise:.0%} noise, {b.size} points ({rep + 1})", b, t, float(knee)))
    for b in (pow2[:7], geo[:12]):
        for rep in range(2):
            t = 0.03 * (1 + 0.03 * rng.standard_normal(b.size))
            cases.append((f"flat, 3% noise, B = 1..{b.max():.0f} ({rep + 1})", b, t, None))
    return cases


def _best_hinge_at(b, t, knee):
    """Weighted (relative-error) least-squares floor and slope for a given knee, and the residual."""
    import numpy as np
    x = np.maximum(b - knee, 0.0)
    a = np.stack([np.ones_like(b), x], 1) / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    floor, slope = float(coef[0]), max(float(coef[1]), 0.0)
    resid = float((((t - floor - slope * x) / t) ** 2).sum())
    return floor, slope, resid


def _line_only_knees(b, t):
    """What typical 'one straight line' attempts return."""
    import numpy as np
    s, a = np.polyfit(b, t, 1)
    out = []
    if s > 0:
        out += [(t.min() - a) / s, (t[0] - a) / s, -a / s, (t[:3].mean() - a) / s]
    return [float(v) for v in out]


def check_find_knee(find_knee):
    """``find_knee(batch_sizes, step_times) -> float`` on seeded noisy flat-then-linear curves,
    flat curves (the convention: return max(batch_sizes)) and bad input (ValueError)."""
    import numpy as np

    from tinyserve import hardware as H

    _call3(find_knee, "find_knee", "probe", [1.0, 2.0, 4.0, 8.0], [1.0, 1.0, 2.0, 4.0])
    worst = 0.0
    for label, b, t, true in _knee_cases():
        got = _as_number(_call3(find_knee, "find_knee", label, b.copy(), t.copy()), "find_knee", label)
        ref = H.fit_knee(b, t)
        b_min, b_max = float(b.min()), float(b.max())
        if true is None:
            assert ref.flat, f"internal: {label} should be flat for hardware.fit_knee"
            if abs(got - b_max) <= 1e-9 * b_max:
                continue
            fail(None, f"[{label}] 这条曲线是平的（测到的最大批 {b_max:.0f} 时还没拐），应返回 max(batch_sizes) = {b_max:.0f}，"
                       f"你返回了 {got:.4g}。拟合出的折线在测量范围内上升不到地板的 10% 时，就当作没有拐点",
                 f"[{label}] this curve is flat (no knee up to the largest batch, {b_max:.0f}): return "
                 f"max(batch_sizes) = {b_max:.0f}, got {got:.4g}. When the fitted hinge rises by less than "
                 "10% of the floor over the measured range, there is no knee in it")
        lo, hi = 0.7 * true, 1.3 * true
        ok = lo <= got <= hi or (not ref.flat and 0.75 * ref.knee <= got <= 1.25 * ref.knee)
        if ok:
            worst = max(worst, abs(got / true - 1))
            continue
        floor_ref = float(np.median(t[b <= true])) if (b <= true).any() else float(t.min())
        if got < 1 and got < b_min and abs(got - floor_ref) <= 0.5 * floor_ref:
            fail(None, f"[{label}] 你返回了 {got:.4g}，像是地板的步时（秒），不是批大小。要返回拐点所在的批大小（这里约 {true:.0f}）",
                 f"[{label}] got {got:.4g}, which looks like the floor step time (seconds), not a batch size. "
                 f"Return the batch size at the knee (about {true:.0f} here)")
        if got < 1 and got > 0:
            fail(None, f"[{label}] 你返回了 {got:.4g}：这是斜率或时间吗？要返回拐点所在的批大小（这里约 {true:.0f}）",
                 f"[{label}] got {got:.4g}: a slope or a time? Return the batch size at the knee (about {true:.0f} here)")
        if not (b_min - 1e-9 <= got <= b_max + 1e-9):
            line = any(abs(got - v) <= 1e-6 * max(abs(v), 1) for v in _line_only_knees(b, t))
            extra_zh = "看起来是对所有点拟合了一条直线再求交点：" if line else ""
            extra_en = "it looks like one straight line fitted through every point: " if line else ""
            fail(None, f"[{label}] 你返回了 {got:.4g}，不在测量范围 [{b_min:.0f}, {b_max:.0f}] 内（真实拐点约 {true:.0f}）。"
                       f"{extra_zh}候选拐点只在测到的批大小范围里取，每个候选都分别拟合“平的一段”和“斜的一段”",
                 f"[{label}] got {got:.4g}, outside the measured range [{b_min:.0f}, {b_max:.0f}] (the knee is near "
                 f"{true:.0f}). {extra_en}take candidate knees within the measured batch sizes and fit both the "
                 "flat part and the rising part for each")
        if any(abs(got - v) <= 1e-6 * max(abs(v), 1) for v in _line_only_knees(b, t)):
            fail(None, f"[{label}] 你返回了 {got:.4g}（真实拐点约 {true:.0f}）：这是一条直线穿过所有点得到的。"
                       "一条直线描述不了“先平后升”：对每个候选拐点 k 拟合 t = floor + slope·max(B − k, 0)，取残差最小的 k",
                 f"[{label}] got {got:.4g} (the knee is near {true:.0f}): that comes from one straight line through "
                 "every point. A line cannot be flat and then rise: for each candidate knee k fit "
                 "t = floor + slope * max(B - k, 0) and keep the k with the smallest residual")
        _, _, r_got = _best_hinge_at(b, t, got)
        _, _, r_ref = _best_hinge_at(b, t, ref.knee)
        if abs(got - b_max) <= 1e-9 * b_max:
            fail(None, f"[{label}] 你返回了 max(batch_sizes) = {b_max:.0f}，当成了平的曲线，但它在 {true:.0f} 附近明显拐了。"
                       "只有拟合出的折线在测量范围内上升不到地板的 10% 时才算平",
                 f"[{label}] got max(batch_sizes) = {b_max:.0f}, i.e. a flat curve, but it clearly bends near "
                 f"{true:.0f}. Call it flat only when the fitted hinge rises by less than 10% of the floor")
        if r_got > 1.5 * r_ref:
            fail(None, f"[{label}] 你返回了 {got:.4g}，真实拐点约 {true:.0f}（参考实现 {ref.knee:.4g}）。在你的拐点上，"
                       f"最好的“先平后升”折线的相对残差是参考拐点处的 {r_got / r_ref:.1f} 倍：要试足够多的候选拐点"
                       "（例如 np.geomspace(B_min, B_max, 500)），每个都用最小二乘求 floor 和 slope，保留残差最小的",
                 f"[{label}] got {got:.4g}; the knee is near {true:.0f} (reference {ref.knee:.4g}). At your knee the "
                 f"best flat-then-linear fit has {r_got / r_ref:.1f}x the relative residual of the reference: try "
                 "enough candidate knees (e.g. np.geomspace(B_min, B_max, 500)), fit floor and slope by least "
                 "squares for each, keep the smallest residual")
        fail(None, f"[{label}] 你返回了 {got:.4g}，真实拐点约 {true:.0f}（参考实现 {ref.knee:.4g}），超出 ±30%。"
                   "最小化相对误差（每行除以 t）：否则后面又高又吵的点会把拐点拉偏",
             f"[{label}] got {got:.4g}; the knee is near {true:.0f} (reference {ref.knee:.4g}), off by more than "
             "30%. Minimise the relative error (divide each row by t): otherwise the tall, noisy tail drags the knee")
    bad = [
        ("长度不同 / lengths differ", [1, 2, 4, 8], [1.0, 1.0, 2.0]),
        ("少于 3 个点 / fewer than 3 points", [1, 2], [1.0, 2.0]),
        ("批大小为 0 / a batch size of 0", [0, 2, 4, 8], [1.0, 1.0, 2.0, 4.0]),
        ("步时为负 / a negative step time", [1, 2, 4, 8], [1.0, -1.0, 2.0, 4.0]),
        ("含 NaN / a NaN", [1, 2, 4, 8], [1.0, float("nan"), 2.0, 4.0]),
    ]
    for what, b, t in bad:
        try:
            find_knee(b, t)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            fail(None, f"输入有问题（{what}）时应抛出 ValueError，你抛出了 {type(e).__name__}: {e}",
                 f"bad input ({what}) must raise ValueError, got {type(e).__name__}: {e}")
        fail(None, f"输入有问题（{what}）时应抛出 ValueError，你的函数却返回了结果。先检查输入再拟合",
             f"bad input ({what}) must raise ValueError, but your function returned. Validate before fitting")
    n = len(_knee_cases())
    print(f"✓ find_knee 通过：{n} 条合成曲线（拐点 16、40、153、184，噪声 3–5%，以及平的曲线），"
          f"最大相对误差 {worst:.0%}；坏输入都抛出 ValueError "
          f"/ find_knee passed {n} synthetic curves (worst relative error {worst:.0%}) and rejects bad input")


# -- the student's own machine --

def _sweep_matmul_stack(batch_sizes, hidden, layers, budget_s, device="cpu"):
    """Median step time of ``layers`` chained [B, hidden] @ [hidden, hidden] fp32 matmuls, per batch size.

    One warm-up step per batch size tells how long a round takes; the largest
    batch sizes are dropped (down to 8) if three rounds would not fit
    ``budget_s``. The batch sizes are then timed round-robin, 3 to 7 rounds, so
    that a burst of other work on the machine spreads over all of them instead
    of bending one. Returns (batch sizes kept, median times).
    """
    import statistics
    import time

    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(hidden, hidden, generator=gen).div_(hidden ** 0.5).to(device) for _ in range(layers)]
    xs = {b: torch.randn(b, hidden, generator=gen).to(device) for b in batch_sizes}

    def step(x):
        t0 = time.perf_counter()
        for w in weights:
            x = x @ w
        return time.perf_counter() - t0

    start = time.perf_counter()
    step(xs[batch_sizes[0]])                      # allocator, thread pool
    warm = {b: step(xs[b]) for b in batch_sizes}  # also the cost of one round
    kept = list(batch_sizes)
    left = lambda: budget_s - (time.perf_counter() - start)             # noqa: E731
    while len(kept) > 8 and 3 * sum(warm[b] for b in kept) > left():
        kept.pop()
    rounds = int(min(7, max(3, left() / max(sum(warm[b] for b in kept), 1e-9))))
    samples = {b: [] for b in kept}
    for _ in range(rounds):
        for b in kept:
            samples[b].append(step(xs[b]))
    return kept, [statistics.median(samples[b]) for b in kept]


def check_my_machine(find_knee, crossover_batch, plot=True, budget_s: float = 10.0):
    """Measure this CPU's ceilings and the step time of a matmul stack against batch size; fit the
    knee with the student's ``find_knee``; compare it with the student's ``crossover_batch`` on the
    measured ceilings. Asserts only what always holds (a knee inside the sweep, consistent arithmetic);
    returns the data for the discussion."""
    import torch

    from tinyserve import hardware as H

    # Fail fast, before measuring anything, when a function is still a stub.
    _call3(crossover_batch, "crossover_batch", "probe", H.A100_SXM_80GB, H.LLAMA_7B, "fp16")
    _call3(find_knee, "find_knee", "probe", [1.0, 2.0, 4.0, 8.0], [1.0, 1.0, 2.0, 4.0])

    # One thread for the ceilings and the sweep alike: the ratio stays that of one core, and a
    # machine shared with other work (a laptop, CI) does not stall on a thread that lost its core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _my_machine(find_knee, crossover_batch, plot, budget_s)
    finally:
        torch.set_num_threads(threads)


def _my_machine(find_knee, crossover_batch, plot, budget_s):
    import time

    import numpy as np

    from tinyserve import hardware as H

    start = time.perf_counter()
    spec = H.measure_device("cpu", seconds=min(1.5, budget_s / 6), copy_mib=128, matmul_size=1024)
    hidden, layers = 1024, 32                        # 32 x 4 MiB = 128 MiB of fp32 weights: past any cache
    model = H.ModelSpec(f"{layers} x [{hidden}x{hidden}] matmuls", float(layers * hidden * hidden),
                        hidden_size=hidden, num_layers=layers, num_kv_heads=1, head_dim=hidden, vocab_size=0)
    floor_s = H.weight_read_time(spec, model, "fp32")
    per_s = H.per_request_compute_time(spec, model, "fp32")
    # Sweep to about 8x the predicted crossover (at least 32, at most 256).
    top = min(256, max(32, 8 * floor_s / per_s))
    batch_sizes = [b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b <= top]
    left = max(budget_s - (time.perf_counter() - start), 2.0)
    batch_sizes, step_times = _sweep_matmul_stack(batch_sizes, hidden, layers, left)
    b = np.asarray(batch_sizes, dtype=float)
    t = np.asarray(step_times, dtype=float)

    knee = _as_number(_call3(find_knee, "find_knee", "your machine", b.copy(), t.copy()), "find_knee", "your machine")
    predicted = _as_number(_call3(crossover_batch, "crossover_batch", "your machine", spec, model, "fp32"),
                           "crossover_batch", "your machine")
    want = H.crossover_batch(spec, model, "fp32")
    if abs(predicted - want) > 1e-6 * want:
        fail(None, f"在测出的 {spec.name} 上，crossover_batch 得到 {predicted:.4g}，应为 {want:.4g}",
             f"on the measured {spec.name}, crossover_batch gave {predicted:.4g}, expected {want:.4g}")
    if not (b.min() - 1e-9 <= knee <= b.max() + 1e-9):
        fail(None, f"find_knee 返回了 {knee:.4g}，不在扫描范围 [{b.min():.0f}, {b.max():.0f}] 内",
             f"find_knee returned {knee:.4g}, outside the sweep [{b.min():.0f}, {b.max():.0f}]")
    floor, slope, _ = _best_hinge_at(b, t, knee)
    ref = H.fit_knee(b, t)
    flat = abs(knee - b.max()) <= 1e-9 * b.max()

    if plot:
        import matplotlib.pyplot as plt
        import matplotlib.ticker
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=90)
        ax.plot(b, t * 1e3, "o", color="C0", label="measured step time")
        bb = np.geomspace(b.min(), b.max(), 200)
        ax.plot(bb, (floor + slope * np.maximum(bb - knee, 0)) * 1e3, "-", color="C0", alpha=0.7,
                label=f"your hinge fit (knee {knee:.0f})")
        roof = [H.decode_step_time(spec, model, x, "fp32") for x in bb]
        ax.plot(bb, np.asarray(roof) * 1e3, "--", color="C1", label="roofline from measured ceilings")
        ax.axvline(knee, color="C0", ls=":", lw=1)
        ax.axvline(predicted, color="C1", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylim(0, 1.15 * max(t.max(), max(roof)) * 1e3)
        top = ax.get_ylim()[1]
        ax.annotate(f"your knee {knee:.0f}", (knee, top), xytext=(3, -12),
                    textcoords="offset points", color="C0", fontsize=8)
        ax.annotate(f"predicted crossover {predicted:.0f}", (predicted, top), xytext=(3, -24),
                    textcoords="offset points", color="C1", fontsize=8)
        ax.set_xlabel("batch size B (rows per matmul)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{model.name}, fp32, one thread of this CPU", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        plt.show()

    ratio = knee / predicted
    print(f"测出的上限 / measured ceilings: 带宽 bandwidth {spec.memory_bandwidth / 1e9:.1f} GB/s, "
          f"fp32 峰值 peak {spec.flops['fp32'] / 1e9:.0f} GFLOP/s")
    print(f"B=1 步时 / step at B=1: {t[0] * 1e3:.2f} ms，读权重的下限 / weight-read floor "
          f"{floor_s * 1e3:.2f} ms（{t[0] / floor_s:.2f}×）")
    print(f"预测的交叉点 / predicted crossover: {predicted:.1f}；你拟合的拐点 / your knee: {knee:.1f}"
          + ("（平的：拐点在扫描范围之外 / flat: beyond the sweep）" if flat else "")
          + f"；参考 fit_knee / reference: {ref.knee:.1f}；拐点/预测 = {ratio:.2f}")
    print(f"✓ 在你的机器上测完了：{len(batch_sizes)} 个批大小，用时 {time.perf_counter() - start:.1f} s "
          f"/ measured your machine: {len(batch_sizes)} batch sizes")
    return {"spec": spec, "model": model, "batch_sizes": batch_sizes, "step_times": step_times,
            "knee": knee, "predicted": predicted, "reference_knee": ref.knee, "floor": floor, "slope": slope,
            "weight_read_floor": floor_s}


# ---- Lab 04: a streaming detokenizer that never sends half a character ------------------
#
# ``utf8_length(lead_byte) -> int``: how many bytes the character starting with this byte
# has (1-4), or 0 if the byte cannot start a character.
# ``pending_start(data) -> int``: where an unfinished-but-still-possible character starts at
# the end of ``data`` (``len(data)`` when nothing has to wait).
# ``StreamDetokenizer(tokenizer)`` with ``push(token_id) -> str`` and ``flush() -> str``:
# compared push by push with ``tinyserve.tokenizer.StreamDetokenizer``, which emits exactly
# what Python's incremental UTF-8 decoder (errors="replace") emits.

__all__ += ["check_utf8_length", "check_pending_start", "check_stream_detokenizer"]

LAB04_TEXTS = (
    "你好，世界！",
    "调度器把请求放进队列，轮到时先做预填充。",
    "一个汉字是 3 个字节，一个 emoji 是 4 个：🙂🚀",
    "首字延迟 TTFT ≈ 0.2 s，出字速度 TPOT ≈ 30 ms/token ✅",
    "café, naïve, 𝄞, ☃ and 中文 mixed 🤖!",
    "🧑‍💻👍🏽🇨🇳",
)


def _utf8_length_ref(b: int) -> int:
    if b < 0x80:
        return 1
    if 0xC2 <= b <= 0xDF:
        return 2
    if 0xE0 <= b <= 0xEF:
        return 3
    if 0xF0 <= b <= 0xF4:
        return 4
    return 0


def _char_kind(need: int) -> tuple[str, str]:
    return {2: ("一个 2 字节字符（比如 é）", "a 2-byte character (e.g. é)"),
            3: ("一个 3 字节字符（比如汉字）", "a 3-byte character (e.g. a Chinese character)"),
            4: ("一个 4 字节字符（比如 emoji）", "a 4-byte character (e.g. an emoji)")}.get(
                need, (f"一个 {need} 字节字符", f"a {need}-byte character"))


def _call4(fn, name, where_zh, where_en, *args):
    try:
        return fn(*args)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        raise AssertionError(f"{where_zh}{name} 抛出了 {text}\n/ {where_en}{name} raised {text}") from e


def check_utf8_length(utf8_length):
    """Check ``utf8_length(lead_byte)`` on all 256 byte values."""
    for b in range(256):
        got = _call4(utf8_length, "utf8_length", f"utf8_length(0x{b:02X})：", f"utf8_length(0x{b:02X}): ", b)
        want = _utf8_length_ref(b)
        if isinstance(got, bool) or not isinstance(got, int):
            fail(None, f"utf8_length(0x{b:02X}) 返回了 {got!r}（{type(got).__name__}），应返回 int {want}",
                 f"utf8_length(0x{b:02X}) returned {got!r} ({type(got).__name__}); return the int {want}")
        if got == want:
            continue
        head = (f"utf8_length(0x{b:02X}) 返回 {got}，应为 {want}。字节 0x{b:02X} = 0b{b:08b}：",
                f"utf8_length(0x{b:02X}) returned {got}, expected {want}. Byte 0x{b:02X} = 0b{b:08b}: ")
        if b < 0x80:
            why = ("最高位是 0，它本身就是一个完整的 ASCII 字符，长度 1",
                   "its top bit is 0, so it is a whole ASCII character: length 1")
        elif b < 0xC0:
            why = ("10xxxxxx 是后续字节（continuation byte），只能跟在首字节后面，不能开始一个字符：返回 0",
                   "10xxxxxx is a continuation byte: it only follows a lead byte and never starts a character, "
                   "return 0")
        elif b < 0xC2:
            why = ("0xC0 和 0xC1 只能组成 ASCII 的“超长”编码（overlong），Python 的解码器拒绝它们：返回 0",
                   "0xC0 and 0xC1 could only make overlong forms of ASCII, which Python's decoder rejects: "
                   "return 0")
        elif b > 0xF4:
            why = ("0xF5–0xFF 会编码出大于 U+10FFFF 的码点（或根本不是合法的首字节）：返回 0",
                   "0xF5-0xFF would encode code points above U+10FFFF (or are no lead byte at all): return 0")
        else:
            why = (f"首字节开头有几个 1，这个字符就有几个字节：110xxxxx→2，1110xxxx→3，11110xxx→4，这里是 {want}",
                   f"count the leading 1 bits of a lead byte: 110xxxxx->2, 1110xxxx->3, 11110xxx->4; "
                   f"here {want}")
        fail(None, head[0] + why[0], head[1] + why[1])
    print("✓ utf8_length 在全部 256 个字节上都对 / utf8_length is right on all 256 byte values "
          "(1: 0x00–0x7F, 2: 0xC2–0xDF, 3: 0xE0–0xEF, 4: 0xF0–0xF4, 0: the rest)")


def _settle_reason(data: bytes) -> tuple[str, str]:
    """Why all of ``data`` is settled (the reference returned len(data))."""
    from tinyserve.tokenizer import utf8_lead_info
    n = len(data)
    start = n
    for s in range(n - 1, max(n - 4, -1), -1):
        if not 0x80 <= data[s] <= 0xBF:
            start = s
            break
    if start == n:
        return ("末尾（最多 3 个）都是后续字节，前面没有能等待它们的首字节：它们再也凑不成字符，现在就输出（变成 U+FFFD）",
                "the last bytes (up to 3) are all continuation bytes with no lead byte they could belong to: "
                "they can never form a character, emit them now (as U+FFFD)")
    lead = data[start]
    need = _utf8_length_ref(lead)
    have = n - start
    if need == 0:
        return (f"0x{lead:02X} 不能开始一个字符（utf8_length 为 0）：后面再来什么都救不了它，现在就输出（U+FFFD）",
                f"0x{lead:02X} cannot start a character (utf8_length is 0): nothing that comes later can save it, "
                f"emit it now (as U+FFFD)")
    if have >= need:
        return (f"以 0x{lead:02X} 开头的 {need} 字节字符已经到齐了（或者它本身就是 ASCII）：完整的字符要立刻输出",
                f"the {need}-byte character starting with 0x{lead:02X} is complete (or it is ASCII): "
                f"emit complete characters at once")
    lo, hi = utf8_lead_info(lead)[1:]
    sec = data[start + 1]
    return (f"首字节 0x{lead:02X} 之后的第二个字节必须在 0x{lo:02X}–0x{hi:02X} 之间，而这里是 0x{sec:02X}：这个字符已经"
            f"不可能合法了（超长编码、代理区或超出 U+10FFFF），Python 的解码器此时就输出 U+FFFD，你也要现在输出"
            f"（用 second_byte_range(lead)）",
            f"after the lead byte 0x{lead:02X} the second byte must be 0x{lo:02X}-0x{hi:02X}, here it is "
            f"0x{sec:02X}: this character can no longer be valid (overlong, surrogate or above U+10FFFF); "
            f"Python's decoder emits U+FFFD right now and so must you (use second_byte_range(lead))")


def _invalid_reason(data: bytes, skip_chars: int) -> tuple[str, str]:
    """Why the first invalid bytes of ``data`` that decode past character ``skip_chars`` are settled."""
    pos = chars = 0
    while True:
        try:
            data[pos:].decode("utf-8")
            return _settle_reason(data)
        except UnicodeDecodeError as e:
            start, end = pos + e.start, pos + e.end
        chars += len(data[pos:start].decode("utf-8"))
        if chars >= skip_chars:
            break
        chars += 1
        pos = end
    bad = data[start:end]
    lead = bad[0]
    if end - start == 1 and 0x80 <= lead <= 0xBF:
        return (f"{bad!r} 是一个后续字节，前面没有等着它的首字节，它永远凑不成字符（U+FFFD）",
                f"{bad!r} is a continuation byte with no lead byte waiting for it: it can never form a "
                f"character (U+FFFD)")
    if _utf8_length_ref(lead) == 0:
        return (f"0x{lead:02X} 不能开始一个字符（utf8_length 为 0），它永远是 U+FFFD",
                f"0x{lead:02X} cannot start a character (utf8_length is 0): it is U+FFFD for good")
    nxt = data[end:end + 1]
    if end - start == 1 and nxt and 0x80 <= nxt[0] <= 0xBF:
        from tinyserve.tokenizer import utf8_lead_info
        lo, hi = utf8_lead_info(lead)[1:]
        return (f"首字节 0x{lead:02X} 之后的第二个字节必须在 0x{lo:02X}–0x{hi:02X} 之间（second_byte_range），"
                f"而这里是 0x{nxt[0]:02X}：超长编码、代理区或超出 U+10FFFF，这个字符不可能合法，现在就输出 U+FFFD",
                f"after the lead byte 0x{lead:02X} the second byte must be 0x{lo:02X}-0x{hi:02X} "
                f"(second_byte_range), here it is 0x{nxt[0]:02X}: overlong, surrogate or above U+10FFFF, this "
                f"character can never be valid, emit U+FFFD now")
    return (f"{bad!r} 是{_char_kind(_utf8_length_ref(lead))[0]}的开头，但下一个字节 {nxt!r} 不是后续字节"
            f"（10xxxxxx）：这个字符再也补不全了，现在就输出 U+FFFD",
            f"{bad!r} starts {_char_kind(_utf8_length_ref(lead))[1]}, but the next byte {nxt!r} is not a "
            f"continuation byte (10xxxxxx): it can never be completed, emit U+FFFD now")


def _pending_cases():
    import itertools
    rng = random.Random(4)
    yield b""
    for b in range(256):
        yield bytes([b])
    for a in range(256):
        for b in (0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xE4, 0xF0):
            yield bytes([a, b])
    interesting = (0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE4, 0xED, 0xEF,
                   0xF0, 0xF4, 0xF5, 0xFF)
    for combo in itertools.product(interesting, repeat=3):
        yield bytes(combo)
    for _ in range(3000):
        yield bytes(rng.choice(interesting) for _ in range(rng.randint(4, 7)))
    for text in LAB04_TEXTS:
        raw = text.encode("utf-8")
        for i in range(len(raw) + 1):
            yield raw[:i]


def check_pending_start(pending_start):
    """Check ``pending_start(data)`` on every short byte string that matters, and on prefixes of real text."""
    from tinyserve.tokenizer import pending_start as reference_pending_start
    count = 0
    for data in _pending_cases():
        count += 1
        got = _call4(pending_start, "pending_start", f"pending_start({data!r})：", f"pending_start({data!r}): ", data)
        want = reference_pending_start(data)
        n = len(data)
        if got == _incremental_pending_start(data):   # CPython waits one byte longer after ED A0-BF
            continue
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= n:
            fail(None, f"pending_start({data!r}) 返回了 {got!r}，应返回 0 到 len(data)={n} 之间的 int（这里应为 {want}）",
                 f"pending_start({data!r}) returned {got!r}; return an int between 0 and len(data)={n} "
                 f"(here {want})")
        if got == want:
            continue
        head = (f"pending_start({data!r}) 返回 {got}，应为 {want}。", f"pending_start({data!r}) returned {got}, "
                f"expected {want}. ")
        if want < n:
            tail = data[want:]
            need = _utf8_length_ref(tail[0])
            kind = _char_kind(need)
            if got > want:
                fail(None, head[0] + f"末尾的 {len(tail)} 个字节 {tail!r} 是{kind[0]}的前 {len(tail)} 个字节，后面的 token "
                     f"还可能把它补全——留在缓冲区里，不要现在解码",
                     head[1] + f"the last {len(tail)} bytes {tail!r} are the first {len(tail)} bytes of {kind[1]}; "
                     f"a later token may still complete it: keep them pending, do not decode them yet")
            fail(None, head[0] + f"只有末尾的 {tail!r}（{kind[0]}的开头）需要等；它前面的字节都已确定，应该输出",
                 head[1] + f"only the tail {tail!r} (the start of {kind[1]}) has to wait; every byte before it "
                 f"is settled and should be emitted")
        zh, en = _settle_reason(data)
        fail(None, head[0] + f"这些字节都已确定：{zh}", head[1] + f"every byte is settled: {en}")
    print(f"✓ pending_start 在 {count} 个字节串上与参考实现一致 / pending_start matches the reference on "
          f"{count} byte strings (all 1-byte, many 2-4-byte ones, every prefix of Chinese and emoji text)")


# ---- the stream check -----------------------------------------------------------------
#
# Two answers are accepted at every step, and a student must stick to one of them: the reference
# (emit U+FFFD as soon as the second byte proves a character impossible) and CPython's incremental
# decoder, which differ only after ED A0-BF (a UTF-16 surrogate): with errors="replace" it is
# already certain, but CPython waits for the third byte. The final text is the same either way.

def _incremental_pending_start(data: bytes) -> int:
    import codecs
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(data, final=False)
    return len(data) - len(dec.getstate()[0])


class _IncrementalOracle:
    def __init__(self, tok):
        import codecs
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def pending(self) -> bytes:
        return self.dec.getstate()[0]

    def push(self, token_id) -> str:
        return self.dec.decode(self.tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def _greedy_ids(tok, data: bytes) -> list[int]:
    """Cover ``data`` with vocabulary tokens, longest match first (any bytes, even invalid UTF-8)."""
    table = _token_table(tok)
    longest = max(len(b) for b in table)
    ids, i = [], 0
    while i < len(data):
        for size in range(min(longest, len(data) - i), 0, -1):
            tid = table.get(data[i:i + size])
            if tid is not None:
                ids.append(tid)
                i += size
                break
    return ids


@functools.lru_cache(maxsize=4)
def _token_table(tok) -> dict:
    table = {}
    for tid in range(tok.vocab_size):
        b = tok.token_bytes(tid)
        if b and b not in table:
            table[b] = tid
    return table


def _stream_cases(tok):
    """(label, ids, valid) for every stream the check feeds."""
    rng = random.Random(44)
    specials = [tok.special_tokens[name] for name in tok.special_tokens]
    for text in LAB04_TEXTS:
        raw = text.encode("utf-8")
        yield f"encode({text!r})", tok.encode(text), True
        yield f"{text!r} byte by byte", list(raw), True
        for i in range(1, len(raw)):
            yield f"{text!r} split at byte {i}", _greedy_ids(tok, raw[:i]) + _greedy_ids(tok, raw[i:]), True
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(2, 8))))
            parts = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
            yield f"{text!r} cut at bytes {cuts}", [t for p in parts for t in _greedy_ids(tok, p)], True
        ids = tok.encode(text)
        with_specials = list(ids)
        for _ in range(3):
            with_specials.insert(rng.randint(0, len(with_specials)), rng.choice(specials))
        yield f"encode({text!r}) with special tokens", with_specials, True
        raw_ids = list(raw)
        for _ in range(3):
            raw_ids.insert(rng.randint(1, len(raw_ids)), rng.choice(specials))
        yield f"{text!r} byte by byte, special tokens in the middle of characters", raw_ids, True
    # What a random-weight model produces: any id, in any order.
    for seed in range(40):
        r = random.Random(seed)
        ids = [r.randrange(tok.vocab_size) for _ in range(r.randint(5, 40))]
        yield f"random ids (seed {seed})", ids, None
    # Mostly single high bytes: lots of unfinished and impossible sequences.
    high = list(range(0x80, 0x100)) + [0x41, 0x20]
    for seed in range(60):
        r = random.Random(1000 + seed)
        ids = [r.choice(high) if r.random() < 0.8 else r.randrange(tok.vocab_size) for _ in range(r.randint(3, 25))]
        yield f"random bytes (seed {seed})", ids, None
    for data in (b"\xe4\xbd", b"\xf0\x9f\x99", b"\xe4\xbd\xa0\xe5", b"\xe0\x80\x80", b"\xed\xa0\x80",
                 b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80\x80\x80\x80", b"\xe4A\xe5\xa5", b"\xf0\x9f\x99\x82\xf0"):
        yield f"bytes {data!r} one by one", list(data), None


def _describe_ids(tok, ids, upto):
    return ", ".join(f"{i}:{tok.token_bytes(i)!r}" if not tok.is_special(i) else f"{i}:<special>"
                     for i in ids[max(0, upto - 5):upto + 1])


def _explain_push(tok, label, ids, k, got, want, pending_before, ref_pending, valid):
    step = (f"[{label}] 第 {k + 1} 个 token（id {ids[k]}）之后，", f"[{label}] after token {k + 1} (id {ids[k]}), ")
    ctx = (f"\n  最近的 token（id:字节）：{_describe_ids(tok, ids, k)}",
           f"\n  recent tokens (id:bytes): {_describe_ids(tok, ids, k)}")
    data = pending_before + tok.token_bytes(ids[k])
    if not isinstance(got, str):
        fail(None, step[0] + f"push 返回了 {got!r}（{type(got).__name__}），应返回 str（没有可输出的就返回 \"\"）",
             step[1] + f"push returned {got!r} ({type(got).__name__}); return a str (\"\" when nothing is ready)")
    if tok.is_special(ids[k]) and got != want:
        fail(None, step[0] + f"你输出了 {got!r}。特殊 token（{tok.decode([ids[k]], skip_special_tokens=False)}）没有文字："
             f"跳过它，不输出任何东西，也不要动缓冲区里等待的字节（decode 会跳过它们）" + ctx[0],
             step[1] + f"you emitted {got!r}. A special token ({tok.decode([ids[k]], skip_special_tokens=False)}) "
             f"has no text: skip it, emit nothing and leave the pending bytes alone (decode skips specials)" + ctx[1])
    if len(got) > len(want) and got.startswith(want):
        extra = got[len(want):]
        need = _utf8_length_ref(ref_pending[0]) if ref_pending else 0
        kind = _char_kind(need)
        if "\ufffd" in extra and ref_pending:
            fail(None, step[0] + f"你输出了 {extra!r}，但缓冲区末尾的 {len(ref_pending)} 个字节 {ref_pending!r} 只是"
                 f"{kind[0]}的前 {len(ref_pending)} 个字节——后面的 token 还可能补全它：先留在缓冲区，等字符到齐"
                 f"（或确定不可能到齐）再输出" + ctx[0],
                 step[1] + f"you emitted {extra!r}, but the {len(ref_pending)} bytes {ref_pending!r} at the end "
                 f"are only the first {len(ref_pending)} bytes of {kind[1]}; a later token may complete it: keep "
                 f"them pending until the character is complete (or can no longer be)" + ctx[1])
        fail(None, step[0] + f"你多输出了 {extra!r}：这些字节还没确定（等待中的是 {ref_pending!r}）" + ctx[0],
             step[1] + f"you emitted {extra!r} too early: those bytes are not settled yet (pending: "
             f"{ref_pending!r})" + ctx[1])
    if len(got) < len(want) and want.startswith(got):
        held = want[len(got):]
        if "\ufffd" in held:
            settled = data[:len(data) - len(ref_pending)]
            zh, en = _invalid_reason(settled, len(got))
            fail(None, step[0] + f"应该输出 {want!r}，你只输出了 {got!r}。字节 {settled!r} 已经确定，不会再变：{zh}。"
                 f"一直留着它们，文字就会卡住，缓冲区越积越多" + ctx[0],
                 step[1] + f"expected {want!r}, you emitted only {got!r}. The bytes {settled!r} are settled: {en}. "
                 f"Holding them back stalls the text and the buffer keeps growing" + ctx[1])
        fail(None, step[0] + f"应该输出 {want!r}，你只输出了 {got!r}：{held!r} 的字节已经全部到了，完整的字符要立刻"
             f"发出去（流式输出的意义就在于此），只有末尾未完成的字符才等待" + ctx[0],
             step[1] + f"expected {want!r}, you emitted only {got!r}: all the bytes of {held!r} have arrived; "
             f"emit complete characters at once (that is the point of streaming) and keep only an unfinished "
             f"last character pending" + ctx[1])
    if valid and "\ufffd" in got:
        fail(None, step[0] + f"你输出了 {got!r}，应为 {want!r}。输入是合法的 UTF-8 文本，输出里不该出现 U+FFFD（�）："
             f"是不是把半个字符解码了？" + ctx[0],
             step[1] + f"you emitted {got!r}, expected {want!r}. The input is valid UTF-8, so U+FFFD must never "
             f"appear: did you decode half a character?" + ctx[1])
    fail(None, step[0] + f"你输出了 {got!r}，应为 {want!r}（缓冲区加上这个 token 的字节是 {data!r}）" + ctx[0],
         step[1] + f"you emitted {got!r}, expected {want!r} (pending bytes plus this token's bytes: {data!r})" + ctx[1])


def check_stream_detokenizer(detokenizer_cls, tokenizer=None, show=True):
    """Feed ``detokenizer_cls(tokenizer)`` Chinese and emoji text split at every byte, token by token,
    byte by byte, with special tokens, and random id streams; compare every push and flush with the
    reference, and the concatenation with ``tokenizer.decode(ids)``."""
    from tinyserve.tokenizer import StreamDetokenizer, load_default_tokenizer
    tok = tokenizer or load_default_tokenizer()
    streams = tokens = 0
    for label, ids, valid in _stream_cases(tok):
        det = _call4(detokenizer_cls, "StreamDetokenizer(tokenizer)", f"[{label}] ", f"[{label}] ", tok)
        alive = [StreamDetokenizer(tok), _IncrementalOracle(tok)]
        out = []
        for k, tid in enumerate(ids):
            before = [o.pending for o in alive]
            wants = [o.push(tid) for o in alive]
            got = _call4(det.push, "push", f"[{label}] 第 {k + 1} 个 token：",
                         f"[{label}] token {k + 1}: ", tid)
            if got not in wants:
                _explain_push(tok, label, ids, k, got, wants[0], before[0], alive[0].pending, valid)
            alive = [o for o, w in zip(alive, wants) if w == got]
            out.append(got)
        ref = alive[0]
        ref_pending = ref.pending
        want = ref.flush()
        got = _call4(det.flush, "flush", f"[{label}] 结尾：", f"[{label}] at the end: ")
        if got is None and want == "":
            got = ""
        if got != want:
            if not isinstance(got, str):
                fail(None, f"[{label}] flush() 返回了 {got!r}，应返回 str {want!r}",
                     f"[{label}] flush() returned {got!r}; return the str {want!r}")
            if got == "":
                fail(None, f"[{label}] 流结束时缓冲区里还有 {ref_pending!r}：flush() 要把它们交出来——未完成的字符变成 "
                     f"U+FFFD，就像 decode 做的那样（应返回 {want!r}），并清空缓冲区",
                     f"[{label}] the stream ended with {ref_pending!r} pending: flush() must hand them over, an "
                     f"unfinished character becoming U+FFFD as decode does (expected {want!r}), and empty the buffer")
            fail(None, f"[{label}] flush() 返回了 {got!r}，应为 {want!r}（缓冲区里是 {ref_pending!r}，用 "
                 f"bytes.decode('utf-8', errors='replace') 解码它）",
                 f"[{label}] flush() returned {got!r}, expected {want!r} (the pending bytes are {ref_pending!r}; "
                 f"decode them with bytes.decode('utf-8', errors='replace'))")
        out.append(got)
        full = tok.decode(ids)
        assert "".join(out) == full, "internal: the reference detokenizer disagrees with decode"
        if valid:
            assert "\ufffd" not in full
        streams += 1
        tokens += len(ids)
    print(f"✓ {streams} 条流、{tokens} 个 token：每次 push 与 flush 都和参考实现一致，拼起来等于 tokenizer.decode(ids)；"
          f"合法文本从未输出 U+FFFD\n/ {streams} streams, {tokens} tokens: every push and flush matches the reference, "
          f"the concatenation equals tokenizer.decode(ids), and valid text never showed U+FFFD")
    if show:
        ids = list("好🙂".encode("utf-8"))
        det = detokenizer_cls(tok)
        pieces = [det.push(i) for i in ids] + [det.flush()]
        naive = [tok.decode([i]) for i in ids]
        print("逐字节喂入 / fed byte by byte:", tok.decode(ids))
        print("  naive decode per token:", naive)
        print("  your push/flush       :", pieces)
