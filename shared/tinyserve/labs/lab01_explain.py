"""Lab 01: judge one step of the student's scheduler, and say what went wrong.

``plan_step`` calls the student's ``continuous_step`` and checks that its plan
is well formed and within the limits (seats, token budget, KV blocks);
``explain_plan`` names the rule behind the first difference from the engine's
plan; ``retire_step`` calls ``retire`` and checks what it did. Each raises
``AssertionError`` with a hint in Chinese and English.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyserve.kv_cache import blocks_for
from tinyserve.labs.hints import at_step, call, fail
from tinyserve.labs.lab01_trace import is_finished
from tinyserve.request import Request


def _student_call(fn, name, step, *args):
    """``fn(*args)``, a function of the student's, at ``step``; what it raises becomes a hint."""
    return call(fn, name, *args, where=at_step(step), explain=_out_of_blocks)


def _out_of_blocks(name, error):
    if isinstance(error, RuntimeError) and "out of KV blocks" in str(error):
        return (f"{name} 分配块时块不够用了（{error}）。接纳请求之前先用 "
                "block_manager.can_allocate(request_id, num_tokens) 检查空闲块，放不下就停止接纳",
                f"{name} ran out of KV blocks while allocating ({error}). Before admitting a request, "
                "check block_manager.can_allocate(request_id, num_tokens); stop admitting when it is False")
    return None


def plan_step(step_fn, who, step, running, waiting, bm, config, requests):
    """Call the student's ``step_fn`` (``who`` in the hints) and check its plan; return (plan, state before)."""
    before = _snapshot(running, waiting, bm)
    plan = _student_call(step_fn, who, step, running, waiting, bm, config)
    _validate_plan(plan, running, bm, config, step, before, requests)
    return plan, before


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
    """Raise unless ``plan`` is a list of (Request, n) that fits the step's seats, budget and blocks."""
    where = at_step(step)
    if not isinstance(plan, (list, tuple)):
        fail(f"continuous_step 应返回 [(request, num_new_tokens), ...] 列表，而它返回了 {type(plan).__name__}",
             f"continuous_step must return a list of (request, num_new_tokens), got {type(plan).__name__}", where)
    seen = set()
    for item in plan:
        _check_entry(item, seen, running, before, requests, where)
    _check_limits(plan, running, bm, config, before, requests, where)


