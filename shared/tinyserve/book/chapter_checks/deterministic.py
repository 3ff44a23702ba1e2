"""The chapter's claims that come out the same on every machine.

* computed: arithmetic on the datasheet figures (``tinyserve.hardware``);
* simulated: the engine's own scheduler on the simulator's clock (A100 + 7B roofline);
* exact: counts from a real engine run (steps, forwards, chunks, refcounts, streamed text)
  that depend on the code, not on the machine's speed.

None of them passes ``measure``: a deterministic result is never measured again.
"""

from __future__ import annotations

import functools
import math
import statistics

from tinyserve import LLM, SamplingParams
from tinyserve import hardware as hwm
from tinyserve.book import claims
from tinyserve.book.chapter_checks.common import A100, EXACT, INF, LLAMA_7B, SIM, all_of, each_within, one_thread, say
from tinyserve.diagnose import diagnose
from tinyserve.policies import SJFPolicy
from tinyserve.sim import default_num_kv_blocks, simulate
from tinyserve.sim.cluster import simulate_cluster
from tinyserve.workload import RequestSpec, make_workload, offered_load


# --------------------------------------------------------------------------- C01, C09: arithmetic


def c01():
    """Orders of magnitude between the worst and the best serving software, on the A100 roofline."""
    b_star = hwm.crossover_batch(A100, LLAMA_7B, "fp16")
    best = hwm.tokens_per_second(A100, LLAMA_7B, b_star, "fp16")[1]       # batched at the crossover
    single = hwm.tokens_per_second(A100, LLAMA_7B, 1, "fp16")[1]          # one request at a time
    # One at a time and without a KV cache: token t recomputes its whole context (512 in, 512 out).
    ctx = range(512, 1024)
    naive = len(ctx) / sum(hwm.step_time(A100, LLAMA_7B, "fp16", c, 0, c * (c + 1) / 2) for c in ctx)
    say(f"A100 + 7B fp16: one request {single:.0f} tok/s, B={b_star:.0f} {best:,.0f} tok/s "
         f"({math.log10(best / single):.1f} orders); one at a time without a KV cache {naive:.0f} tok/s")
    # The book's "three orders of magnitude": at least 2.5, which rounds to 3.
    return claims.check("C01", "同卡同模型，只换软件（批处理、KV 缓存），吞吐差三个数量级（屋顶线，单位：数量级）",
                        round(math.log10(best / naive), 2), predicted=3.0, expect=claims.at_least(2.5),
                        why_not="数据手册算术：若不成立，是 tinyserve.hardware 的数字被改了")


def c09():
    """The chapter's three numbers from the A100 datasheet."""
    read = hwm.weight_read_time(A100, LLAMA_7B, "fp16")
    per_request = hwm.per_request_compute_time(A100, LLAMA_7B, "fp16")
    crossover = hwm.crossover_batch(A100, LLAMA_7B, "fp16")
    return claims.check("C09", "A100 上 7B FP16：一步读权重约 6.9 ms、每条请求算约 45 µs、交叉点约 153",
                        (round(read * 1e3, 1), round(per_request * 1e6), round(crossover)),
                        predicted=(6.9, 45, 153), expect=claims.equals(),
                        why_not="数据手册算术：若不成立，是 tinyserve.hardware 的数字被改了")



# --------------------------------------------------------------------------- C04: queues


def _steady_rate(result) -> float:
    """Completions per second between the 10th and 90th percentile finish times."""
    t = sorted(m.finished_time for m in result.metrics if m.finished_time is not None)
    lo, hi = len(t) // 10, 9 * len(t) // 10
    return (hi - lo) / (t[hi] - t[lo])


