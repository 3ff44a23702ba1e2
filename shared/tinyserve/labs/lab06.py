"""Checks for lab 06 (see solutions/lab06_cache_aware_routing.ipynb): cache-aware routing.

The student writes two functions:

* ``is_imbalanced(outstanding, abs_threshold, rel_threshold) -> bool``: the
  load guard, ``max - min > abs_threshold and max > rel_threshold * min``;
* ``choose_replica(key, outstanding, trees, balance_abs_threshold=8,
  balance_rel_threshold=1.5, min_match_ratio=0.1) -> int``: the routing
  decision over one ``tinyserve.routing.PrefixTree`` per replica. Unless the
  fleet is imbalanced, the replica whose tree shares the longest prefix with
  ``key`` wins (equal matches: the less loaded; then the smaller index),
  provided the match covers at least ``min_match_ratio`` of the key; otherwise
  the least loaded replica (ties: the smaller index). The key is then recorded
  in the chosen replica's tree, and only there.

The checks call the functions on hand-made and random cases against the
package's own router rule (``tinyserve.routing.cache_aware_choice``, with
ties to the smaller index), then run ``choose_replica`` inside the cluster simulator
(``tinyserve.sim.cluster.simulate_cluster``) against round-robin on a
shared-prefix workload. Each failure raises ``AssertionError`` with a hint in
Chinese and English.
"""

from __future__ import annotations

import random

from tinyserve.labs.hints import call, fail
from tinyserve.routing import PrefixTree, RoutingPolicy, cache_aware_choice, imbalanced

__all__ = ["FunctionPolicy", "check_is_imbalanced", "check_choose_replica",
           "check_routing_in_simulator"]


def _call(fn, name, *args, **kwargs):
    """The student's ``fn(*args, **kwargs)``; when it raises, the hint shows the arguments."""
    return call(fn, f"{name}{_show_args(args)}", *args, **kwargs)


def _show_args(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, (tuple, list)) and len(a) > 8:
            parts.append(f"<{len(a)} items starting {tuple(a[:4])}...>")
        elif isinstance(a, list) and a and isinstance(a[0], PrefixTree):
            parts.append(f"<{len(a)} trees>")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


# ---- what is right: the package's own router -------------------------------------------

def _router_choice(key, outstanding, trees, balance_abs_threshold=8,
                   balance_rel_threshold=1.5, min_match_ratio=0.1) -> int:
    """The package router's rule (``tinyserve.routing.cache_aware_choice``, ties to the
    smaller index) on ``trees``, which it then updates as the router updates its own."""
    replica, _ = cache_aware_choice(key, outstanding, trees, balance_abs_threshold,
                                    balance_rel_threshold, min_match_ratio)
    trees[replica].insert(key)
    return replica


# ---- (a) the load guard -----------------------------------------------------------------

_IMBALANCE_CASES = [
    # (outstanding, abs, rel, expected, what it tests)
    ([0, 0, 0], 8, 1.5, False, "an idle fleet"),
    ([9, 0, 0], 8, 1.5, True, "9 - 0 > 8 and 9 > 1.5 x 0"),
    ([30, 21, 25], 8, 1.5, False, "30 - 21 > 8 but 30 <= 1.5 x 21 = 31.5: busy but proportionate"),
    ([8, 0, 0], 8, 1.5, False, "8 - 0 = 8 is not > 8 (strict)"),
    ([20, 12, 15], 8, 1.5, False, "20 - 12 = 8 is not > 8"),
    ([21, 12, 15], 8, 1.5, True, "21 - 12 = 9 > 8 and 21 > 1.5 x 12 = 18"),
    ([40, 12, 30], 8, 1.5, True, "40 - 12 > 8 and 40 > 18"),
    ([3, 0], 2, 1.5, True, "two replicas, abs threshold 2"),
    ([5, 5, 5, 5], 0, 1.0, False, "equal load is never imbalanced"),
    ([6, 5], 0, 1.0, True, "thresholds 0 and 1.0: any difference counts"),
    ([12, 8], 3, 1.5, False, "12 - 8 > 3 but 12 = 1.5 x 8 is not > (strict)"),
    ([13, 8], 3, 1.5, True, "13 - 8 > 3 and 13 > 12"),
]