def _check_entry(item, seen, running, before: Snapshot, requests, where):
    """One (Request, n) of a plan: a request of the workload, planned once, for 1 to tokens-left tokens."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Request)
            and isinstance(item[1], int) and not isinstance(item[1], bool)):
        fail(f"计划里的每一项应是 (Request, int)，而你返回了 {item!r}",
             f"each plan entry must be a (Request, int) pair, got {item!r}", where)
    r, n = item
    rid = r.request_id
    if rid in seen:
        fail(f"请求 {rid} 在计划里出现了两次", f"request {rid} appears twice in the plan", where)
    seen.add(rid)
    if rid not in requests or requests[rid] is not r:
        fail(f"计划里的请求 {rid} 不是这次负载里的请求对象",
             f"request {rid} in the plan is not one of this workload's requests", where)
    if rid not in before.left:
        fail(f"请求 {rid} 这一步之前既不在 running 也不在 waiting 中（已经完成，或还没到达），不能进入计划",
             f"request {rid} was neither running nor waiting before this step (finished, or not arrived yet): "
             "it cannot be planned", where)
    if n < 1:
        fail(f"请求 {rid} 被安排了 {n} 个 token：进入计划的请求至少要算 1 个 token，没事可做就不要放进计划",
             f"request {rid} is planned for {n} tokens: a planned request computes at least 1 token; leave it out otherwise",
             where)
    if n > before.left[rid]:
        fail(f"请求 {rid} 只剩 {before.left[rid]} 个 token 没算，你却安排了 {n} 个",
             f"request {rid} has only {before.left[rid]} tokens left to compute, you planned {n}", where)
    if r not in running:
        fail(f"请求 {rid} 在计划里，但不在 running 中：接纳的请求要 append 到 running（并从 waiting 里取出）",
             f"request {rid} is planned but not in running: append admitted requests to running (and take them out of waiting)",
             where)


def _check_limits(plan, running, bm, config, before: Snapshot, requests, where):
    """The plan as a whole: counts untouched, seats, token budget, blocks allocated."""
    for rid, computed in before.computed.items():
        if requests[rid].num_computed_tokens != computed:
            fail(f"请求 {rid} 的 num_computed_tokens 被改了（{computed} → {requests[rid].num_computed_tokens}）："
                 "调度器只做计划和分配块，这个计数由执行完这一步之后的代码更新",
                 f"request {rid}'s num_computed_tokens changed ({computed} -> {requests[rid].num_computed_tokens}): "
                 "the scheduler only plans and allocates; the count is updated after the step runs", where)
    if len(running) > config.max_num_seqs:
        fail(f"running 里有 {len(running)} 个请求，超过了座位数 max_num_seqs={config.max_num_seqs}：座位满了就不能再接纳",
             f"running holds {len(running)} requests, more than max_num_seqs={config.max_num_seqs}: "
             "do not admit when every seat is taken", where)
    total = sum(n for _, n in plan)
    if total > config.max_num_batched_tokens:
        fail(f"这一步共安排了 {total} 个 token，超过了 token 预算 max_num_batched_tokens="
             f"{config.max_num_batched_tokens}：每个请求最多拿 min(剩余 token, 剩余预算)，预算用完就停",
             f"the step plans {total} tokens, more than the token budget max_num_batched_tokens="
             f"{config.max_num_batched_tokens}: give each request min(tokens left, budget left) and stop at 0", where)
    for r, n in plan:
        need = blocks_for(r.num_computed_tokens + n, config.block_size)
        have = len(bm.block_table(r.request_id))
        if have < need:
            fail(f"请求 {r.request_id} 这一步要写到第 {r.num_computed_tokens + n} 个 token，需要 {need} 个块，"
                 f"却只有 {have} 个：调用 block_manager.allocate(request_id, num_computed_tokens + n)",
                 f"request {r.request_id} computes up to token {r.num_computed_tokens + n} and needs {need} blocks "
                 f"but holds {have}: call block_manager.allocate(request_id, num_computed_tokens + n)", where)


def explain_plan(got, want, before: Snapshot, config, step):
    """Raise with the reason for the first difference between two plans of (id, n)."""
    where = at_step(step)
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
            _wrong_running_entry(i, g, e, got, want, before, budget, where)
        if e is None:        # the student admitted one more than the engine
            _admitted_too_many(g[0], want, before, config, seats, budget, free, where)
        if g is None or (g[0] != e[0] and e[0] not in before.running):
            _wrong_admission(g, e, before, config, seats, budget, free, where)
        _wrong_chunk(g, e, before, budget, where)
    fail(f"计划应为 {want}，你的是 {got}", f"expected plan {want}, got {got}", where)


def _wrong_running_entry(i, g, e, got, want, before: Snapshot, budget, where):
    """Entry ``i`` of the engine's plan, ``e``, continues a running request; the student's ``g`` differs."""
    rid, n = e
    if g is not None and g[0] == rid:
        fail(f"正在运行的请求 {rid} 还剩 {before.left[rid]} 个 token、预算还剩 {budget}，"
             f"应安排 min({before.left[rid]}, {budget}) = {n} 个 token，你安排了 {g[1]} 个",
             f"running request {rid} has {before.left[rid]} tokens left and {budget} budget is left: "
             f"plan min({before.left[rid]}, {budget}) = {n} tokens, you planned {g[1]}", where)
    fail(f"正在运行的请求 {rid} 应排在计划的第 {i + 1} 位（预算还剩 {budget}）。规则：先按 running 的顺序"
         f"给在跑的请求排 token，再接纳新请求；你的计划是 {got}，应为 {want}",
         f"running request {rid} should be entry {i + 1} of the plan ({budget} budget left). Rule: running "
         f"requests first, in running order, then admissions; your plan is {got}, expected {want}", where)


def _admitted_too_many(rid, want, before: Snapshot, config, seats, budget, free, where):
    """The student admitted ``rid`` after the engine had stopped admitting: which limit stopped it."""
    admitted = len([x for x in want if x[0] not in before.running])
    head = before.waiting[admitted] if admitted < len(before.waiting) else None
    if seats >= config.max_num_seqs:
        fail(f"接纳了请求 {rid}，但座位已满（{seats}/{config.max_num_seqs}，max_num_seqs）",
             f"admitted request {rid} but every seat was taken ({seats}/{config.max_num_seqs}, max_num_seqs)", where)
    if budget <= 0:
        fail(f"接纳了请求 {rid}，但这一步的 token 预算（max_num_batched_tokens={config.max_num_batched_tokens}）已经用完",
             f"admitted request {rid} but the step's token budget (max_num_batched_tokens="
             f"{config.max_num_batched_tokens}) was used up", where)
    if head is not None and rid != head:
        fail(f"接纳了请求 {rid}，但队头是请求 {head}，而它放不下。先来先服务：队头放不下就停止接纳，不要跳过它",
             f"admitted request {rid} while the head of the queue, request {head}, did not fit. First come, "
             f"first served: stop admitting at the first request that does not fit; never skip it", where)
    n_head = min(before.left[rid], budget)
    need = blocks_for(before.computed[rid] + n_head, config.block_size) - before.tables[rid]
    fail(f"接纳了请求 {rid}，但它的前 {n_head} 个 token 需要 {need} 个新块，只剩 {free} 个空闲块："
         "接纳前用 block_manager.can_allocate 检查，放不下就停止接纳",
         f"admitted request {rid}, but its first {n_head} tokens need {need} new blocks and only {free} are "
         "free: check block_manager.can_allocate before admitting and stop when it is False", where)


def _wrong_admission(g, e, before: Snapshot, config, seats, budget, free, where):
    """The engine admitted ``e``; the student admitted another request, or stopped."""
    rid, n = e
    if g is not None and g[0] not in before.running and g[0] in before.waiting:
        fail(f"应接纳队头的请求 {rid}，你接纳了请求 {g[0]}：按 waiting 的顺序（先来先服务）从队头取",
             f"the head of the queue, request {rid}, should be admitted, you admitted request {g[0]}: "
             "take requests from the head of waiting (first come, first served)", where)
    fail(f"请求 {rid} 本该被接纳：还有空座位（{seats}/{config.max_num_seqs}）、预算 {budget} 个 token、"
         f"{free} 个空闲块，足够它的前 {n} 个 token。只要三者都够，就继续从队头接纳",
         f"request {rid} should have been admitted: a seat was free ({seats}/{config.max_num_seqs}), "
         f"{budget} budget tokens and {free} free blocks were left, enough for its first {n} tokens. "
         "Keep admitting from the head of waiting while all three allow", where)


def _wrong_chunk(g, e, before: Snapshot, budget, where):
    """The engine and the student admitted the same request, with different chunks."""
    rid, n = e
    fail(f"新接纳的请求 {rid} 还剩 {before.left[rid]} 个 token、预算还剩 {budget}，应安排 min(...) = {n} 个，"
         f"你安排了 {g[1]} 个（预算不够时只预填充一部分：分块预填充）",
         f"newly admitted request {rid} has {before.left[rid]} tokens left and {budget} budget left: plan "
         f"min(...) = {n} tokens, you planned {g[1]} (when the budget is short, prefill only a chunk)", where)


def retire_step(retire, running, bm, cfg, step, expected_ids=None):
    """Call the student's ``retire`` on ``running`` and judge what it did."""
    before = list(running)
    held = {r.request_id: len(bm.block_table(r.request_id)) for r in before}
    free_before = bm.num_free_blocks
    out = _student_call(retire, "retire", step, running, bm, cfg)
    _check_retire_result(out, before, running, bm, cfg, step, held, free_before, expected_ids)


