"""Latency and throughput metrics, defined as vLLM's serving benchmark defines them.

* TTFT (time to first token, 首字延迟): first token time - arrival time.
* TPOT (time per output token, 出字速度): (e2e - ttft) / (output tokens - 1);
  undefined for a one-token output.
* ITL (inter-token latency): the gaps between consecutive output tokens.
* E2E: finish time - arrival time.
* Throughput: output tokens (or requests) per second of wall time.
* Goodput: requests per second that met every latency SLO (TTFT, TPOT, E2E).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    tokenize_time: float = 0.0
    detokenize_time: float = 0.0
    # (step start time, tokens computed) for each step that ran this request:
    # prefill chunks first, then one token per decode step.
    schedule_log: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Time spent waiting before the first step that ran any of the request's tokens."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2 or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class StepStats:
    """One engine step: what ran, how long it took, what was left waiting."""
    start: float
    duration: float
    schedule_time: float        # scheduler + engine bookkeeping, outside the model
    prepare_time: float         # packing the batch into tensors for the model
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    num_used_blocks: int
    kv_usage: float
    # (request_id, num_new_tokens) of every request in the batch, in plan order.
    batch: list[tuple[str, int]] = field(default_factory=list)


def request_metrics(request) -> RequestMetrics:
    """A snapshot of a ``tinyserve.request.Request``'s timestamps and counters."""
    return RequestMetrics(
        arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time, finished_time=request.finished_time,
        token_times=list(request.token_times), num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids), num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions, tokenize_time=request.tokenize_time,
        detokenize_time=request.detokenize_time, schedule_log=list(request.schedule_log))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _describe(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        nan = float("nan")
        return {f"mean_{prefix}": nan, f"median_{prefix}": nan, f"p99_{prefix}": nan}
    return {f"mean_{prefix}": statistics.fmean(values),
            f"median_{prefix}": percentile(values, 50),
            f"p99_{prefix}": percentile(values, 99)}


def meets_slo(m: RequestMetrics, ttft_slo: float | None = None, tpot_slo: float | None = None,
              e2e_slo: float | None = None) -> bool:
    """Did a finished request meet every SLO given (seconds)? A one-token output has no TPOT."""
    if m.finished_time is None:
        return False
    if ttft_slo is not None and m.ttft > ttft_slo:
        return False
    if tpot_slo is not None and m.tpot is not None and m.tpot > tpot_slo:
        return False
    return e2e_slo is None or m.e2e <= e2e_slo


def summarize(metrics: list[RequestMetrics], duration: float | None = None,
              ttft_slo: float | None = None, tpot_slo: float | None = None,
              e2e_slo: float | None = None) -> dict[str, float]:
    """Aggregate per-request metrics (seconds) into a benchmark summary.

    ``duration`` defaults to first arrival → last finish. With any SLO given,
    ``goodput`` is the rate of requests that met all of them (requests/s) and
    ``slo_attainment`` their share of the completed requests.
    """
    done = [m for m in metrics if m.finished_time is not None]
    if duration is None and done:
        duration = max(m.finished_time for m in done) - min(m.arrival_time for m in done)
    output_tokens = sum(m.num_output_tokens for m in done)
    summary = {
        "completed": len(done),
        "duration": duration or 0.0,
        "total_output_tokens": output_tokens,
        "output_throughput": output_tokens / duration if duration else float("nan"),
        "request_throughput": len(done) / duration if duration else float("nan"),
    }
    if (ttft_slo, tpot_slo, e2e_slo) != (None, None, None):
        good = sum(meets_slo(m, ttft_slo, tpot_slo, e2e_slo) for m in done)
        summary["goodput"] = good / duration if duration else float("nan")
        summary["slo_attainment"] = good / len(done) if done else float("nan")
    summary.update(_describe("ttft", [m.ttft for m in done if m.ttft is not None]))
    summary.update(_describe("tpot", [m.tpot for m in done if m.tpot is not None]))
    summary.update(_describe("itl", [gap for m in done for gap in m.itl]))
    summary.update(_describe("e2e", [m.e2e for m in done]))
    return summary


# ---- diagnose: the chapter's order of tuning ---------------------------------------

#: Every stage ``diagnose`` may return, in the order it looks.
STAGES = ("overload", "queueing", "prefill", "decode", "batch", "cache", "healthy")
_STATS = ("mean", "median", "p99")

# Thresholds (documented, returned in the evidence so a reader sees the rule applied).
QUEUE_SHARE = 0.5        # queueing dominates TTFT when queue time is at least this share of it
ITL_SPIKE = 6.0          # p99 ITL this many times the median ITL: decodes are being stalled
BATCH_CAPPED = 0.75      # mean batch >= this share of max_num_seqs: the cap is binding
SMALL_BATCH = 0.5        # a capped batch below this share of the crossover amortises poorly
CACHE_MISS = 0.5         # hit rate below this share of the expected prefix share: reuse is lost


@dataclass
class Diagnosis:
    """What ``diagnose`` found, the numbers behind it, and what to do about it.

    ``stage`` is where in the tuning order the problem sits: ``"queueing"``,
    ``"prefill"``, ``"overload"``, ``"decode"`` (step 1: which stage is slow),
    ``"batch"`` (step 2), ``"cache"`` (step 3) or ``"healthy"`` (step 4: only
    model-level levers left). ``evidence`` maps each quantity used
    to its value, with the threshold it was compared against.
    """
    stage: str
    finding: str                # one Chinese sentence (English in parentheses)
    action: str
    evidence: dict = field(default_factory=dict)
    next: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"[{self.stage}] {self.finding}", f"  action: {self.action}"]
        for key, value in self.evidence.items():
            lines.append(f"  {key}: {_fmt(value)}")
        if self.next:
            lines.append("  next: " + "; ".join(self.next))
        return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        return " vs ".join(_fmt(v) for v in value)
    return str(value)