def c04():
    """Queue growth below and above the capacity, and with a second replica (simulator)."""
    kw, shape = dict(max_num_seqs=32), dict(length_scale=0.5, seed=2)
    mu = _steady_rate(simulate(make_workload("mixed", 300, rate=INF, **shape), **kw))
    over = make_workload("mixed", 300, rate=1.5 * mu, **shape)
    one = simulate(over, **kw).summary()
    excess = one["arrival_rate"] - mu                                    # this draw's own rate - mu
    under = simulate(make_workload("mixed", 300, rate=0.5 * mu, **shape), **kw).summary()
    two = simulate_cluster(over, num_replicas=2, routing="least_outstanding", **kw).summary()
    say(f"capacity mu {mu:.1f} req/s; at 1.5 mu ({one['arrival_rate']:.1f}/s arrived) the queue grows "
         f"{one['queue_growth_rate']:.1f}/s (lambda - mu {excess:.1f}); at 0.5 mu longest queue "
         f"{under['max_queue_length']}; two replicas at 1.5 mu: {two['queue_growth_rate']:.2f}/s")
    return claims.check("C04", "到达率超过容量后队列按 (λ−μ)t 增长；加一个副本就收住（模拟器，A100 + 7B）",
                        (one["queue_growth_rate"] / excess, under["max_queue_length"],
                         two["queue_growth_rate"] / excess), predicted=(1.0, 0, 0.0),
                        expect=all_of("growth/(λ−μ) in [0.8, 1.2]; queue <= 2 below; with 2 replicas < 5%",
                                    lambda m, p: 0.8 <= m[0] <= 1.2 and m[1] <= 2 and m[2] < 0.05),
                        why_not=SIM, simulated=True)



# --------------------------------------------------------------------------- C05, C08, C12-C14: the engine


@one_thread
def c05():
    """Steps and model forwards of one generate() call, predicted from chunks and max_tokens."""
    llm = LLM("tiny", seed=0, max_num_batched_tokens=16)
    forwards = []
    llm.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    llm.generate([list(range(100, 140))], SamplingParams(max_tokens=8, ignore_eos=True))
    predicted = math.ceil(40 / 16) + 8 - 1                                # prefill chunks + decodes
    return claims.check("C05", "一次 generate 调用在引擎层走几步、在框架层做几次前向，由分块和输出长度决定",
                        (len(llm.engine.step_stats), len(forwards)), predicted=(predicted, predicted),
                        expect=claims.equals(), why_not=EXACT)


OUT_LENS = [4, 16, 5, 30, 7, 4, 12, 28, 6, 9, 4, 24, 8, 5, 11, 6]


def _predicted_steps(lens: list[int], seats: int, mode: str) -> int:
    """Steps from output lengths alone: a static batch lasts as long as its longest member;
    continuous batching seats each request in the first seat to free up."""
    if mode == "static":
        return sum(max(lens[k:k + seats]) for k in range(0, len(lens), seats))
    free_at = [0] * seats
    for n in lens:
        free_at[free_at.index(min(free_at))] += n
    return max(free_at)


def _batching_run(mode: str, seats: int = 4) -> tuple[int, int]:
    """Engine steps, and seat-steps left empty while a request waited."""
    llm = LLM("tiny", seed=0, max_num_seqs=seats, batching=mode, enable_prefix_caching=False)
    llm.generate([[10 + i] * 8 for i in range(len(OUT_LENS))],
                 [SamplingParams(max_tokens=n, ignore_eos=True) for n in OUT_LENS])
    stats = llm.engine.step_stats
    return len(stats), sum(seats - s.num_running for s in stats if s.num_waiting)


@one_thread
def c08():
    """Static vs continuous batching on the engine: steps from output lengths; no seat idles while one waits."""
    static, cont = _batching_run("static"), _batching_run("continuous")
    predicted = (_predicted_steps(OUT_LENS, 4, "static"), _predicted_steps(OUT_LENS, 4, "continuous"), 0)
    say(f"16 requests, 4 seats: static {static[0]} steps ({static[1]} seat-steps idle while some wait), "
         f"continuous {cont[0]} steps ({cont[1]} idle); predicted {predicted[0]} and {predicted[1]}")
    return claims.check("C08", "连续批处理按步换人：写完就走、等着的立刻补上，座位不空等（步数由输出长度预测）",
                        (static[0], cont[0], cont[1]), predicted=predicted, expect=claims.equals(),
                        why_not=EXACT)