def check_is_imbalanced(is_imbalanced):
    """The load guard on boundary cases (both conditions, strict >) and random fleets."""
    cases = list(_IMBALANCE_CASES)
    rng = random.Random(6)
    for k in range(300):
        n = rng.randint(2, 6)
        load = [rng.randint(0, 30) for _ in range(n)]
        cases.append((load, rng.choice([0, 2, 4, 8]), rng.choice([1.0, 1.25, 1.5, 2.0]), None,
                      f"random fleet #{k}"))
    for load, a, r, expected, what in cases:
        expected = imbalanced(load, a, r) if expected is None else expected
        given = list(load)
        got = _call(is_imbalanced, "is_imbalanced", given, a, r)
        if given != load:
            fail(f"is_imbalanced 修改了传进来的 outstanding 列表（{load} → {given}）；它只该读，不该写",
                 f"is_imbalanced changed the outstanding list it was given ({load} -> {given}); "
                 f"it must only read it")
        if not isinstance(got, bool):
            fail(f"is_imbalanced 要返回 True 或 False，实际返回了 {got!r}（{type(got).__name__}）",
                 f"is_imbalanced must return True or False, got {got!r} ({type(got).__name__})")
        if got == expected:
            continue
        hi, lo = max(load), min(load)
        cond_abs, cond_rel = hi - lo > a, hi > r * lo
        if (a, r) != (8, 1.5) and got == imbalanced(load, 8, 1.5):
            zh = (f"outstanding={load}、abs={a}、rel={r}：你的答案和阈值 8、1.5 时一样——用参数 abs_threshold、"
                  f"rel_threshold，不要写死默认值（{what}）")
            en = (f"outstanding={load}, abs={a}, rel={r}: your answer is the one for thresholds 8 and 1.5; "
                  f"use the abs_threshold and rel_threshold arguments, not fixed defaults ({what})")
        elif expected and not got:
            zh = (f"outstanding={load}、abs={a}、rel={r}：max - min = {hi - lo} > {a}，并且 "
                  f"max = {hi} > {r} × min = {r * lo}，两个条件都成立，应返回 True（{what}）")
            en = (f"outstanding={load}, abs={a}, rel={r}: max - min = {hi - lo} > {a} and "
                  f"max = {hi} > {r} x min = {r * lo}; both hold, so True ({what})")
        elif not ((not cond_abs and hi - lo == a) or (not cond_rel and hi == r * lo)):
            missing = "max - min > abs" if not cond_abs else "max > rel × min"
            zh = (f"outstanding={load}、abs={a}、rel={r}：你返回了 True，但 {missing} 不成立。两个条件要"
                  f"**同时**成立（and，不是 or）：差值大、而且比例也大才算失衡（{what}）")
            en = (f"outstanding={load}, abs={a}, rel={r}: you returned True, but {missing} does not hold. "
                  f"Both conditions must hold (and, not or): a large gap AND a large ratio ({what})")
        else:
            zh = (f"outstanding={load}、abs={a}、rel={r}：你返回了 True，但 max - min = {hi - lo}、"
                  f"max = {hi} 与 rel × min = {r * lo} 都没有**超过**阈值——相等不算，两个比较都用严格的 >（{what}）")
            en = (f"outstanding={load}, abs={a}, rel={r}: you returned True, but neither max - min = {hi - lo} "
                  f"nor max = {hi} vs rel x min = {r * lo} is above its threshold; equal is not above: "
                  f"use a strict > in both comparisons ({what})")
        fail(zh, en)
    print(f"✓ {len(cases)} 组负载上的判断都正确（差值与比例同时超过阈值、严格大于）\n"
          f"/ correct on {len(cases)} fleets (gap and ratio both above their thresholds, strict >)")


# ---- (b) one decision at a time -----------------------------------------------------------

def _trees(contents, size=1 << 16):
    trees = [PrefixTree(size) for _ in contents]
    for tree, keys in zip(trees, contents):
        for k in keys:
            tree.insert(k)
    return trees


def _prefix(start, n):
    return tuple(range(start, start + n))


A, B, C = _prefix(100, 40), _prefix(300, 40), _prefix(500, 40)


