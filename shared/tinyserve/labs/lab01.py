"""Checks for lab 01 (continuous batching), which the notebook calls as
``from tinyserve.labs import check_...``.

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
preemption: every workload here is chosen so that the engine never preempts
(``tinyserve.labs.lab01_trace``); ``tinyserve.labs.lab01_explain`` turns a wrong
step into a hint.
"""

from __future__ import annotations

import random
from collections import deque

from tinyserve.kv_cache import BlockManager
from tinyserve.labs.hints import at_step, fail
from tinyserve.labs.lab01_explain import explain_plan, plan_step, retire_step
from tinyserve.labs.lab01_trace import (EOS, Trace, Workload, engine_trace, fake_token, replayed_retire,
                                        replayed_step, workloads)
from tinyserve.request import Request, SamplingParams
from tinyserve.scheduler import ScheduledRequest, SchedulerConfig, SchedulerOutput

__all__ = ["check_retire", "check_continuous_step", "check_end_to_end"]


# ---- the student's side, step by step -----------------------------------------------

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
        retire_step(retire, running, bm, cfg, step, prev_finished)
        if not (pending or running or waiting):
            break
        if step >= len(trace.steps):
            left = [r.request_id for r in running] + [r.request_id for r in waiting]
            fail(f"引擎在 {len(trace.steps)} 步内已经做完，你的调度器还剩请求 {left} 没完成"
                 "（完成的请求有没有退出？等待的请求有没有被接纳？）",
                 f"the engine finished in {len(trace.steps)} steps, yours still has requests {left} "
                 "(are finished requests retired? are waiting ones admitted?)", at_step(step))
        plan, before = plan_step(step_fn, who, step, running, waiting, bm, cfg, requests)
        record = trace.steps[step]
        got = [(r.request_id, n) for r, n in plan]
        if got != record.plan:
            explain_plan(got, record.plan, before, cfg, step)
        _check_after_plan(running, waiting, bm, record, at_step(step))
        _apply(plan, step, specs)
        prev_finished = record.finished
        step += 1
    # The engine retired the last requests at the end of its last step.
    if step != len(trace.steps):
        fail(f"你的调度器在 {step} 步后停下，引擎用了 {len(trace.steps)} 步",
             f"your scheduler stopped after {step} steps, the engine took {len(trace.steps)}", at_step(step))
    outputs = {rid: r.output_token_ids for rid, r in requests.items()}
    if outputs != trace.outputs:
        fail("输出的 token 与引擎不同", "output tokens differ from the engine's")
    _check_all_returned(bm, w.num_blocks)
    return step


def _check_after_plan(running, waiting, bm, record, where):
    """With the right plan, the queues and the free blocks must also be the engine's."""
    if [r.request_id for r in running] != record.running:
        fail(f"计划正确，但 running 变成了 {[r.request_id for r in running]}，应为 {record.running}："
             "新接纳的请求 append 到 running 末尾，并从 waiting 队头 popleft",
             f"the plan is right but running is {[r.request_id for r in running]}, expected {record.running}: "
             "append admitted requests to the end of running and popleft them from waiting", where)
    if [r.request_id for r in waiting] != record.waiting:
        fail(f"计划正确，但 waiting 变成了 {[r.request_id for r in waiting]}，应为 {record.waiting}",
             f"the plan is right but waiting is {[r.request_id for r in waiting]}, expected {record.waiting}",
             where)
    if bm.num_free_blocks != record.free_blocks:
        fail(f"计划正确，但空闲块有 {bm.num_free_blocks} 个，应为 {record.free_blocks} 个："
             "只为计划里的 token 分配块（allocate 到 num_computed_tokens + n），不要多分",
             f"the plan is right but {bm.num_free_blocks} blocks are free, expected {record.free_blocks}: "
             "allocate blocks for the planned tokens only (up to num_computed_tokens + n)", where)


