"""Checks for lab 05 (see solutions/lab05_priority_aging.ipynb): priority with aging.

The student writes a ``tinyserve.policies.Policy`` subclass whose
``choose(waiting, now, running)`` returns the index of the request to admit
next: the smallest ``priority - aging * (now - arrival_time)``, ties to the
earlier position. The checks call it directly on hand-built queues and run it
inside the real scheduler through ``tinyserve.sim.simulate``, comparing with
``tinyserve.policies.PriorityPolicy``. Each failure raises ``AssertionError``
with a hint in Chinese and English.
"""

from __future__ import annotations

import random

from tinyserve.labs.hints import call, fail
from tinyserve.request import Request, SamplingParams
from tinyserve.policies import Policy, PriorityPolicy
from tinyserve.workload import RequestSpec, make_workload
from tinyserve.book.plots.common import SMALL, TITLE

__all__ = ["check_aging_argument", "check_priority_choice", "check_equal_priorities_is_fcfs",
           "check_bounded_starvation"]


def _build(policy_cls, aging):
    policy = call(policy_cls, f"{policy_cls.__name__}(aging={aging!r})", aging=aging,
                  let_through=(NotImplementedError,))
    if not isinstance(policy, Policy):
        fail(f"{policy_cls.__name__} 要继承 tinyserve.policies.Policy，调度器才能用它（class X(Policy): ...）",
             f"{policy_cls.__name__} must subclass tinyserve.policies.Policy for the scheduler to use it")
    return policy


# ---- (d) the argument -----------------------------------------------------------------

def check_aging_argument(policy_cls):
    """``aging`` < 0 raises ValueError naming the field; 0 and positive rates are accepted."""
    for aging in (0, 0.0, 2.5):
        _build(policy_cls, aging)
    for aging in (-1, -0.001):
        try:
            policy_cls(aging=aging)
        except ValueError as e:
            if "aging" not in str(e):
                fail(f"aging={aging} 抛出了 ValueError，但信息里没有写出参数名：{e!r}。写成例如 "
                     f"ValueError(f\"aging must be >= 0, got {{aging!r}}\")",
                     f"aging={aging} raised ValueError, but the message does not name the field: {e!r}. "
                     f"Write e.g. ValueError(f\"aging must be >= 0, got {{aging!r}}\")")
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            fail(f"aging={aging} 应该抛出 ValueError，实际抛出了 {type(e).__name__}: {e}",
                 f"aging={aging} should raise ValueError, got {type(e).__name__}: {e}")
        fail(f"aging={aging} 被接受了。负的老化速度会让等得越久的请求越靠后——饥饿反而更严重。在 __init__ 里检查并抛出 "
             f"ValueError（信息里写出 aging）",
             f"aging={aging} was accepted. A negative aging rate pushes a request further back the "
             f"longer it waits, making starvation worse. Check it in __init__ and raise ValueError "
             f"(naming aging)")
    print("✓ aging < 0 被拒绝（ValueError），0 与正数可以 / negative aging rejected with ValueError; "
          "0 and positive rates accepted")


# ---- (b) one choice at a time -----------------------------------------------------------

def _request(rid, arrival, priority, prompt_len=8):
    return Request(str(rid), [5] * prompt_len, SamplingParams(max_tokens=4), arrival_time=arrival,
                   priority=priority)


def _effective(r, now, aging):
    return r.priority - aging * (now - r.arrival_time)