def _unit_cases():
    """(label, key, outstanding, tree contents, kwargs, why-hint zh, en)."""
    return [
        ("empty trees go to the least loaded", A + (1,), [3, 1, 2], [[], [], []], {},
         "所有树都是空的（没有任何匹配），应该选在途请求最少的副本",
         "every tree is empty (no match at all): pick the replica with the fewest outstanding requests"),
        ("empty trees, ties: the smallest index", A + (1,), [2, 0, 0], [[], [], []], {},
         "负载并列时选下标最小的那个", "ties in load go to the smallest index"),
        ("idle fleet, empty trees", A + (1,), [0, 0, 0, 0], [[], [], [], []], {},
         "全都空闲、全都没有匹配：选副本 0", "all idle, no match anywhere: replica 0"),
        ("the longest match wins over load", A + (7, 8), [5, 0, 1], [[A + (1,)], [B], []], {},
         "副本 0 的树与 key 共享 40 个 token 的前缀，负载也没有失衡，应该发往副本 0（哪怕它更忙）",
         "replica 0's tree shares a 40-token prefix with the key and the fleet is balanced: "
         "send it to replica 0 even though it is busier"),
        ("a longer match beats a shorter one", A + B[:20] + (9,), [1, 1, 1],
         [[A + (5,)], [A + B[:20] + (3,)], []], {},
         "副本 1 匹配了 60 个 token，副本 0 只有 40 个：选匹配最长的",
         "replica 1 matches 60 tokens, replica 0 only 40: pick the longest match"),
        ("equal matches: the less loaded", A + (2,), [4, 1, 0], [[A + (1,)], [A + (3,)], [B]], {},
         "副本 0 和 1 匹配一样长，应选其中在途请求更少的副本 1（不是全体最空闲的副本 2）",
         "replicas 0 and 1 match equally: take the less loaded of the two, replica 1 (not replica 2, "
         "the least loaded overall, which has no match)"),
        ("equal matches and equal load: the smaller index", A + (2,), [1, 0, 1], [[A], [], [A]], {},
         "副本 0 和 2 匹配一样长、负载也一样：选下标小的", "replicas 0 and 2 tie on match and load: the smaller index"),
        ("imbalance: least loaded despite the match", A + (4,), [12, 2, 3], [[A], [], []], {},
         "负载失衡（12 - 2 > 8 且 12 > 1.5 × 2）：不管匹配，直接选最空闲的副本",
         "the fleet is imbalanced (12 - 2 > 8 and 12 > 1.5 x 2): ignore the match, take the least loaded"),
        ("busy but balanced: the match still wins", A + (4,), [30, 22, 25], [[A], [], []], {},
         "30 - 22 = 8 不大于 8，负载没有失衡：继续按前缀匹配", "30 - 22 = 8 is not > 8: balanced, so the match decides"),
        ("thresholds are arguments", A + (4,), [4, 0, 1], [[A], [], []],
         {"balance_abs_threshold": 2, "balance_rel_threshold": 1.2},
         "用传进来的 balance_abs_threshold / balance_rel_threshold（这里是 2 和 1.2），不要写死 8 和 1.5",
         "use the balance_abs_threshold / balance_rel_threshold you are given (2 and 1.2 here), not 8 and 1.5"),
        ("a short match counts as no match", A[:3] + C, [1, 0], [[A], []], {},
         "只匹配了 3 个 token，不到 key 长度 43 的 10%（min_match_ratio）：当作没有匹配，选最空闲的",
         "only 3 tokens match, under 10% (min_match_ratio) of the 43-token key: treat it as no match, "
         "take the least loaded"),
        ("min_match_ratio is an argument", A[:3] + C, [1, 0], [[A], []], {"min_match_ratio": 0.0},
         "min_match_ratio=0 时任何大于 0 的匹配都算数：选匹配的副本 0",
         "with min_match_ratio=0 any match above 0 counts: replica 0"),
        ("exactly the ratio counts", A[:10] + _prefix(500, 90), [1, 0], [[A], []], {},
         "匹配 10 个 token，恰好是 key 长度 100 的 10%：等于阈值也算（>=）",
         "10 of 100 tokens match, exactly 10% (min_match_ratio): equal counts (>=)"),
        ("strings work too", "system: be brief\nuser: hi", [2, 0], [["system: be brief\nuser: yo"], []], {},
         "key 也可以是字符串（聊天接口的提示词），PrefixTree 照样按字符匹配：发往副本 0",
         "keys may be strings (chat prompts); PrefixTree matches characters the same way: replica 0"),
    ]