_MODEL_LEVERS = ("model-level levers, only now (模型层面的手段，最后才看): quantization (量化), "
                 "speculative decoding (投机解码), tensor/pipeline parallelism (并行) — see the later chapters")


def _number(summary: dict, key: str, required: bool = True) -> float | None:
    if key not in summary:
        if required:
            raise ValueError(f"summary: missing key {key!r} (pass SimResult.summary(...) or summarize(...))")
        return None
    value = summary[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"summary: {key!r} must be a number, got {value!r}")
    return float(value)


def _positive(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def diagnose(summary: dict, ttft_slo: float, tpot_slo: float, *, crossover: float | None = None,
             max_num_seqs: int | None = None, prefix_share: float | None = None,
             routing: str | None = None, stat: str = "p99") -> Diagnosis:
    """Walk the chapter's tuning order over a serving summary and return the first problem.

    1. Which stage is slow: ``{stat}_ttft`` against ``ttft_slo`` and ``{stat}_tpot``
       against ``tpot_slo`` (seconds). TTFT slow alone → queueing or prefill (told
       apart by ``mean_queue_time / mean_ttft``); TPOT slow alone → decode steps
       (stalled by prefills, too large a batch, or the bandwidth floor); both →
       overload (queue length; add capacity or rate-limit).
    2. Batch size: ``mean_batch_size`` against ``crossover`` and ``max_num_seqs``.
    3. Prefix cache: ``prefix_cache_hit_rate`` against ``prefix_share`` (the share of
       prompt tokens you expect to be a reusable prefix) and the ``routing`` policy.
    4. Only then model-level levers (quantization, speculative decoding, parallelism).

    ``summary`` is ``SimResult.summary()`` / ``ClusterResult.summary()`` / ``summarize()``;
    it must hold ``{stat}_ttft`` and ``{stat}_tpot``. Other keys (``mean_batch_size``,
    ``mean_queue_time``, ``mean_ttft``, ``max_queue_length``, ``queue_growth_rate``,
    ``median_itl``, ``p99_itl``, ``prefix_cache_hit_rate``...) add evidence when present.
    """
    if not isinstance(summary, dict):
        raise ValueError(f"summary must be a dict, got {type(summary).__name__}")
    if stat not in _STATS:
        raise ValueError(f"stat must be one of {_STATS}, got {stat!r}")
    ttft_slo = _positive("ttft_slo", ttft_slo)
    tpot_slo = _positive("tpot_slo", tpot_slo)
    crossover = _positive("crossover", crossover, allow_none=True)
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool)
                                     or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    if prefix_share is not None and (not isinstance(prefix_share, (int, float)) or not 0 <= prefix_share <= 1):
        raise ValueError(f"prefix_share must be in [0, 1], got {prefix_share!r}")
    if routing is not None and not isinstance(routing, str):
        raise ValueError(f"routing must be a policy name (str), got {routing!r}")
    ttft = _number(summary, f"{stat}_ttft")
    tpot = _number(summary, f"{stat}_tpot")
    batch = _number(summary, "mean_batch_size", required=False)
    if ttft != ttft:
        raise ValueError(f"summary: {stat}_ttft is NaN (no completed requests to diagnose)")
    opt = {k: _number(summary, k, required=False) for k in (
        "mean_ttft", "mean_queue_time", "max_queue_length", "queue_growth_rate", "arrival_rate",
        "request_throughput", "median_itl", "p99_itl", "prefix_cache_hit_rate", "prefill_token_share",
        "mean_step_time")}
    ttft_slow, tpot_slow = ttft > ttft_slo, tpot == tpot and tpot > tpot_slo
    evidence = {f"{stat}_ttft (s) vs ttft_slo": (ttft, ttft_slo),
                f"{stat}_tpot (s) vs tpot_slo": (tpot, tpot_slo)}
    capped = batch is not None and max_num_seqs is not None and batch >= BATCH_CAPPED * max_num_seqs
    small = batch is not None and crossover is not None and batch < SMALL_BATCH * crossover
    batch_evidence = {"mean_batch_size": batch} if batch is not None else {}
    if max_num_seqs is not None:
        batch_evidence[f"max_num_seqs (capped at >= {BATCH_CAPPED:.0%})"] = max_num_seqs
    if crossover is not None:
        batch_evidence[f"crossover (small below {SMALL_BATCH:.0%})"] = crossover
    raise_batch = ("raise max_num_seqs toward the crossover (把 max_num_seqs 调大，向交叉点靠拢)"
                   if capped and small else None)
    hit = opt["prefix_cache_hit_rate"]
    cache_lost = (prefix_share is not None and prefix_share > 0
                  and (hit is None or hit < CACHE_MISS * prefix_share))
    if cache_lost:
        fix_cache = ("route cache-aware so each prefix lands where it is cached (改用缓存感知路由)"
                     if routing is not None and routing != "cache_aware" else
                     "enable_prefix_caching=True, and cache-aware routing across replicas (打开前缀缓存)")
    # Capacity the engine already has comes before buying more: first a batch capped below
    # the crossover, then prefills recomputed for lack of cache hits.
    free_capacity = raise_batch or (fix_cache + " — prefill is being recomputed (预填充在重复计算)"
                                    if cache_lost else None)
    spike = (opt["p99_itl"] / opt["median_itl"]
             if opt["p99_itl"] is not None and opt["median_itl"] else None)
    spike_key = f"p99_itl / median_itl (stalls at >= {ITL_SPIKE:g})"
    chunk_note = ("; inter-token gaps spike too, so also cap the prefill per step (enable_chunked_prefill, "
                  "a smaller max_num_batched_tokens) (出字间隔也有尖峰：顺便打开分块预填充、减小 token 预算)")
    rest = ["batch size vs crossover (批大小对照交叉点)", "prefix-cache hit rate (前缀缓存命中率)", _MODEL_LEVERS]

    def cache_evidence():
        if prefix_share is not None and prefix_share > 0:
            evidence[f"prefix_cache_hit_rate (low below {CACHE_MISS:.0%} of expected)"] = (
                hit if hit is not None else float("nan"))
            evidence["expected prefix_share"] = prefix_share
            if routing is not None:
                evidence["routing"] = routing

    def with_optional(keys):
        for key in keys:
            if opt[key] is not None:
                evidence[key] = opt[key]

    # Step 1: which stage is slow.
    if ttft_slow and tpot_slow:
        with_optional(("max_queue_length", "queue_growth_rate", "arrival_rate", "request_throughput"))
        evidence.update(batch_evidence)
        cache_evidence()
        action = free_capacity or ("add capacity (more replicas/GPUs) or rate-limit admissions "
                                   "(加容量：更多副本/卡；或者限流)")
        if spike is not None:
            evidence[spike_key] = spike
            if spike >= ITL_SPIKE and not free_capacity:
                action += chunk_note
        return Diagnosis("overload", "首字和出字一起超标，队列在变长：请求来得比处理得快（过载）"
                         "(TTFT and TPOT both miss and the queue grows: requests arrive faster than they "
                         "are served).",
                         action, evidence, rest)
    if ttft_slow:
        share = None
        if opt["mean_queue_time"] is not None and opt["mean_ttft"]:
            share = opt["mean_queue_time"] / opt["mean_ttft"]
            evidence[f"queue share of TTFT (queueing at >= {QUEUE_SHARE:.0%})"] = share
        with_optional(("max_queue_length", "queue_growth_rate"))
        if share is None or share >= QUEUE_SHARE:
            evidence.update(batch_evidence)
            cache_evidence()
            action = free_capacity or ("add capacity or rate-limit; a scheduler that lets short prompts "
                                       "pass (sjf, chunked prefill) cuts head-of-line blocking "
                                       "(加容量或限流；让短请求先走可缓解队头阻塞)")
            if spike is not None and spike >= ITL_SPIKE and not free_capacity:
                evidence[spike_key] = spike
                action += chunk_note
            return Diagnosis("queueing", "首字慢、出字正常，时间花在排队上"
                             "(TTFT is slow, TPOT is fine, and the time goes to waiting in the queue).",
                             action, evidence, rest)
        with_optional(("prefill_token_share",))
        cache_evidence()
        action = (fix_cache if cache_lost else
                  "reuse prefixes (enable_prefix_caching, cache-aware routing), shorten prompts, "
                  "or give prefill its own GPUs (disaggregation) (复用前缀、缩短提示词、预填充/解码分离)")
        return Diagnosis("prefill", "首字慢、出字正常，而排队很短：预填充本身慢"
                         "(TTFT is slow, TPOT is fine and queueing is short: the prefill itself is slow).",
                         action, evidence, rest)
    if tpot_slow:
        with_optional(("median_itl", "p99_itl", "prefill_token_share", "mean_step_time"))
        evidence.update(batch_evidence)
        if spike is not None:
            evidence[spike_key] = spike
        if spike is not None and spike >= ITL_SPIKE:
            return Diagnosis("decode", "出字慢、首字正常，出字间隔有尖峰：长预填充卡住了解码"
                             "(TPOT is slow, TTFT is fine, and inter-token gaps spike: long prefills stall decodes).",
                             "enable_chunked_prefill with a smaller max_num_batched_tokens, or decode-first "
                             "(打开分块预填充、减小 token 预算，或解码优先)", evidence, rest)
        if batch is not None and crossover is not None and batch > crossover:
            return Diagnosis("decode", "出字慢、首字正常，批已超过交叉点：每步受算力限制、变长"
                             "(TPOT is slow, TTFT is fine, and the batch is past the crossover: steps are compute-bound).",
                             "lower max_num_seqs toward the crossover (把 max_num_seqs 调回交叉点附近)",
                             evidence, rest[1:])
        cache_evidence()
        if cache_lost:
            return Diagnosis("decode", "出字慢、首字正常，而前缀命中率低：重复的预填充挤占了解码步"
                             "(TPOT is slow, TTFT is fine, and prefix hits are low: recomputed prefills "
                             "crowd the decode steps).", free_capacity, evidence, rest[1:])
        return Diagnosis("decode", "出字慢、首字正常，批在交叉点以下：每步被显存带宽（读权重和 KV）卡住"
                         "(TPOT is slow, TTFT is fine, the batch is below the crossover: each step is bound "
                         "by memory bandwidth, reading weights and KV).",
                         "fewer/shorter contexts per step (lower max_num_seqs), then " + _MODEL_LEVERS,
                         evidence, rest[1:])

    # Step 2: the batch size.
    evidence.update(batch_evidence)
    if capped and small:
        return Diagnosis("batch", "延迟达标，但批被 max_num_seqs 卡在交叉点以下：权重读取没摊薄，吞吐还有余量"
                         "(latency SLOs hold, but max_num_seqs caps the batch far below the crossover: "
                         "weight reads are poorly amortised and throughput is left on the table).",
                         raise_batch, evidence, rest[1:])

    # Step 3: the prefix cache.
    if prefix_share is not None and prefix_share > 0:
        cache_evidence()
        if cache_lost:
            return Diagnosis("cache", "前缀本可复用，命中率却很低：预填充在重复计算"
                             "(prompts share prefixes but the cache hit rate is low: prefill is recomputed).",
                             fix_cache, evidence, [_MODEL_LEVERS])
    elif hit is not None:
        evidence["prefix_cache_hit_rate"] = hit

    # Step 4: nothing left in the engine's layers.
    return Diagnosis("healthy", "延迟达标，批大小与缓存都没有明显短板：这时才轮到模型层面的手段"
                     "(SLOs hold and batch and cache show no gap: only now do model-level levers apply).",
                     _MODEL_LEVERS, evidence, [])