def _check_all_returned(bm, num_blocks):
    bm.check_integrity()
    if bm.num_free_blocks != num_blocks:
        fail(f"全部请求完成后还有 {num_blocks - bm.num_free_blocks} 个块没有归还",
             f"{num_blocks - bm.num_free_blocks} blocks are still held after every request finished")


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
        retire_step(retire, running, bm, cfg, None)


def check_retire(retire):
    """Check ``retire(running, block_manager, config) -> list[Request]``."""
    _unit_retire_cases(retire)
    ws = workloads()
    for w in ws:
        trace = engine_trace(w)
        drive(w, retire, replayed_step(trace), trace, who="continuous_step (the engine's, replayed)")
    print(f"✓ retire 通过：手工用例 + {len(ws)} 个随机负载，与引擎逐步一致 "
          f"/ retire passed hand-made cases and {len(ws)} random workloads")


def _queues(bm, running_specs, waiting_specs):
    """(running, waiting) of a hand-made case, with the running requests' blocks allocated in ``bm``."""
    running, waiting = [], deque()
    for rid, prompt, computed, outputs in running_specs:
        r = Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=50), 0.0, eos_token_id=EOS)
        r.output_token_ids = list(outputs)
        r.num_computed_tokens = computed
        bm.allocate(rid, computed)
        running.append(r)
    for rid, prompt in waiting_specs:
        waiting.append(Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=50), 0.0,
                               eos_token_id=EOS))
    return running, waiting


def _step_case(step_fn, name, config, num_blocks, running_specs, waiting_specs, want, want_queues, want_free):
    """One hand-made step: the student's plan, queues and free blocks against the ones worked out by hand."""
    bm = BlockManager(num_blocks, config.block_size)
    running, waiting = _queues(bm, running_specs, waiting_specs)
    requests = {r.request_id: r for r in list(running) + list(waiting)}
    plan, before = plan_step(step_fn, "continuous_step", None, running, waiting, bm, config, requests)
    got = [(r.request_id, n) for r, n in plan]
    if got != want:
        try:
            explain_plan(got, want, before, config, None)
        except AssertionError as e:
            raise AssertionError(f"[{name}] {e}") from None
    queues = ([r.request_id for r in running], [r.request_id for r in waiting])
    if queues != want_queues:
        fail(f"[{name}] 计划正确，但 running/waiting 不对：应为 {want_queues[0]} / {want_queues[1]}",
             f"[{name}] the plan is right but running/waiting are wrong: expected "
             f"{want_queues[0]} / {want_queues[1]}")
    if bm.num_free_blocks != want_free:
        fail(f"[{name}] 空闲块 {bm.num_free_blocks} 个，应为 {want_free} 个",
             f"[{name}] {bm.num_free_blocks} free blocks, expected {want_free}")


def _unit_step_cases(step_fn):
    """Small situations where one limit decides, with a targeted hint each; the expected step
    is worked out by hand in the comment (block_size 4 unless said)."""
    cfg = lambda seats, budget, bs=4: SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget, block_size=bs)
    # Seats: two decoding (1 token each, 2 blocks each), room for one more: "2" prefills 4 tokens
    # in 1 block; 64 - 5 = 59 blocks left, "3" waits for a seat.
    _step_case(step_fn, "seats", cfg(3, 100), 64, [("0", 5, 5, [11]), ("1", 6, 6, [11])], [("2", 4), ("3", 4)],
               [("0", 1), ("1", 1), ("2", 4)], (["0", "1", "2"], ["3"]), 59)
    # Budget 16: "0" prefills 10 (3 blocks), "1" only gets a 6-token chunk (2 blocks), "2" nothing.
    _step_case(step_fn, "budget", cfg(8, 16), 64, [], [("0", 10), ("1", 10), ("2", 10)],
               [("0", 10), ("1", 6)], (["0", "1"], ["2"]), 59)
    # Running first, budget 14: the half-prefilled "0" continues with its 12 tokens (5 blocks), "1"
    # decodes (2 blocks), and the 1 token left admits "2" with a 1-token chunk (1 block).
    _step_case(step_fn, "running first", cfg(8, 14), 64, [("0", 20, 8, []), ("1", 5, 5, [11])], [("2", 6)],
               [("0", 12), ("1", 1), ("2", 1)], (["0", "1", "2"], []), 56)
    # Blocks: "0" holds 2 of the 4 blocks; the head "1" needs 3 for its 10 tokens, only 2 are free,
    # so it waits, and "2" (which would fit) must wait behind it.
    _step_case(step_fn, "blocks (FCFS)", cfg(8, 64), 4, [("0", 7, 7, [11])], [("1", 10), ("2", 3)],
               [("0", 1)], (["0"], ["1", "2"]), 2)