def _validate_choice(got, n, label):
    if isinstance(got, bool) or not isinstance(got, int):
        fail(f"[{label}] choose_replica 要返回副本的下标（int），实际返回了 {got!r}",
             f"[{label}] choose_replica must return a replica index (int), got {got!r}")
    if not 0 <= got < n:
        fail(f"[{label}] 返回的下标 {got} 不在 0..{n - 1} 之内", f"[{label}] index {got} is outside 0..{n - 1}")


def _sizes(trees):
    return [t.size for t in trees]


def check_choose_replica(choose_replica):
    """Hand-made cases with a hint each, then 400 random decisions against the package's router."""
    for label, key, load, contents, kw, zh, en in _unit_cases():
        mine, ref = _trees(contents), _trees(contents)
        got = _call(choose_replica, "choose_replica", key, list(load), mine, **kw)
        _validate_choice(got, len(load), label)
        want = _router_choice(key, list(load), ref, **kw)
        if got != want:
            fail(f"[{label}] outstanding={load}：你选了副本 {got}，应为 {want}。{zh}",
                 f"[{label}] outstanding={load}: you chose replica {got}, expected {want}. {en}")
        _check_recorded(key, got, mine, ref, contents, label)
    _check_no_mutation(choose_replica)
    _check_random(choose_replica)
    print("✓ 空树→最空闲、并列→下标小、失衡→最空闲、最长匹配、短匹配不算、key 只记进被选副本的树；"
          "另有 400 个随机决定与 tinyserve 的路由规则（routing.cache_aware_choice）一致\n"
          "/ empty trees -> least loaded, ties -> smaller index, imbalance -> least loaded, longest match, "
          "short matches ignored, key recorded in the chosen tree only; 400 random decisions match tinyserve's routing rule (routing.cache_aware_choice)")


def _check_recorded(key, got, mine, ref, contents, label):
    """After the decision, the chosen tree (only) must hold the key."""
    if mine[got].match(key) != len(key):
        fail(f"[{label}] 选完副本 {got} 之后，它的树里没有这个 key：最后要调用 trees[replica].insert(key)，"
             f"否则路由器永远“记不住”谁缓存了什么，下一条同前缀的请求就找不到它",
             f"[{label}] after choosing replica {got}, its tree does not hold the key: call "
             f"trees[replica].insert(key) at the end, or the router never learns who caches what and the "
             f"next request with the same prefix cannot find it")
    for i, (t, r) in enumerate(zip(mine, ref)):
        if i != got and t.size != r.size:
            fail(f"[{label}] 副本 {i} 没被选中，它的树却变了（大小 {_trees(contents[i:i + 1])[0].size} → {t.size}）："
                 f"只把 key 记进被选中的那棵树——别的副本并没有算过这个请求，它们的缓存里没有它",
                 f"[{label}] replica {i} was not chosen but its tree changed (size "
                 f"{_trees(contents[i:i + 1])[0].size} -> {t.size}): record the key in the chosen tree only; "
                 f"the other replicas never computed this request, so their caches do not hold it")


def _check_no_mutation(choose_replica):
    load = [3, 0, 5]
    copy = list(load)
    _call(choose_replica, "choose_replica", A, copy, _trees([[], [], []]))
    if copy != load:
        fail(f"choose_replica 修改了 outstanding 列表（{load} → {copy}）。在途计数由路由器在请求开始/结束时维护，"
             f"你的函数只读它", f"choose_replica changed the outstanding list ({load} -> {copy}). The router "
             f"keeps those counts as requests start and finish; your function only reads them")