def _why_finished(request: Request) -> str:
    if request.output_token_ids and request.output_token_ids[-1] == request.eos_token_id \
            and not request.sampling_params.ignore_eos:
        return "生成了结束符 EOS / it emitted EOS"
    return (f"已生成 max_tokens={request.sampling_params.max_tokens} 个 token "
            f"/ it reached max_tokens={request.sampling_params.max_tokens}")


def _check_retire_result(out, before, running, bm, cfg, step, held, free_before, expected_ids=None):
    """Judge one call of ``retire``: ``before`` is ``running`` before it, ``held`` the blocks each
    request held then, ``expected_ids`` the requests the engine retired (when known)."""
    where = at_step(step)
    if not isinstance(out, (list, tuple)):
        fail(f"retire 应返回刚退出的请求列表，而它返回了 {type(out).__name__}",
             f"retire must return the list of requests it retired, got {type(out).__name__}", where)
    finished = [r for r in before if is_finished(r, cfg)]
    if expected_ids is not None:
        assert [r.request_id for r in finished] == list(expected_ids), "internal: harness out of sync with the engine"
    for r in finished:
        if r in running:
            fail(f"请求 {r.request_id} 已生成完毕（{_why_finished(r)}）但仍在 running 中——完成的请求要在这一步就退出并释放块（原地从列表中移除：running.remove(request)）",
                 f"request {r.request_id} finished ({_why_finished(r).split(' / ')[1]}) but is still in running — "
                 "retire finished requests and free their blocks (remove them from the list in place: running.remove(request))",
                 where)
        if bm.block_table(r.request_id):
            fail(f"请求 {r.request_id} 已退出，但它的 {held[r.request_id]} 个 KV 块没有归还："
                 "调用 block_manager.free(request.request_id)",
                 f"request {r.request_id} was retired but its {held[r.request_id]} KV blocks were not freed: "
                 "call block_manager.free(request.request_id)", where)
    for r in before:
        if r not in finished and r not in running:
            done = len(r.output_token_ids)
            fail(f"请求 {r.request_id} 还没完成（已生成 {done}/{r.sampling_params.max_tokens} 个 token）却被移出了 running",
                 f"request {r.request_id} is not finished ({done}/{r.sampling_params.max_tokens} tokens) "
                 "but was taken out of running", where)
        if r not in finished and len(bm.block_table(r.request_id)) != held[r.request_id]:
            fail(f"请求 {r.request_id} 还在运行，它的块却被释放了：只释放退出请求的块",
                 f"request {r.request_id} is still running but its blocks were freed: free only retired requests' blocks",
                 where)
    if list(running) != [r for r in before if r not in finished]:
        fail(f"留下的请求要保持原来的顺序：应为 {[r.request_id for r in before if r not in finished]}，"
             f"实际是 {[r.request_id for r in running]}（调度器按这个顺序分配预算；原地修改 running，不要新建列表）",
             f"keep the remaining requests in their order: expected {[r.request_id for r in before if r not in finished]}, "
             f"got {[r.request_id for r in running]} (the budget is handed out in this order; change running in place)",
             where)
    if [getattr(r, "request_id", r) for r in out] != [r.request_id for r in finished]:
        fail(f"retire 应返回刚退出的请求 {[r.request_id for r in finished]}（按它们在 running 中的顺序），"
             f"你返回了 {[getattr(r, 'request_id', r) for r in out]}",
             f"retire must return the requests it retired, {[r.request_id for r in finished]} (in running order), "
             f"got {[getattr(r, 'request_id', r) for r in out]}", where)
    freed = sum(held[r.request_id] for r in finished)
    if bm.num_free_blocks != free_before + freed:
        fail(f"退出请求共持有 {freed} 个块，空闲块应从 {free_before} 变为 {free_before + freed}，实际是 {bm.num_free_blocks}",
             f"the retired requests held {freed} blocks: free blocks should go from {free_before} to "
             f"{free_before + freed}, got {bm.num_free_blocks}", where)
    bm.check_integrity()