def check_continuous_step(continuous_step):
    """Check ``continuous_step(running, waiting, block_manager, config) -> [(Request, n)]``."""
    _unit_step_cases(continuous_step)
    ws = workloads()
    steps = 0
    for w in ws:
        trace = engine_trace(w)
        steps += drive(w, replayed_retire(trace), continuous_step, trace)
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
            fail("运行了太多步还没结束：完成的请求有没有退出？等待的请求有没有被接纳？",
                 "too many steps without finishing: are finished requests retired? are waiting ones admitted?",
                 at_step(step))
        retire_step(retire, running, bm, cfg, step)
        if not (waiting or running):
            break
        plan, _ = plan_step(continuous_step, "continuous_step", step, running, waiting, bm, cfg, by_id)
        if not plan:
            fail("还有请求没完成，continuous_step 却返回了空计划（死锁）",
                 "requests remain but continuous_step planned nothing (deadlock)", at_step(step))
        got = [(r.request_id, n) for r, n in plan]
        if engine_stats is not None:
            want = [tuple(x) for x in engine_stats[step].batch] if step < len(engine_stats) else []
            if got != want:
                fail(f"与引擎不同：引擎这一步的批是 {want}，你的是 {got}（先运行前面的 check 找出原因）",
                     f"differs from the engine: its batch this step is {want}, yours is {got} "
                     "(run the earlier checks to find out why)", at_step(step))
        items = [ScheduledRequest(r, n, list(bm.block_table(r.request_id)),
                                  samples=n == r.num_tokens - r.num_computed_tokens) for r, n in plan]
        sampled = executor.execute(SchedulerOutput(scheduled=items))
        held.append(bm.num_used_blocks)
        _apply(plan, step, None, sample=sampled)
        batches.append(got)
    _check_all_returned(bm, num_blocks)
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
            fail(f"请求 {i} 的输出与 LLM.generate 不同：{got[:8]}… vs {want[:8]}…",
                 f"request {i}'s output differs from LLM.generate: {got[:8]}… vs {want[:8]}…")
    if len(batches) != len(stats):
        fail(f"你的调度器用了 {len(batches)} 步，引擎用了 {len(stats)} 步",
             f"your scheduler took {len(batches)} steps, the engine {len(stats)}")
    if plot:
        _plot_run(batches, held, config)
    print(f"✓ 端到端通过：{len(prompts)} 个请求在 tiny 模型上 {len(batches)} 步完成，输出与 LLM.generate 逐 token 相同，"
          f"块全部归还 / end to end: same tokens as LLM.generate, same {len(batches)} steps, every block returned")
    return {"steps": len(batches), "batches": batches, "blocks_in_use": held}


def _plot_run(batches, held, config):
    """The student's batches as a Gantt chart, over the KV blocks they held."""
    import matplotlib.pyplot as plt

    from tinyserve.book import plots
    fig, axes = plt.subplots(2, 1, figsize=(10, 4), sharex=True)
    plots.gantt(batches, ax=axes[0], num_seats=config["max_num_seqs"], title="your continuous batching")
    axes[0].set_xlabel("")
    plots.kv_blocks_timeline({"your scheduler": held}, capacity=config["num_kv_blocks"], ax=axes[1])
    axes[1].set_xlim(0, len(batches))
    fig.tight_layout()
    plt.show()