def _choice_cases():
    """(label, waiting, now, aging): hand-made cases first, then seeded random queues."""
    cases = [
        ("lower value first", [_request(0, 0.0, 3), _request(1, 0.1, 1), _request(2, 0.2, 2)], 0.2, 0.0),
        ("ties in arrival order", [_request(0, 0.0, 1), _request(1, 0.5, 1), _request(2, 1.0, 1)], 2.0, 0.0),
        ("aging lets an old request through", [_request(0, 0.0, 5), _request(1, 9.0, 0)], 10.0, 1.0),
        ("aging is not enough yet", [_request(0, 0.0, 5), _request(1, 3.0, 0)], 4.0, 1.0),
        ("equal priorities: the oldest", [_request(0, 1.0, 0), _request(1, 2.0, 0), _request(2, 2.5, 0)], 3.0, 2.0),
        ("a single request", [_request(0, 0.0, 7)], 1.0, 1.0),
    ]
    rng = random.Random(5)
    for k in range(300):
        n = rng.randint(2, 9)
        arrivals = sorted(round(rng.uniform(0, 20), 1) for _ in range(n))   # queue order = arrival order
        waiting = [_request(i, a, rng.randint(0, 4)) for i, a in enumerate(arrivals)]
        now = arrivals[-1] + rng.choice([0.0, 0.5, 3.0])
        cases.append((f"random queue #{k}", waiting, now, rng.choice([0.0, 0.25, 1.0, 4.0])))
    return cases


def _wrong_rules():
    """Typical mistakes, each as a function (waiting, now, aging) -> index, with its hint.
    (priority + aging * waited and priority - aging * arrival_time order a queue the same
    way, as they differ by aging * now, so one hint covers both.)"""
    def by(key, ties_last=False):
        def rule(waiting, now, aging):
            keys = [key(r, now, aging) for r in waiting]
            best = min(keys)
            tied = [i for i, k in enumerate(keys) if k == best]
            return tied[-1] if ties_last else tied[0]
        return rule
    return [
        (by(lambda r, now, a: -(r.priority - a * (now - r.arrival_time))),
         "优先级是“数值越小越先”（0 最急），你选了数值大的",
         "priority: a lower value goes first (0 is the most urgent); you picked a higher value"),
        (by(lambda r, now, a: r.priority + a * (now - r.arrival_time)),
         "老化的方向反了：等得越久，有效优先级的数值应该越**小**，即 priority - aging * (now - arrival_time)。"
         "你要么用了加号，要么用了到达时间本身（priority - aging * arrival_time，它偏向**后**到的请求）",
         "aging has the wrong sign: the longer a request waits, the *smaller* its effective value, "
         "priority - aging * (now - arrival_time). You either added it, or used the arrival time "
         "itself (priority - aging * arrival_time, which favours *later* arrivals)"),
        (by(lambda r, now, a: r.priority),
         "你忽略了老化：只比较了 priority。有效优先级是 priority - aging * (now - arrival_time)",
         "you ignored aging and compared priority only; the effective value is "
         "priority - aging * (now - arrival_time)"),
        (by(lambda r, now, a: r.priority - a * (now - r.arrival_time), ties_last=True),
         "有效优先级相同的请求要按到达顺序：选最靠前的那个。比较时用严格的 <，或者 "
         "min(range(len(waiting)), key=...)，它也会把并列交给第一个",
         "requests with equal effective priority go in arrival order: pick the first. Compare "
         "with a strict <, or use min(range(len(waiting)), key=...), which also gives ties to the first"),
    ]


def _diagnose_choice(answers):
    """The hint of the one typical mistake that reproduces every answer the student gave."""
    for rule, zh, en in _wrong_rules():
        if all(rule(waiting, now, aging) == got for (_, waiting, now, aging), got in answers):
            return zh, en
    return ("有效优先级 = priority - aging * (now - arrival_time)，选它最小的；并列选最靠前的",
            "effective priority = priority - aging * (now - arrival_time); pick the smallest, ties to "
            "the first")