def _check_random(choose_replica, rounds=400):
    rng = random.Random(11)
    prefixes = [_prefix(1000 + 100 * g, rng.randint(8, 40)) for g in range(6)]
    n = 4
    mine, ref = _trees([[]] * n, 512), _trees([[]] * n, 512)
    load = [0] * n
    for k in range(rounds):
        key = rng.choice(prefixes) + tuple(rng.randrange(10, 90) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.2:
            key = tuple(rng.randrange(10, 2000) for _ in range(rng.randint(1, 30)))
        kw = rng.choice([{}, {"balance_abs_threshold": 2}, {"min_match_ratio": 0.5},
                         {"balance_abs_threshold": 0, "balance_rel_threshold": 1.0}])
        got = _call(choose_replica, "choose_replica", key, list(load), mine, **kw)
        _validate_choice(got, n, f"random decision #{k}")
        want = _router_choice(key, list(load), ref, **kw)
        if got != want:
            matches = [t.match(key) for t in ref]
            fail(f"[随机决定 #{k}] outstanding={load}、各树的匹配长度={matches}、key 长 {len(key)}、参数 {kw}："
                 f"你选了 {got}，应为 {want}。按顺序检查：先看是否失衡；再看最长匹配是否 > 0 且 >= min_match_ratio × "
                 f"len(key)；匹配并列时选在途少的，再并列选下标小的",
                 f"[random decision #{k}] outstanding={load}, matches={matches}, key length {len(key)}, "
                 f"args {kw}: you chose {got}, expected {want}. In order: imbalance first; then the longest "
                 f"match if > 0 and >= min_match_ratio x len(key); equal matches -> fewer outstanding, then "
                 f"smaller index")
        if _sizes(mine) != _sizes(ref):
            fail(f"[随机决定 #{k}] 决定对了，但树的内容和 tinyserve 的路由器不同（大小 {_sizes(mine)} vs {_sizes(ref)}）："
                 f"每次决定后只调用一次 trees[replica].insert(key)",
                 f"[random decision #{k}] right choice, but the trees differ from tinyserve's router's (sizes "
                 f"{_sizes(mine)} vs {_sizes(ref)}): call trees[replica].insert(key) exactly once per decision")
        load[want] += 1
        if rng.random() < 0.5:               # requests finish now and then
            busy = [i for i in range(n) if load[i]]
            for i in rng.sample(busy, k=min(len(busy), rng.randint(1, 2))):
                load[i] -= 1


# ---- (c) in the simulator ------------------------------------------------------------------

class FunctionPolicy(RoutingPolicy):
    """A ``choose_replica(key, outstanding, trees, **kwargs)`` function as a ``RoutingPolicy``.

    The policy owns one ``PrefixTree`` per replica and hands them to the
    function, so the simulator (and the HTTP router) can run a student's
    decision like any built-in policy.
    """
    name = "your_cache_aware"

    def __init__(self, choose_replica, num_replicas: int, max_tree_size: int = 1 << 16, **kwargs):
        super().__init__(num_replicas)
        self.choose_replica = choose_replica
        self.kwargs = kwargs
        self.trees = [PrefixTree(max_tree_size) for _ in range(num_replicas)]

    def choose(self, key, outstanding):
        self._check(outstanding)
        replica = self.choose_replica(key, list(outstanding), self.trees, **self.kwargs)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < self.num_replicas:
            raise ValueError(f"choose_replica returned {replica!r}, not a replica index "
                             f"in 0..{self.num_replicas - 1}")
        return replica


# 16 groups of a 1024-token system prompt over 4 replicas whose caches hold only a few of them.
SIM_SETTINGS = dict(workload="shared-prefix", num_requests=400, rate=30.0, seed=0,
                    num_prefix_groups=16, prefix_len=1024, num_replicas=4, num_kv_blocks=600)


def routing_comparison(choose_replica=None, **overrides):
    """Simulate round-robin, least-outstanding and (if given) ``choose_replica``; rows of metrics."""
    from tinyserve.sim.cluster import simulate_cluster
    from tinyserve.workload import make_workload

    s = {**SIM_SETTINGS, **overrides}
    specs = make_workload(s["workload"], s["num_requests"], rate=s["rate"], seed=s["seed"],
                          num_prefix_groups=s["num_prefix_groups"], prefix_len=s["prefix_len"])
    kw = dict(num_replicas=s["num_replicas"], enable_prefix_caching=True,
              num_kv_blocks=s["num_kv_blocks"])
    policies = {"round_robin": "round_robin", "least_outstanding": "least_outstanding"}
    if choose_replica is not None:
        policies["yours"] = FunctionPolicy(choose_replica, s["num_replicas"])
    rows = []
    for label, policy in policies.items():
        result = simulate_cluster(specs, routing=policy, **kw)
        summary = result.summary()
        rows.append({"policy": label, "hit_rate": summary["prefix_cache_hit_rate"],
                     "mean_ttft": summary["mean_ttft"], "p99_ttft": summary["p99_ttft"],
                     "load_imbalance": summary["load_imbalance"], "routed": list(result.routed),
                     "unfinished": summary["unfinished"]})
    return rows


def format_rows(rows) -> str:
    lines = [f"{'policy':<18} {'hit rate':>9} {'mean TTFT ms':>13} {'p99 TTFT ms':>12}  routed per replica"]
    for r in rows:
        lines.append(f"{r['policy']:<18} {r['hit_rate']:>9.3f} {1e3 * r['mean_ttft']:>13.1f} "
                     f"{1e3 * r['p99_ttft']:>12.1f}  {r['routed']}")
    return "\n".join(lines)


def _in_simulator(name, error):
    return (f"在模拟器里运行你的 choose_replica 时出错：{type(error).__name__}: {error}",
            f"running your choose_replica in the simulator failed: {type(error).__name__}: {error}")


def check_routing_in_simulator(choose_replica, plot=True):
    """Your policy vs round-robin on 4 simulated A100s: a clearly higher hit rate, a lower mean TTFT."""
    rows = call(routing_comparison, "routing_comparison", choose_replica, explain=_in_simulator)
    print(format_rows(rows))
    rr, yours = rows[0], rows[-1]
    if yours["unfinished"]:
        fail(f"有 {yours['unfinished']} 条请求没有完成", f"{yours['unfinished']} requests did not finish")
    if yours["hit_rate"] < rr["hit_rate"] + 0.15:
        fail(f"你的策略命中率 {yours['hit_rate']:.3f}，轮询是 {rr['hit_rate']:.3f}：没有明显提高（至少要高 0.15）。"
             f"同一组的请求应该被送到已经缓存了这段前缀的副本——检查是否用 tree.match(key) 找最长匹配，"
             f"以及选完之后是否把 key 记进了那棵树",
             f"your policy's hit rate {yours['hit_rate']:.3f} vs round-robin {rr['hit_rate']:.3f}: not clearly "
             f"higher (needs +0.15). Requests of a group should go to the replica that already caches their "
             f"prefix: use tree.match(key) for the longest match, and record the key in the chosen tree")
    if yours["mean_ttft"] >= rr["mean_ttft"]:
        fail(f"命中率提高了，但平均首字延迟 {1e3 * yours['mean_ttft']:.1f} ms 并不比轮询的 "
             f"{1e3 * rr['mean_ttft']:.1f} ms 低：多半是请求挤到了少数副本上排队。检查失衡保护"
             f"（is_imbalanced 为真时要选最空闲的副本）",
             f"the hit rate went up but mean TTFT {1e3 * yours['mean_ttft']:.1f} ms is not below round-robin's "
             f"{1e3 * rr['mean_ttft']:.1f} ms: requests probably pile up on a few replicas. Check the load "
             f"guard (when imbalanced, take the least loaded replica)")
    if plot:
        import matplotlib.pyplot as plt

        from tinyserve.book import plots
        plots.routing_policy_bars([r["policy"] for r in rows], [r["hit_rate"] for r in rows],
                                  [1e3 * r["mean_ttft"] for r in rows],
                                  title="4 simulated A100s, 16 groups x 1024-token prefix")
        plt.tight_layout()
        plt.show()
    print(f"✓ 命中率 {rr['hit_rate']:.2f} → {yours['hit_rate']:.2f}，平均首字延迟 {1e3 * rr['mean_ttft']:.1f} → "
          f"{1e3 * yours['mean_ttft']:.1f} ms（相对轮询）\n/ hit rate {rr['hit_rate']:.2f} -> "
          f"{yours['hit_rate']:.2f}, mean TTFT {1e3 * rr['mean_ttft']:.1f} -> {1e3 * yours['mean_ttft']:.1f} ms "
          f"(vs round-robin)")
    return rows