@one_thread
def c12():
    """A 100-token prompt arriving while 3 requests decode, budget 32: its chunks, batch-mates, first token."""
    eng = LLM("tiny", seed=0, max_num_batched_tokens=32, enable_prefix_caching=False).engine
    for i in range(3):
        eng.add_request([10 + i] * 4, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(2):                                                    # they are decoding now
        eng.step()
    first = eng.core.num_steps
    req = eng.requests[eng.add_request(list(range(100, 200)), SamplingParams(max_tokens=5, ignore_eos=True))]
    while eng.has_unfinished_requests():
        eng.step()
    steps = eng.core.steps_since(first)
    chunks = [n for _, n in req.schedule_log]
    emitted = next(i for i, s in enumerate(steps) if s.start <= req.first_token_time <= s.start + s.duration)
    decodes = [s.num_decode_tokens for s in steps[:4]]
    return claims.check("C12", "长提示词按预算切块、与解码同批；最后一块算完时出首字，之后每步一个 token",
                        (chunks, emitted, decodes), predicted=([29, 29, 29, 13, 1, 1, 1, 1], 3, [3] * 4),
                        expect=claims.equals(), why_not=EXACT)


@one_thread
def c13():
    """Streamed text of 150 generated tokens against the whole decode: no half characters."""
    llm = LLM("tiny-zh", seed=0)
    eng, tok = llm.engine, llm.tokenizer
    eng.add_request("分块预填充", SamplingParams(max_tokens=150, ignore_eos=True))
    pieces, ids = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            pieces.append(out.new_text)
            ids = out.token_ids
    split = sum(tok.token_bytes(i).decode("utf-8", "ignore").encode() != tok.token_bytes(i) for i in ids)
    added = "".join(pieces).count("\ufffd") - tok.decode(ids).count("\ufffd")
    say(f"{len(ids)} tokens, {split} of them end inside a character; the stream added {added} U+FFFD")
    return claims.check("C13", "流式反分词不发半个字：被拆开的字攒齐再发，输出与整段解码逐字相同",
                        (split > 0, added, "".join(pieces) == tok.decode(ids)), predicted=(True, 0, True),
                        expect=claims.equals(), why_not=EXACT)


@one_thread
def c14():
    """Refcounts of a shared system prompt's blocks while 3 users come and go."""
    llm = LLM("tiny", seed=0, block_size=16, num_kv_blocks=32)
    eng, bm = llm.engine, llm.engine.block_manager
    users = [[(13 * j) % 1900 + 50 for j in range(70)] + [5 + u] * (4 + u) for u in range(4)]  # 4 blocks + 6
    llm.generate([users[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    shared = bm.find_cached_prefix(users[1])
    for u, n in zip(users[1:], (4, 8, 12)):
        eng.add_request(u, SamplingParams(max_tokens=n, ignore_eos=True))
    peak, after_exit = 0, []
    while eng.has_unfinished_requests():
        left = [o for o in eng.step() if o.finished]
        refs = max([bm.blocks[b].ref_count for b in shared] or [0])
        peak, after_exit = max(peak, refs), after_exit + [refs] * len(left)
    kept = all(b in bm.free_blocks and bm.blocks[b].block_hash is not None for b in shared)
    return claims.check("C14", "请求离开时共享块引用计数减一，最后一个使用者离开才释放（仍带哈希可再命中）",
                        (len(shared), peak, after_exit, kept), predicted=(4, 3, [2, 1, 0], True),
                        expect=claims.equals(), why_not=EXACT)



# --------------------------------------------------------------------------- C16-C19: scheduling


@functools.lru_cache(maxsize=1)
def _overload() -> tuple[list, dict]:
    """A mixed workload at 1.5x the capacity of 32 seats, under FCFS, SJF and SJF with aging."""
    kw = dict(max_num_seqs=32)
    mu = _steady_rate(simulate(make_workload("mixed", 200, rate=INF, seed=1, length_scale=0.5), **kw))
    specs = make_workload("mixed", 300, rate=1.5 * mu, seed=1, length_scale=0.5)
    return specs, {name: simulate(specs, policy=policy, **kw)
                   for name, policy in (("fcfs", "fcfs"), ("sjf", "sjf"), ("aging", SJFPolicy(aging=200.0)))}


def _cuts(specs) -> tuple[float, float]:
    """Short prompts: at most the median length; long ones: from the 95th percentile."""
    lens = sorted(s.prompt_len for s in specs)
    return lens[len(lens) // 2], lens[95 * len(lens) // 100]


def c16():
    """Short prompts' mean TTFT under FCFS and SJF in an overloaded simulation."""
    specs, runs = _overload()
    short = _cuts(specs)[0]
    ttft = {p: statistics.fmean(o.metrics.ttft for o in r if o.spec.prompt_len <= short) for p, r in runs.items()}
    everyone = statistics.fmean(m.ttft for m in runs["fcfs"].metrics)
    say(f"mean TTFT: everyone (FCFS) {everyone:.2f} s; short prompts FCFS {ttft['fcfs']:.2f} s, "
         f"SJF {ttft['sjf']:.2f} s")
    return claims.check("C16", "先来先服务有队头阻塞：短请求和所有人等得一样久，让短的先走就快得多（模拟器）",
                        (ttft["fcfs"] / everyone, ttft["fcfs"] / ttft["sjf"]), predicted=(1.0, None),
                        expect=all_of("FCFS short/everyone in [0.8, 1.25], FCFS/SJF short >= 2",
                                    lambda m, p: 0.8 <= m[0] <= 1.25 and m[1] >= 2), why_not=SIM, simulated=True)


def _formed_batch(result) -> float:
    """Mean size of a static batch when it is formed (the steps where the running count rises)."""
    return statistics.fmean(b.num_running for a, b in zip([None] + result.steps, result.steps)
                            if a is None or b.num_running > a.num_running)


def c17():
    """What each fix costs: SJF starves long prompts, aging bounds the wait, bucketing lowers the fill."""
    specs, runs = _overload()
    short, long_cut = _cuts(specs)
    wait = {p: max(o.metrics.queue_time for o in r if o.spec.prompt_len >= long_cut) for p, r in runs.items()}
    bound = min(wait["sjf"], wait["fcfs"] + (max(s.prompt_len for s in specs) - short) / 200.0)
    static = make_workload("mixed", 200, rate=12.0, seed=1)
    fill = {p: _formed_batch(simulate(static, policy=p, batching="static", max_num_seqs=64))
            for p in ("fcfs", "bucket")}
    say(f"longest wait of long prompts: FCFS {wait['fcfs']:.1f} s, SJF {wait['sjf']:.1f} s, aging 200 "
         f"{wait['aging']:.1f} s (bound {bound:.1f} s); static batches when formed: FCFS {fill['fcfs']:.1f}, "
         f"bucketed {fill['bucket']:.1f}")
    return claims.check("C17", "每种改法都有代价：短作业优先饿着长请求，老化给等待设上界，分桶降低填充率（模拟器）",
                        (wait["sjf"] / wait["fcfs"], wait["aging"] / bound, fill["bucket"] / fill["fcfs"]),
                        expect=all_of("SJF/FCFS wait >= 1.5, aging/bound <= 1, bucket/FCFS fill < 0.9",
                                    lambda m, p: m[0] >= 1.5 and m[1] <= 1 and m[2] < 0.9), why_not=SIM, simulated=True)


def c18():
    """Chat + long documents with and without chunked prefill (simulator): longest stall, p99 TTFT."""
    docs = make_workload("long-in-short-out", 40, rate=3, seed=1, length_scale=1.5)
    specs = sorted(make_workload("short-in-long-out", 100, rate=8, seed=0) + docs, key=lambda s: s.arrival)
    t_token = hwm.per_request_compute_time(A100, LLAMA_7B, "fp16")
    runs = {n: simulate(specs, enable_chunked_prefill=n < 8192, max_num_batched_tokens=n) for n in (8192, 512)}
    gap = {n: max(g for m in r.metrics for g in m.itl) for n, r in runs.items()}
    # predicted: the decodes wait for the step with the most prompt tokens, at 2P/F each
    stall = {n: t_token * max(s.num_prefill_tokens for s in r.steps) for n, r in runs.items()}
    p99 = {n: r.summary()["p99_ttft"] for n, r in runs.items()}
    say(f"longest gap between two tokens: whole prefills {gap[8192] * 1e3:.0f} ms, chunks of 512 "
         f"{gap[512] * 1e3:.0f} ms (the biggest prefill step at 2P/F a token: {stall[8192] * 1e3:.0f} and "
         f"{stall[512] * 1e3:.0f}); p99 TTFT {p99[8192]:.2f} -> {p99[512]:.2f} s")
    return claims.check("C18", "分块预填充让解码不再被长预填充卡住，首字延迟也没有失控（模拟器）",
                        (gap[8192], gap[512], p99[512] / p99[8192]), predicted=(stall[8192], stall[512], 1.0),
                        expect=all_of("stalls within [0.7, 1.4] of predicted, chunked < 1/4 of whole; "
                                    "p99 TTFT ratio <= 1.5",
                                    lambda m, p: each_within(0.7, 1.4)(m[:2], p[:2]) and m[1] < m[0] / 4
                                    and m[2] <= 1.5), why_not=SIM, simulated=True)


def _capacity(specs, max_num_seqs: int = 256, dtype: str = "fp16") -> float:
    """Requests/s of one A100 from the roofline: prefill compute-bound, decode steps shared by the batch."""
    load = offered_load(specs)
    isl, osl = load["mean_prompt_len"], load["mean_output_len"]
    context = isl + osl / 2
    batch = min(max_num_seqs, default_num_kv_blocks(A100, LLAMA_7B, dtype, 16) * 16 / context)
    step = hwm.decode_step_time(A100, LLAMA_7B, batch, dtype, context_len=context)
    return 1 / (isl * hwm.per_request_compute_time(A100, LLAMA_7B, dtype) + osl * step / batch)


def c19():
    """Goodput of decode-first over prefill-first at 1.3x capacity (the book's other half: printed)."""
    good = {}
    for name in ("short-in-long-out", "long-in-short-out"):
        rate = 1.3 * _capacity(make_workload(name, 1000, rate=1.0, seed=3), max_num_seqs=64)
        specs = make_workload(name, 300, rate=rate, seed=3)
        good[name] = {p: simulate(specs, policy=p, max_num_seqs=64).summary(ttft_slo=2.0, tpot_slo=0.05)["goodput"]
                      for p in ("decode-first", "prefill-first")}
        say(f"{name} at {rate:.1f} req/s: goodput decode-first {good[name]['decode-first']:.2f}, "
             f"prefill-first {good[name]['prefill-first']:.2f} req/s (TTFT <= 2 s, TPOT <= 50 ms)")
    liso = good["long-in-short-out"]
    say(f"本书说长入短出宜预填充优先；这里测到：预填充优先的有效吞吐只有解码优先的 "
         f"{liso['prefill-first'] / max(liso['decode-first'], 1e-9):.2f} 倍（解码优先加分块预填充已把剩余预算给了预填充，"
         f"见 06 的“本书说/这里测到”）")
    silo = good["short-in-long-out"]
    return claims.check("C19", "短入长出宜解码优先：解码优先的有效吞吐高于预填充优先（模拟器；长入短出的一半这里不成立，见上一行）",
                        silo["decode-first"] / max(silo["prefill-first"], 1e-9), expect=claims.at_least(1.0),
                        why_not=SIM, simulated=True)


# --------------------------------------------------------------------------- C21, C22: orchestration


def c21():
    """Prefix hit rate and TTFT of round-robin vs cache-aware routing on 8 simulated replicas."""
    n, groups = 8, 16
    specs = make_workload("shared-prefix", 12 * n, rate=7.5 * n, seed=0, num_prefix_groups=groups, prefix_len=1024)
    share = sum(16 * (s.prefix_len // 16) for s in specs) / sum(s.prompt_len for s in specs)
    repeats = lambda m: 1 - groups * (1 - (1 - 1 / groups) ** m) / m       # requests whose group came before
    predicted = (share * repeats(len(specs) / n), share * repeats(len(specs)), None)
    runs = {p: simulate_cluster(specs, num_replicas=n, routing=p, enable_prefix_caching=True,
                                num_kv_blocks=600).summary() for p in ("round_robin", "cache_aware")}
    hit = {p: s["prefix_cache_hit_rate"] for p, s in runs.items()}
    ttft = runs["cache_aware"]["mean_ttft"] / runs["round_robin"]["mean_ttft"]
    return claims.check("C21", "缓存感知路由把同前缀的请求送到同一副本：命中率按预测上去，首字延迟下来（模拟器）",
                        (hit["round_robin"], hit["cache_aware"], ttft), predicted=predicted,
                        expect=all_of("hit rates within 0.06 / [0.85, 1.02] of predicted; TTFT ratio < 0.75",
                                    lambda m, p: abs(m[0] - p[0]) < 0.06 and 0.85 <= m[1] / p[1] <= 1.02
                                    and m[2] < 0.75), why_not=SIM, simulated=True)


def c22():
    """Prefill-heavy load on 8 simulated A100s: colocated vs prefill/decode pools of different sizes."""
    answers = make_workload("mixed", 200, rate=56.0, seed=1)
    specs = [RequestSpec(a.arrival, a.prompt_len, max(1, min(b.output_len, 4096 - a.prompt_len)))
             for a, b in zip(make_workload("long-in-short-out", 200, rate=56.0, seed=0), answers)]
    runs = {split: simulate_cluster(specs, num_replicas=8, routing="least_outstanding", disaggregated=split)
            for split in (None, (2, 6), (3, 5), (4, 4))}
    s = {k: r.summary(ttft_slo=2.0, tpot_slo=0.015) for k, r in runs.items()}
    transfer = hwm.kv_bytes_per_token(LLAMA_7B, "fp16") / 25e9               # seconds per prompt token
    early = min((o.metrics.token_times[1] - o.metrics.token_times[0]) - o.spec.prompt_len * transfer
                for o in runs[3, 5].outputs if len(o.metrics.token_times) > 1)
    measured = (s[3, 5]["goodput"] / s[None]["goodput"], s[2, 6]["mean_ttft"] / s[3, 5]["mean_ttft"],
                s[4, 4]["mean_tpot"] / s[3, 5]["mean_tpot"], early >= -1e-9)
    say(f"goodput colocated {s[None]['goodput']:.1f}, P3:D5 {s[3, 5]['goodput']:.1f} req/s; a smaller prefill "
         f"pool: TTFT x{measured[1]:.1f}; a smaller decode pool: TPOT x{measured[2]:.2f}; "
         f"token 2 never before its KV transfer: {measured[3]}")
    return claims.check("C22", "预填充与解码分池：各池大小各管一项指标（首字/出字），比例对了有效吞吐翻倍（模拟器）",
                        measured, expect=all_of("goodput x >= 1.5; TTFT x > 1.5; TPOT x > 1.1; KV transfer respected",
                                              lambda m, p: m[0] >= 1.5 and m[1] > 1.5 and m[2] > 1.1 and m[3]),
                        why_not=SIM, simulated=True)


# --------------------------------------------------------------------------- C23, C24: tuning order

SLO = dict(ttft_slo=0.5, tpot_slo=0.025)


@functools.lru_cache(maxsize=1)
def _chat() -> tuple[list, dict]:
    """Chat-like load at 10 req/s on one A100 with 4 and 64 seats, and 4 seats in int8."""
    specs = make_workload("mixed", 300, rate=10, seed=0)
    runs = {"4": dict(max_num_seqs=4), "int8": dict(max_num_seqs=4, dtype="int8"), "64": dict(max_num_seqs=64)}
    return specs, {k: simulate(specs, **kw).summary(**SLO) for k, kw in runs.items()}


def c23():
    """diagnose() on a too-small batch, after its fix, and on an overloaded GPU (simulator)."""
    crossover = hwm.crossover_batch(A100, LLAMA_7B, "fp16")
    runs = _chat()[1]
    small = diagnose(runs["4"], **SLO, crossover=crossover, max_num_seqs=4)
    fixed = diagnose(runs["64"], **SLO, crossover=crossover, max_num_seqs=64)
    busy = diagnose(simulate(make_workload("mixed", 400, rate=60, seed=0)).summary(**SLO), **SLO,
                    crossover=crossover, max_num_seqs=256)
    say(f"4 seats: [{small.stage}] {small.action}; 64 seats: [{fixed.stage}]; 60 req/s on one GPU: "
         f"[{busy.stage}]; goodput {runs['4']['goodput']:.2f} -> {runs['64']['goodput']:.2f} req/s")
    return claims.check("C23", "调优按顺序：先按症状定位到一段，再看批大小，修对那一层指标才动（模拟器）",
                        (small.stage, small.action.split(" (")[0], fixed.stage, busy.stage,
                         runs["64"]["goodput"] > 10 * runs["4"]["goodput"]),
                        predicted=("queueing", "raise max_num_seqs toward the crossover", "healthy", "overload", True),
                        expect=claims.equals(), why_not=SIM, simulated=True)


def c24():
    """Quantizing a queue-bound system (4 seats, 10 req/s): capacity predicted vs simulated, goodput."""
    specs, runs = _chat()
    predicted, served = _capacity(specs, 4, "int8"), runs["int8"]["request_throughput"]
    say(f"int8 with 4 seats: capacity predicted {predicted:.1f}, served {served:.1f} req/s < 10 arriving; "
         f"goodput fp16 {runs['4']['goodput']:.2f}, int8 {runs['int8']['goodput']:.2f}, "
         f"64 seats {runs['64']['goodput']:.2f} req/s")
    return claims.check("C24", "系统卡在排队时量化救不了：容量仍低于到达率，有效吞吐几乎不动；调大批才行（模拟器）",
                        (served, runs["int8"]["goodput"] / runs["64"]["goodput"]), predicted=(predicted, None),
                        expect=all_of("served within 15% of the predicted capacity and < 10 req/s; "
                                    "int8 goodput < 10% of 64 seats'",
                                    lambda m, p: abs(m[0] / p[0] - 1) < 0.15 and m[0] < 10 and m[1] < 0.1),
                        why_not=SIM, simulated=True)