def check_priority_choice(policy_cls):
    """Direct calls of ``choose`` on hand-made and random queues, against PriorityPolicy."""
    cases = _choice_cases()
    answers = []
    for case in cases:
        label, waiting, now, aging = case
        policy = _build(policy_cls, aging)
        got = call(policy.choose, "choose", list(waiting), now, [], where=(f"[{label}] ",) * 2,
                   let_through=(NotImplementedError,))
        if isinstance(got, Request):
            fail(f"[{label}] choose 返回了请求对象本身；它要返回这个请求在 waiting 里的**下标**（int），调度器用它 "
                 f"del waiting[index]",
                 f"[{label}] choose returned the Request itself; return its *index* in waiting (an int): "
                 f"the scheduler does del waiting[index] with it")
        if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got < len(waiting):
            fail(f"[{label}] choose 返回了 {got!r}；应返回 0 到 {len(waiting) - 1} 之间的整数下标",
                 f"[{label}] choose returned {got!r}; return an int index between 0 and {len(waiting) - 1}")
        answers.append((case, got))
    for (label, waiting, now, aging), got in answers:
        want = PriorityPolicy(aging=aging).choose(waiting, now, [])
        if got != want:
            table = ", ".join(f"#{i}: priority={r.priority} arrival={r.arrival_time:g} "
                              f"effective={_effective(r, now, aging):g}" for i, r in enumerate(waiting))
            zh, en = _diagnose_choice(answers)
            fail(f"[{label}] now={now:g}, aging={aging:g}，队列：{table}。你选了 #{got}，应选 #{want}。{zh}",
                 f"[{label}] now={now:g}, aging={aging:g}, queue: {table}. You chose #{got}, expected "
                 f"#{want}. {en}")
    print(f"✓ {len(cases)} 个队列上的选择都与参考实现一致（数值小者先、老化、并列按到达顺序、返回下标）\n"
          f"/ every choice on {len(cases)} queues matches the reference (lower value first, "
          f"aging, ties in arrival order, an index returned)")


# ---- (a) inside the scheduler: equal priorities are FCFS ---------------------------------

# Small engine settings so that the queue, the token budget and preemption all bind.
FCFS_RUNS = (
    dict(name="mixed", num_requests=150, rate=40.0, seed=1, engine=dict(max_num_seqs=16)),
    dict(name="long-in-short-out", num_requests=60, rate=20.0, seed=2,
         engine=dict(max_num_seqs=8, max_num_batched_tokens=512)),
    dict(name="mixed", num_requests=120, rate=float("inf"), seed=3,
         engine=dict(max_num_seqs=32, num_kv_blocks=400)),
)


def _simulate(specs, policy, **engine):
    from tinyserve.sim import simulate
    return call(simulate, "simulate", specs, policy=policy, record_batches=True, **engine,
                let_through=(NotImplementedError,), explain=_in_scheduler)


def _in_scheduler(name, error):
    return (f"把你的策略放进调度器运行时出错：{type(error).__name__}: {error}",
            f"running your policy inside the scheduler failed: {type(error).__name__}: {error}")


def check_equal_priorities_is_fcfs(policy_cls, agings=(0.0, 1.0, 50.0)):
    """With every priority equal, the real scheduler driven by the student's policy plans
    the very batches FCFS plans, step for step (queueing, token budget, preemption)."""
    steps = 0
    for run in FCFS_RUNS:
        specs = make_workload(run["name"], run["num_requests"], rate=run["rate"], seed=run["seed"])
        fcfs = _simulate(specs, "fcfs", **run["engine"])
        for aging in agings:
            result = _simulate(specs, _build(policy_cls, aging), **run["engine"])
            for k, (a, b) in enumerate(zip(result.steps, fcfs.steps)):
                if a.batch != b.batch:
                    got = [rid for rid, _ in a.batch]
                    want = [rid for rid, _ in b.batch]
                    extra = ""
                    if aging == 0:
                        extra = ("aging=0 时所有请求的有效优先级都相等，只剩并列规则起作用：要选最靠前（最早到）的那个。"
                                 , "with aging=0 every effective priority is equal and only the tie rule "
                                   "acts: pick the first (earliest) request.")
                    else:
                        extra = ("优先级相同时，等得最久的请求有效优先级最小，应最先被选中。", "with equal priorities "
                                 "the request that waited longest has the smallest effective value and must go first.")
                    fail(f"[{run['name']}, aging={aging:g}] 所有请求的 priority 都是 0，调度应与先来先服务完全一致，"
                         f"但第 {k} 步（t={a.start:.3f} s）的批不同：你的策略 {got[:12]}，FCFS {want[:12]}。{extra[0]}",
                         f"[{run['name']}, aging={aging:g}] every priority is 0, so scheduling must equal FCFS, "
                         f"but step {k} (t={a.start:.3f} s) differs: yours {got[:12]}, FCFS {want[:12]}. {extra[1]}")
            if len(result.steps) != len(fcfs.steps):
                fail(f"[{run['name']}, aging={aging:g}] 步数不同：你的 {len(result.steps)}，FCFS {len(fcfs.steps)}",
                     f"[{run['name']}, aging={aging:g}] step counts differ: yours {len(result.steps)}, "
                     f"FCFS {len(fcfs.steps)}")
            steps += len(result.steps)
    print(f"✓ 优先级全相同时，{len(FCFS_RUNS)} 个负载 × {len(agings)} 个老化速度、共 {steps} 步的批与先来先服务逐步相同"
          f"\n/ with equal priorities, {len(FCFS_RUNS)} workloads x {len(agings)} aging rates, {steps} steps: "
          f"every batch equals FCFS's")


