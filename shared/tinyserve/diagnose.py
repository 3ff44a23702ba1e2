"""The chapter's order of tuning, as a function: ``diagnose(summary, ttft_slo, tpot_slo)``.

1. Which stage is slow: ``{stat}_ttft`` against ``ttft_slo`` and ``{stat}_tpot``
   against ``tpot_slo`` (seconds). TTFT slow alone → queueing or prefill (told
   apart by ``mean_queue_time / mean_ttft``; a prefill whose inter-token gaps
   spike is an unchunked long prompt); TPOT slow alone → decode steps (stalled by
   prefills, too large a batch, or the bandwidth floor); both → overload when a
   queue is what TTFT waits for (add capacity or rate-limit), else long prompts
   prefilled whole (chunk them), or, with even gaps, steps that are all slow. When the latencies hold (or nothing finished to
   measure them) but the queue grows, either faster than completions or while the
   batch sits at its cap (``arrival_rate``, ``request_throughput``,
   ``queue_growth_rate``, ``max_num_seqs``), that is overload too, only just
   starting or a wedged server: a queued request is in no latency histogram until
   it is served. Before all of this: a window with no tokens at all is idle (no
   traffic: nothing to judge) or, with requests held, a stalled server.
2. Batch size: ``mean_batch_size`` against ``crossover`` and ``max_num_seqs``.
   The crossover may be a function of the context length (``hardware.crossover_batch``
   with the hardware and model bound): KV reads grow with context, so a batch past
   the weights-only crossover can still be memory-bound; it is read at the
   summary's ``mean_context_len``. A queue while seats and KV are free, with every
   step at the same token count (``step_share_at_ceiling``), is the token budget.
3. Prefix cache: ``prefix_cache_hit_rate`` against ``prefix_share`` (the share of
   prompt tokens you expect to be a reusable prefix) and the ``routing`` policy.
4. Only then model-level levers (quantization, speculative decoding, parallelism).

Each step is one function below; ``diagnose`` returns the first problem found,
with the numbers it compared (``Diagnosis.evidence``) so the reader sees the
rule that fired.

A summary read off a live server (``tinyserve.serving.live_diagnose``) may lack
a number because the server does not export it. ``unknown`` then maps each
missing key to the reason, the step that needed it says so
(``Diagnosis.unknown``) instead of assuming a value, and without the TTFT or
TPOT percentile the stage itself is ``"unknown"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.diagnose_facts import (ARRIVAL_EXCESS, ITL_SPIKE, LOAD_KEYS, MEMORY_KEYS, OPTIONAL_KEYS,
                                      QUEUE_ABSORBS, QUEUE_SHARE, Facts, check_knobs, check_unknown, no_tokens,
                                      number, positive, resolve_crossover)

#: Every stage ``diagnose`` may return, in the order it looks; "unknown" when the
#: TTFT or TPOT percentile it starts from is not known.
STAGES = ("idle", "stalled", "overload", "queueing", "prefill", "decode", "batch", "cache", "healthy",
          "unknown")
STATS = ("mean", "median", "p99")

MODEL_LEVERS = ("model-level levers, only now (模型层面的手段，最后才看): quantization (量化), "
                "speculative decoding (投机解码), tensor/pipeline parallelism (并行) — see the later chapters")
REST = ["batch size vs crossover (批大小对照交叉点)", "prefix-cache hit rate (前缀缓存命中率)", MODEL_LEVERS]
STEP_2_3_KEYS = ("mean_batch_size", "crossover", "max_num_seqs", "prefix_cache_hit_rate", "prefix_share")
CHUNK_NOTE = ("; inter-token gaps spike too, so also cap the prefill per step (enable_chunked_prefill, "
              "a smaller max_num_batched_tokens) (出字间隔也有尖峰：顺便打开分块预填充、减小 token 预算)")


@dataclass
class Diagnosis:
    """What ``diagnose`` found, the numbers behind it, and what to do about it.

    ``stage`` is where in the tuning order the problem sits: ``"queueing"``,
    ``"prefill"``, ``"overload"``, ``"decode"`` (step 1: which stage is slow),
    ``"batch"`` (step 2), ``"cache"`` (step 3) or ``"healthy"`` (step 4: only
    model-level levers left); ``"unknown"`` when step 1 lacks its numbers.
    ``evidence`` maps each quantity used to its value, with the threshold it
    was compared against; ``unknown`` maps each quantity a step needed but did
    not have to the reason.
    """
    stage: str
    finding: str                # one Chinese sentence (English in parentheses)
    action: str
    evidence: dict = field(default_factory=dict)
    next: list = field(default_factory=list)
    unknown: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"[{self.stage}] {self.finding}", f"  action: {self.action}"]
        for key, value in self.evidence.items():
            lines.append(f"  {key}: {format_value(value)}")
        by_reason: dict[str, list[str]] = {}
        for key, reason in self.unknown.items():
            by_reason.setdefault(reason, []).append(key)
        for reason, keys in by_reason.items():
            lines.append(f"  {', '.join(keys)}: unknown ({reason})")
        if self.next:
            lines.append("  next: " + "; ".join(self.next))
        return "\n".join(lines)


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        return " vs ".join(format_value(v) for v in value)
    return str(value)


# ---- the steps -------------------------------------------------------------------------

ADD_CAPACITY = "add capacity (more replicas/GPUs) or rate-limit admissions (加容量：更多副本/卡；或者限流)"


def idle(f: Facts) -> Diagnosis:
    """Nothing finished, nothing was generated, nothing is held: there is nothing to judge."""
    f.add(("request_throughput", "output_throughput") + LOAD_KEYS[:3])
    f.add_batch()
    return Diagnosis("idle", "这个窗口里没有流量：没有请求完成、没有生成 token、也没有请求在跑或排队，无从判断"
                     "(no traffic in this window: nothing to judge).",
                     "diagnose a window with traffic in it (send load, or widen the window) "
                     "(换一个有流量的窗口再诊断)", f.evidence, [], f.unknown)


def stalled(f: Facts) -> Diagnosis:
    """Requests are held but not one token came out: the server is stuck, not slow."""
    f.add(("output_throughput", "request_throughput") + LOAD_KEYS[:4] + MEMORY_KEYS)
    f.add_batch()
    return Diagnosis("stalled", "有请求在跑或在排队，整个窗口却一个 token 也没生成：服务器卡住了"
                     "(requests are held but no token was generated in the whole window: the server is "
                     "stalled, not slow).",
                     "check the server itself: a hung step or collective, a dead worker, its logs; restart "
                     "it if it does not recover (查服务器本身：卡死的一步、挂掉的 worker、日志)",
                     f.evidence, REST, f.unknown)


def token_budget(f: Facts) -> Diagnosis:
    """Seats and KV free, a queue, every step the same size: the token budget throttles."""
    f.add(("step_token_ceiling", "step_share_at_ceiling", "queue_length_at_end", "mean_kv_usage"))
    f.add_batch()
    return Diagnosis("batch", "请求在排队，座位和 KV 缓存却都空着，而每一步都停在同一个 token 数上：是每步的 "
                     "token 预算卡住了准入"
                     "(requests wait while seats and KV cache are free, and every step carries the same "
                     "number of tokens: the per-step token budget throttles admission).",
                     "raise --max-num-batched-tokens (SGLang: --chunked-prefill-size) before adding "
                     "capacity (先调大每步的 token 预算，再考虑加容量)", f.evidence, REST[1:], f.unknown)


def overload(f: Facts) -> Diagnosis:
    if f.budget_bound:
        return token_budget(f)
    f.add(LOAD_KEYS + MEMORY_KEYS)
    f.add_batch()
    f.add_cache()
    action = f.free_capacity or ADD_CAPACITY
    if f.spike is not None:
        f.add_spike()
        if f.spike >= ITL_SPIKE and not f.free_capacity:
            action += CHUNK_NOTE
    return Diagnosis("overload", "首字和出字一起超标，首字的时间花在排队上：请求来得比处理得快（过载）"
                     "(TTFT and TPOT both miss and TTFT goes to the queue: requests arrive faster than they "
                     "are served).", action, f.evidence, REST, f.unknown)


def long_prompts(f: Facts) -> Diagnosis:
    """Both miss but TTFT is not spent queueing: whole long prefills delay first tokens and
    stall the decodes sharing their steps. More replicas would not shorten a prefill."""
    if f.queue_share is not None:
        f.evidence[f"queue share of TTFT (queueing at >= {QUEUE_SHARE:.0%})"] = f.queue_share
    f.add(("max_queue_length", "queue_growth_rate", "prefill_token_share", "median_itl", "p99_itl"))
    if f.spike is not None:
        f.add_spike()
    f.add_batch()
    return Diagnosis("prefill", "首字和出字一起超标，却几乎不排队：长提示词整段预填充，既推迟了首字，又卡住了同一步里的解码"
                     "(TTFT and TPOT both miss, yet almost nothing queues: long prompts prefilled whole delay "
                     "first tokens and stall the decodes that share their steps).",
                     "enable chunked prefill (vLLM --enable-chunked-prefill) or lower --max-num-batched-tokens, "
                     "so that a long prompt is prefilled in pieces between decode steps; more replicas would not "
                     "help, nothing is waiting (打开分块预填充或减小 token 预算；加副本没用，并没有请求在排队)",
                     f.evidence, REST, f.unknown)


def slow_steps(f: Facts) -> Diagnosis:
    """Both miss, nothing queues and the gaps are even: every step is slow, prefills and
    decodes alike (too large a batch, or the hardware's floor)."""
    if f.queue_share is not None:
        f.evidence[f"queue share of TTFT (queueing at >= {QUEUE_SHARE:.0%})"] = f.queue_share
    f.add(("max_queue_length", "median_itl", "p99_itl", "mean_step_time"))
    f.add_spike()
    f.add_batch()
    past = f.batch is not None and f.crossover is not None and f.batch > f.crossover
    action = ("lower max_num_seqs toward the crossover (把 max_num_seqs 调回交叉点附近)" if past else
              "fewer/shorter contexts per step (lower max_num_seqs); if the steps are at the bandwidth floor, "
              + MODEL_LEVERS)
    return Diagnosis("decode", "首字和出字一起超标，却几乎不排队、出字间隔也没有尖峰：每一步本身就慢，预填充和解码一起慢"
                     "(TTFT and TPOT both miss, yet almost nothing queues and the gaps are even: every step is "
                     "slow, prefills and decodes alike).", action, f.evidence, REST[1:], f.unknown)


def backlogged(f: Facts) -> Diagnosis:
    """Latency holds or is unknown, yet the queue grows: overload before it shows in the
    histograms (a queued request is observed only once served), or nothing is served."""
    if f.budget_bound:
        return token_budget(f)
    f.add(LOAD_KEYS)
    rule = ("the queue grows while the batch is at max_num_seqs" if f.growing_at_cap else
            f"arrival_rate > {ARRIVAL_EXCESS:g} x request_throughput and queue_growth_rate >= "
            f"{QUEUE_ABSORBS:.0%} of arrival_rate")
    f.evidence[f"rule: {rule}"] = "holds"
    f.add(MEMORY_KEYS)
    f.add_batch()
    f.add_cache()
    if f.opt["request_throughput"] == 0:
        return Diagnosis("overload", "窗口里没有一个请求完成，队列却在变长：服务器卡住了，或严重过载"
                         "(nothing finished in the window while the queue grew: the server is wedged or "
                         "badly overloaded).",
                         "check the server first (a stuck step, a dead worker, its logs); once it serves "
                         "again, add capacity or rate-limit admissions (先查服务器是否卡死，再加容量或限流)",
                         f.evidence, REST, f.unknown)
    action = f.free_capacity or ADD_CAPACITY
    breach = f.add_breach()
    zh, en = (("批已到上限，队列在变长", "the batch is at its cap and the queue grows") if f.growing_at_cap else
              ("请求来得比完成得快，队列在变长", "requests arrive faster than they finish and the queue grows"))
    return Diagnosis("overload", f"{zh}：过载刚开始，排队的请求还没进入延迟直方图{breach}"
                     f"({en}: overload is starting, and queued requests are not in the latency histograms yet).",
                     action, f.evidence, REST, f.unknown)


def slow_first_token(f: Facts) -> Diagnosis:
    """TTFT misses, TPOT holds: queueing if the queue takes most of TTFT, else prefill."""
    if f.queue_share is not None:
        f.evidence[f"queue share of TTFT (queueing at >= {QUEUE_SHARE:.0%})"] = f.queue_share
    f.add(("max_queue_length", "queue_growth_rate"))
    if f.queued:
        if f.budget_bound:
            return token_budget(f)
        f.add(("arrival_rate", "request_throughput") + MEMORY_KEYS)
        f.add_batch()
        f.add_cache()
        action = f.free_capacity or ("add capacity or rate-limit; a scheduler that lets short prompts "
                                     "pass (sjf, chunked prefill) cuts head-of-line blocking "
                                     "(加容量或限流；让短请求先走可缓解队头阻塞)")
        if f.spike is not None and f.spike >= ITL_SPIKE and not f.free_capacity:
            f.add_spike()
            action += CHUNK_NOTE
        return Diagnosis("queueing", "首字慢、出字正常，时间花在排队上"
                         "(TTFT is slow, TPOT is fine, and the time goes to waiting in the queue).",
                         action, f.evidence, REST, f.unknown)
    f.add(("prefill_token_share",))
    if f.spike is not None and f.spike >= ITL_SPIKE:
        f.add(("median_itl", "p99_itl"))
        f.add_spike()
        return Diagnosis("prefill", "首字慢、几乎不排队，出字间隔却有尖峰：长提示词整段预填充，占住了整步"
                         "(TTFT is slow with almost no queue, and inter-token gaps spike: long prompts are "
                         "prefilled whole and hold entire steps).",
                         "enable chunked prefill (vLLM --enable-chunked-prefill) with a smaller "
                         "--max-num-batched-tokens, so that long prompts are prefilled in pieces (打开分块预填充、"
                         "减小 token 预算)", f.evidence, REST, f.unknown)
    f.add_cache()
    action = (f.fix_cache if f.cache_lost else
              "reuse prefixes (enable_prefix_caching, cache-aware routing), shorten prompts, "
              "or give prefill its own GPUs (disaggregation) (复用前缀、缩短提示词、预填充/解码分离)")
    return Diagnosis("prefill", "首字慢、出字正常，而排队很短：预填充本身慢"
                     "(TTFT is slow, TPOT is fine and queueing is short: the prefill itself is slow).",
                     action, f.evidence, REST, f.unknown)


def slow_decode(f: Facts) -> Diagnosis:
    """TPOT misses, TTFT holds: stalled by prefills, past the crossover, crowded by
    recomputed prefills, or at the bandwidth floor."""
    f.add(("median_itl", "p99_itl", "prefill_token_share", "mean_step_time"))
    f.add_batch()
    if f.spike is not None:
        f.add_spike()
    if f.spike is not None and f.spike >= ITL_SPIKE:
        return Diagnosis("decode", "出字慢、首字正常，出字间隔有尖峰：长预填充卡住了解码"
                         "(TPOT is slow, TTFT is fine, and inter-token gaps spike: long prefills stall decodes).",
                         "enable_chunked_prefill with a smaller max_num_batched_tokens, or decode-first "
                         "(打开分块预填充、减小 token 预算，或解码优先)", f.evidence, REST, f.unknown)
    if f.batch is not None and f.crossover is not None and f.batch > f.crossover:
        return Diagnosis("decode", "出字慢、首字正常，批已超过交叉点：每步受算力限制、变长"
                         "(TPOT is slow, TTFT is fine, and the batch is past the crossover: steps are compute-bound).",
                         "lower max_num_seqs toward the crossover (把 max_num_seqs 调回交叉点附近)",
                         f.evidence, REST[1:], f.unknown)
    if f.batch is not None and f.weights_crossover is not None and f.batch > f.weights_crossover:
        return Diagnosis("decode", "出字慢、首字正常，批已超过只读权重时的交叉点，但上下文长：每步读 KV 的时间"
                         "压过了计算，仍受显存带宽限制"
                         "(TPOT is slow, TTFT is fine, and the batch is past the weights-only crossover, but at "
                         "this context the KV reads outweigh the compute: steps are memory-bound).",
                         "lower max_num_seqs toward the weights-only crossover: past it the weights are already "
                         "shared, and each further request only adds its KV read to every step "
                         "(把 max_num_seqs 调回只读权重时的交叉点附近)", f.evidence, REST[1:], f.unknown)
    f.add_cache()
    if f.cache_lost:
        return Diagnosis("decode", "出字慢、首字正常，而前缀命中率低：重复的预填充挤占了解码步"
                         "(TPOT is slow, TTFT is fine, and prefix hits are low: recomputed prefills "
                         "crowd the decode steps).", f.free_capacity, f.evidence, REST[1:], f.unknown)
    if f.itl_unknown:
        return Diagnosis("decode", "出字慢、首字正常，但不知道出字间隔的分布：分不清是长预填充卡住了解码，还是每步卡在带宽下限"
                         "(TPOT is slow and TTFT is fine, but without inter-token gaps a prefill stall cannot be "
                         "told from the bandwidth floor).",
                         "try enable_chunked_prefill with a smaller max_num_batched_tokens first (cheap; it helps "
                         "if long prompts stall decodes); if TPOT does not move, the steps are at the bandwidth "
                         "floor: " + MODEL_LEVERS + " (先试分块预填充；TPOT 不动，才是带宽下限)",
                         f.evidence, REST[1:], f.unknown)
    if f.batch is None or f.crossover is None:
        return Diagnosis("decode", "出字慢、首字正常，没有停顿；不知道交叉点，分不清每步受带宽还是算力限制"
                         "(TPOT is slow, TTFT is fine and decodes are not stalled; without the crossover, "
                         "a bandwidth-bound step cannot be told from a compute-bound one).",
                         "give the GPU and the model (--hardware, --model-spec) to place the batch against "
                         "the crossover; meanwhile fewer/shorter contexts per step (lower max_num_seqs) "
                         "(给出 GPU 与模型以对照交叉点)", f.evidence, REST[1:], f.unknown)
    return Diagnosis("decode", "出字慢、首字正常，批在交叉点以下：每步被显存带宽（读权重和 KV）卡住"
                     "(TPOT is slow, TTFT is fine, the batch is below the crossover: each step is bound "
                     "by memory bandwidth, reading weights and KV).",
                     "fewer/shorter contexts per step (lower max_num_seqs), then " + MODEL_LEVERS,
                     f.evidence, REST[1:], f.unknown)


def batch_and_cache(f: Facts) -> Diagnosis:
    """Steps 2-4, once every SLO holds: batch vs crossover, prefix hits, then the model."""
    f.add_batch()
    if f.capped and f.small:
        return Diagnosis("batch", "延迟达标，但批被 max_num_seqs 卡在交叉点以下：权重读取没摊薄，吞吐还有余量"
                         "(latency SLOs hold, but max_num_seqs caps the batch far below the crossover: "
                         "weight reads are poorly amortised and throughput is left on the table).",
                         f.raise_batch, f.evidence, REST[1:], f.unknown)
    if f.prefix_share is not None and f.prefix_share > 0:
        f.add_cache()
        if f.cache_lost:
            return Diagnosis("cache", "前缀本可复用，命中率却很低：预填充在重复计算"
                             "(prompts share prefixes but the cache hit rate is low: prefill is recomputed).",
                             f.fix_cache, f.evidence, [MODEL_LEVERS], f.unknown)
    elif f.hit is not None:
        f.evidence["prefix_cache_hit_rate"] = f.hit
    # Steps 1 to 3 could only look at what was known: say so.
    partial = any(key in f.unknown for key in STEP_2_3_KEYS + tuple(f"{s}_tpot" for s in STATS))
    zh, en = ("就已知的指标而言，", " as far as the exported metrics show") if partial else ("", "")
    return Diagnosis("healthy", f"{zh}延迟达标，批大小与缓存都没有明显短板：这时才轮到模型层面的手段"
                     f"(SLOs hold and batch and cache show no gap{en}: only now do model-level levers apply).",
                     MODEL_LEVERS, f.evidence, [], f.unknown)


def undetermined(f: Facts, missing: list[str]) -> Diagnosis:
    """Step 1 needs both percentiles; without one the order cannot start."""
    f.add(LOAD_KEYS + MEMORY_KEYS)
    f.add_batch()
    return Diagnosis("unknown", "不知道慢在哪一段：缺少 " + "、".join(missing) +
                     f"(cannot tell which stage is slow without {', '.join(missing)}).",
                     "export the latency histograms, or widen the window so that requests finish "
                     "inside it (导出延迟直方图，或加长观察窗口)", f.evidence, REST, f.unknown)


def diagnose(summary: dict, ttft_slo: float, tpot_slo: float, *, crossover=None,
             max_num_seqs: int | None = None, prefix_share: float | None = None,
             routing: str | None = None, stat: str = "p99", unknown: dict | None = None) -> Diagnosis:
    """Walk the chapter's tuning order (module docstring) over a serving summary and
    return the first problem.

    ``summary`` is ``SimResult.summary()`` / ``ClusterResult.summary()`` / ``summarize()``;
    it must hold ``{stat}_ttft`` and ``{stat}_tpot`` unless ``unknown`` says why one is
    missing. Other keys (``mean_batch_size``, ``mean_queue_time``, ``mean_ttft``,
    ``max_queue_length``, ``queue_growth_rate``, ``median_itl``, ``p99_itl``,
    ``prefix_cache_hit_rate``, ``mean_kv_usage``, ``num_preemptions``...) add evidence
    when present. ``unknown`` (key -> reason) names what the source could not tell.
    ``crossover`` is a batch size, or a function of the context length
    (``functools.partial(hardware.crossover_batch, hw, model, dtype)``) read at
    ``mean_context_len``.
    """
    if not isinstance(summary, dict):
        raise ValueError(f"summary must be a dict, got {type(summary).__name__}")
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    ttft_slo, tpot_slo = positive("ttft_slo", ttft_slo), positive("tpot_slo", tpot_slo)
    check_knobs(max_num_seqs, prefix_share, routing)
    unknown = check_unknown(unknown)
    crossover, weights_crossover = resolve_crossover(
        crossover, number(summary, "mean_context_len", required=False), unknown)
    slos = {f"{stat}_ttft": ttft_slo, f"{stat}_tpot": tpot_slo}
    # A {stat} of TPOT the source cannot tell, with its mean known: judged by the mean
    # (a mean that misses is slow; one that holds says nothing of the tail, and "healthy"
    # then says it saw only part).
    if f"{stat}_tpot" not in summary and f"{stat}_tpot" in unknown and "mean_tpot" in summary:
        slos = {f"{stat}_ttft": ttft_slo, "mean_tpot": tpot_slo}
    missing = [key for key in slos if key not in summary and key in unknown]
    values = {key: number(summary, key) if key not in missing else float("nan") for key in slos}
    ttft, tpot = values.values()
    if ttft != ttft and not missing:
        raise ValueError(f"summary: {stat}_ttft is NaN (no completed requests to diagnose)")
    def label(key):
        judged_by_mean = key == "mean_tpot" and stat != "mean"
        return f"{key} (s) vs {key.split('_')[1]}_slo" + (f" ({stat}_tpot unknown)" if judged_by_mean else "")
    facts = Facts(ttft, tpot, ttft_slo, number(summary, "mean_batch_size", required=False), crossover,
                  weights_crossover, max_num_seqs, prefix_share, routing,
                  opt={k: number(summary, k, required=False) for k in OPTIONAL_KEYS},
                  evidence={label(key): (values[key], slo) for key, slo in slos.items() if key not in missing},
                  unknown=unknown)
    quiet = no_tokens(facts)
    if quiet and not facts.backlog:
        held = (facts.batch or 0) + (facts.opt["max_queue_length"] or 0)
        return stalled(facts) if held > 0 else idle(facts)
    if missing:
        return backlogged(facts) if facts.backlog else undetermined(facts, missing)
    ttft_slow, tpot_slow = ttft > ttft_slo, tpot == tpot and tpot > tpot_slo
    if ttft_slow and tpot_slow:
        if facts.queued or facts.backlog:
            return overload(facts)
        return slow_steps(facts) if facts.spike is not None and facts.spike < ITL_SPIKE else long_prompts(facts)
    if ttft_slow:
        return slow_first_token(facts)
    if tpot_slow:
        return slow_decode(facts)
    if facts.backlog:
        return backlogged(facts)
    return batch_and_cache(facts)