# ---- (c) bounded starvation ------------------------------------------------------------

STARVATION = dict(rate=40.0, duration=25.0, low_priority=5, low_every=2.5, prompt_len=64, output_len=48,
                  engine=dict(max_num_seqs=8))


def starvation_workload(cfg=STARVATION) -> list[RequestSpec]:
    """A priority-0 stream above the engine's capacity, with a priority-``low_priority``
    request every ``low_every`` seconds."""
    rng = random.Random(7)
    specs, t = [], 0.0
    while t < cfg["duration"]:
        specs.append(RequestSpec(t, cfg["prompt_len"], cfg["output_len"], priority=0))
        t += rng.expovariate(cfg["rate"])
    k = 0
    while k * cfg["low_every"] + 0.05 < cfg["duration"]:
        specs.append(RequestSpec(k * cfg["low_every"] + 0.05, cfg["prompt_len"], cfg["output_len"],
                                 priority=cfg["low_priority"]))
        k += 1
    return sorted(specs, key=lambda s: s.arrival)


def starvation_report(result, aging, cfg=STARVATION):
    """Per low-priority request: (arrival, wait, bound) where the bound is p / aging plus the
    wait of the first priority-0 request that arrived p / aging seconds later (it cannot
    go first: its effective priority is never smaller)."""
    outs = list(result)
    stream = [(o.spec.arrival, o.metrics.first_scheduled_time) for o in outs if o.spec.priority == 0]
    rows = []
    for o in outs:
        if o.spec.priority == 0:
            continue
        m = o.metrics
        wait = (m.first_scheduled_time if m.first_scheduled_time is not None else float("inf")) - m.arrival_time
        bound = float("inf")
        if aging > 0:
            later = [s for a, s in stream if a >= o.spec.arrival + o.spec.priority / aging and s is not None]
            if later:
                bound = min(later) - o.spec.arrival
        rows.append((o.spec.arrival, wait, bound))
    return rows


def check_bounded_starvation(policy_cls, aging=1.0, plot=True):
    """Under a sustained priority-0 stream, priority-5 requests starve at aging=0 and are
    admitted within their predicted bound with aging > 0."""
    cfg = STARVATION
    specs = starvation_workload(cfg)
    starved = _simulate(specs, _build(policy_cls, 0.0), **cfg["engine"])
    aged = _simulate(specs, _build(policy_cls, aging), **cfg["engine"])
    reference = _simulate(specs, PriorityPolicy(aging=aging), **cfg["engine"])
    end_of_stream = max(s.arrival for s in specs if s.priority == 0)
    rows0 = starvation_report(starved, 0.0)
    rows = starvation_report(aged, aging)
    p = cfg["low_priority"]
    _check_starves_without_aging(starved, rows0, p)
    _check_within_bounds(rows, aging, p)
    got = [w for _, w, _ in rows]
    want = [w for _, w, _ in starvation_report(reference, aging)]
    if got != want:
        fail(f"aging={aging:g} 时 priority={p} 请求的等待时间与参考实现不同：你的 {[round(x, 2) for x in got]}，"
             f"参考 {[round(x, 2) for x in want]}",
             f"with aging={aging:g} the priority-{p} requests' waits differ from the reference: yours "
             f"{[round(x, 2) for x in got]}, reference {[round(x, 2) for x in want]}")
    max0 = max(w for _, w, _ in rows0)
    print(f"✓ priority={p} 的请求：aging=0 时最长等待 {max0:.1f} s（一直等到 priority=0 的请求流在 {end_of_stream:.1f} s 结束之后），"
          f"aging={aging:g} 时最长等待 {max(got):.1f} s，每一条都在预测的上界（p/aging = {p / aging:g} s + 那时 priority=0 "
          f"请求的排队时间）之内\n/ priority-{p} requests: max wait {max0:.1f} s at aging=0 (until the priority-0 "
          f"stream ends at {end_of_stream:.1f} s), {max(got):.1f} s at aging={aging:g}; each within its predicted "
          f"bound (p/aging = {p / aging:g} s + the priority-0 queueing delay then)")
    if plot:
        _plot_starvation(rows0, rows, aged, aging, p)
    return rows0, rows


def _check_starves_without_aging(starved, rows0, p):
    """aging = 0: a priority-``p`` request is admitted only when no priority-0 request is waiting."""
    stream = [(o.spec.arrival, o.metrics.first_scheduled_time) for o in starved if o.spec.priority == 0]
    for (a, w, _) in rows0:
        admitted = a + w
        jumped = [(ra, rs) for ra, rs in stream if ra <= admitted and (rs is None or rs > admitted)]
        if jumped:
            fail(f"aging=0 时，priority={p} 的请求（t={a:.2f} s 到达）在 {admitted:.2f} s 就被接纳了，可那时还有 "
                 f"{len(jumped)} 条 priority=0 的请求在排队（最早的 t={jumped[0][0]:.2f} s 到达）。没有老化时，数值大的请求要等"
                 f"所有数值小的请求都走完。检查 choose 是否真的按 priority 选、数值小的先",
                 f"with aging=0, a priority-{p} request (arrived t={a:.2f} s) was admitted at {admitted:.2f} s "
                 f"while {len(jumped)} priority-0 requests were queued (the first arrived t={jumped[0][0]:.2f} s). "
                 f"Without aging it must wait for every lower value; check that choose picks by priority, "
                 f"lower first")


def _check_within_bounds(rows, aging, p):
    """aging > 0: every priority-``p`` request is admitted within its predicted bound."""
    for (a, w, bound) in rows:
        if w > bound + 1e-9:
            fail(f"aging={aging:g} 时，priority={p} 的请求（t={a:.2f} s 到达）等了 {w:.2f} s，超过了上界 {bound:.2f} s"
                 f"（= 比它晚 p/aging = {p / aging:g} s 到达的第一个 priority=0 请求被接纳的时刻 − 它的到达时刻）："
                 f"那个请求的有效优先级不可能比它小，不该先走。检查老化的符号和“等待时间 = now - arrival_time”",
                 f"with aging={aging:g}, a priority-{p} request (arrived t={a:.2f} s) waited {w:.2f} s, more than "
                 f"its bound {bound:.2f} s (when the first priority-0 request arriving p/aging = {p / aging:g} s "
                 f"later was admitted, minus its arrival): that request never has a smaller effective priority "
                 f"and must not go first. Check the sign of aging and waited = now - arrival_time")


def _plot_starvation(rows0, rows, aged, aging, p):
    """The priority-``p`` requests' waits at aging 0 and ``aging``, the bound, the priority-0 waits."""
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=(5.5, 3.3))
    ax.plot([a for a, _, _ in rows0], [w for _, w, _ in rows0], "o-", color="C3", label="aging = 0 (starves)")
    ax.plot([a for a, _, _ in rows], [w for _, w, _ in rows], "s-", color="C0", label=f"aging = {aging:g}")
    ax.plot([a for a, _, _ in rows], [b for _, _, b in rows], "--", color="C0", alpha=0.6,
            label="predicted bound")
    stream = [(o.spec.arrival, o.metrics.queue_time) for o in aged if o.spec.priority == 0]
    ax.plot(*zip(*stream), ".", color="gray", ms=2, alpha=0.5, label="priority-0 waits")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("queue wait (s)")
    ax.set_title(f"Priority-{p} requests behind a priority-0 stream", fontsize=TITLE)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=SMALL)
    plt.show()
