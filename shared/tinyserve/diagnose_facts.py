"""What ``tinyserve.diagnose`` reads: a summary's numbers, checked, the thresholds it
compares them with, and what follows from them (``Facts``: is the batch capped, does
the queue grow, do the inter-token gaps spike, is the token budget binding...).

The steps of the tuning order live in ``tinyserve.diagnose``; each asks ``Facts`` and
adds to its ``evidence`` what it looked at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Thresholds (documented, returned in the evidence so a reader sees the rule applied).
QUEUE_SHARE = 0.5        # queueing dominates TTFT when queue time is at least this share of it
ITL_SPIKE = 6.0          # p99 ITL this many times the median ITL: decodes are being stalled
BATCH_CAPPED = 0.75      # mean batch >= this share of max_num_seqs: the cap is binding
SMALL_BATCH = 0.5        # a capped batch below this share of the crossover amortises poorly
CACHE_MISS = 0.5         # hit rate below this share of the expected prefix share: reuse is lost
ARRIVAL_EXCESS = 1.2     # arrivals at least this many times completions ...
QUEUE_ABSORBS = 0.1      # ... and the queue takes at least this share of arrivals: a backlog builds
PINNED_STEPS = 0.9       # this share of steps in one token-count bucket: the steps sit at a ceiling
FREE_KV = 0.8            # KV usage below this: memory is not what keeps requests waiting

OPTIONAL_KEYS = ("mean_ttft", "mean_queue_time", "queue_length_at_start", "queue_length_at_end",
                 "max_queue_length", "queue_growth_rate", "arrival_rate",
                 "request_throughput", "median_itl", "p99_itl", "prefix_cache_hit_rate",
                 "prefill_token_share", "mean_step_time", "mean_kv_usage", "num_preemptions",
                 "output_throughput", "mean_context_len", "step_token_ceiling", "step_share_at_ceiling")
LOAD_KEYS = ("queue_length_at_start", "queue_length_at_end", "max_queue_length", "queue_growth_rate",
             "arrival_rate", "request_throughput")
MEMORY_KEYS = ("mean_kv_usage", "num_preemptions")   # a full KV cache preempts and caps the batch


# ---- reading the inputs ----------------------------------------------------------------

def number(summary: dict, key: str, required: bool = True) -> float | None:
    if key not in summary:
        if required:
            raise ValueError(f"summary: missing key {key!r} (pass SimResult.summary(...) or summarize(...))")
        return None
    value = summary[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"summary: {key!r} must be a number, got {value!r}")
    return float(value)


def positive(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_knobs(max_num_seqs, prefix_share, routing) -> None:
    if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool)
                                     or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    if prefix_share is not None and (not isinstance(prefix_share, (int, float)) or not 0 <= prefix_share <= 1):
        raise ValueError(f"prefix_share must be in [0, 1], got {prefix_share!r}")
    if routing is not None and not isinstance(routing, str):
        raise ValueError(f"routing must be a policy name (str), got {routing!r}")


@dataclass
class Facts:
    """The numbers of one summary and what follows from them; ``evidence`` grows as
    the steps look at them, in the order they look."""
    ttft: float
    tpot: float
    ttft_slo: float
    batch: float | None
    crossover: float | None           # at the window's context length when that is known
    weights_crossover: float | None   # the same with no KV read; None unless crossover is context-aware
    max_num_seqs: int | None
    prefix_share: float | None
    routing: str | None
    opt: dict
    evidence: dict
    unknown: dict = field(default_factory=dict)   # key -> why it is not known

    @property
    def capped(self) -> bool:
        return (self.batch is not None and self.max_num_seqs is not None
                and self.batch >= BATCH_CAPPED * self.max_num_seqs)

    @property
    def small(self) -> bool:
        """Too small to share the weight read: judged against the weights-only crossover,
        since KV reads are per request and no batch shares them."""
        crossover = self.crossover if self.weights_crossover is None else self.weights_crossover
        return self.batch is not None and crossover is not None and self.batch < SMALL_BATCH * crossover

    @property
    def raise_batch(self) -> str | None:
        kv = self.opt["mean_kv_usage"]
        room = kv is None or kv < FREE_KV      # a full KV cache would not hold more seats
        return ("raise max_num_seqs toward the crossover (把 max_num_seqs 调大，向交叉点靠拢)"
                if self.capped and self.small and room else None)

    @property
    def hit(self) -> float | None:
        return self.opt["prefix_cache_hit_rate"]

    @property
    def cache_lost(self) -> bool:
        if self.prefix_share is None or self.prefix_share <= 0:
            return False
        if self.hit is None:        # never looked up counts as lost; not exported cannot be judged
            return "prefix_cache_hit_rate" not in self.unknown
        return self.hit < CACHE_MISS * self.prefix_share

    @property
    def fix_cache(self) -> str:
        if self.routing is not None and self.routing != "cache_aware":
            return "route cache-aware so each prefix lands where it is cached (改用缓存感知路由)"
        return "enable_prefix_caching=True, and cache-aware routing across replicas (打开前缀缓存)"

    @property
    def free_capacity(self) -> str | None:
        """Capacity the engine already has comes before buying more: first a batch capped
        below the crossover, then prefills recomputed for lack of cache hits."""
        if self.raise_batch:
            return self.raise_batch
        return self.fix_cache + " — prefill is being recomputed (预填充在重复计算)" if self.cache_lost else None

    @property
    def spike(self) -> float | None:
        p99, median = self.opt["p99_itl"], self.opt["median_itl"]
        return p99 / median if p99 is not None and median else None

    @property
    def itl_unknown(self) -> bool:
        return self.spike is None and ("p99_itl" in self.unknown or "median_itl" in self.unknown)

    @property
    def queued(self) -> bool:
        """Does the queue take most of TTFT? Without queue times, any request seen
        waiting says yes; with no queue data at all, queueing is assumed."""
        share = self.queue_share
        if share is not None:
            return share >= QUEUE_SHARE
        waiting = self.opt["max_queue_length"]
        return waiting is None or waiting >= 1

    @property
    def queue_share(self) -> float | None:
        if self.opt["mean_queue_time"] is None or not self.opt["mean_ttft"]:
            return None
        return self.opt["mean_queue_time"] / self.opt["mean_ttft"]

    def add(self, keys) -> None:
        for key in keys:
            if self.opt[key] is not None:
                self.evidence[key] = self.opt[key]

    def add_batch(self) -> None:
        if self.batch is not None:
            self.evidence["mean_batch_size"] = self.batch
        if self.max_num_seqs is not None:
            self.evidence[f"max_num_seqs (capped at >= {BATCH_CAPPED:.0%})"] = self.max_num_seqs
        if self.crossover is None:
            return
        context = self.opt["mean_context_len"]
        if self.weights_crossover is None or context is None:
            self.evidence[f"crossover (small below {SMALL_BATCH:.0%})"] = self.crossover
        else:
            self.evidence["mean_context_len"] = context
            self.evidence["crossover at this context"] = self.crossover
            self.evidence[f"crossover with weights only (small below {SMALL_BATCH:.0%})"] = self.weights_crossover

    def add_cache(self) -> None:
        if self.prefix_share is not None and self.prefix_share > 0:
            if self.hit is not None or "prefix_cache_hit_rate" not in self.unknown:
                self.evidence[f"prefix_cache_hit_rate (low below {CACHE_MISS:.0%} of expected)"] = (
                    self.hit if self.hit is not None else float("nan"))
            self.evidence["expected prefix_share"] = self.prefix_share
            if self.routing is not None:
                self.evidence["routing"] = self.routing

    def add_spike(self) -> None:
        self.evidence[f"p99_itl / median_itl (stalls at >= {ITL_SPIKE:g})"] = self.spike

    @property
    def queue_end(self) -> float | None:
        end = self.opt["queue_length_at_end"]
        return self.opt["max_queue_length"] if end is None else end

    @property
    def growing_at_cap(self) -> bool:
        """The queue, still there at the end of the window, grew while the batch sat at its
        cap: nothing more can be admitted. (A simulated run that drains has no end queue.)"""
        growth, end = self.opt["queue_growth_rate"], self.opt["queue_length_at_end"]
        return growth is not None and growth > 0 and self.capped and end is not None and end >= 1

    @property
    def backlog(self) -> bool:
        """Arrivals outpace completions and the queue takes up the difference, or the
        queue grows at all while the batch is at its cap."""
        if self.growing_at_cap:
            return True
        arrival, served, growth = (self.opt[k] for k in ("arrival_rate", "request_throughput",
                                                         "queue_growth_rate"))
        if arrival is None or served is None or growth is None or not arrival < float("inf"):
            return False
        return growth > 0 and arrival > ARRIVAL_EXCESS * served and growth >= QUEUE_ABSORBS * arrival

    def add_breach(self) -> str:
        """How long a new arrival waits now (the queue ahead of it / the completion rate),
        and how long until that passes the TTFT SLO at this growth rate; '' if unknown."""
        served, growth, queue = self.opt["request_throughput"], self.opt["queue_growth_rate"], self.queue_end
        if not served or growth is None or growth <= 0 or queue is None:
            return ""
        wait = queue / served
        self.evidence["new arrival's wait = queue_length_at_end / request_throughput (s)"] = wait
        if wait >= self.ttft_slo:
            return (f"；新来的请求已要等约 {wait:.3g} s，超过首字 SLO (a new arrival already waits about "
                    f"{wait:.3g} s, past the {self.ttft_slo:g} s TTFT SLO)")
        left = (self.ttft_slo - wait) * served / growth
        self.evidence["seconds until that wait passes ttft_slo at this growth"] = left
        return (f"；照这个增速，约 {left:.3g} s 后首字就会超标 (at this growth, TTFT breaks its SLO in "
                f"about {left:.3g} s)")

    @property
    def budget_bound(self) -> bool:
        """Requests wait while seats and KV are free and every step carries the same token
        count: the per-step token budget, not the hardware, holds admissions back."""
        share, kv = self.opt["step_share_at_ceiling"], self.opt["mean_kv_usage"]
        seats_free = (self.batch is not None and self.max_num_seqs is not None
                      and self.batch < BATCH_CAPPED * self.max_num_seqs)
        return (share is not None and share >= PINNED_STEPS and seats_free
                and (kv is None or kv < FREE_KV) and (self.queue_end or 0) >= 1)


def no_tokens(f: Facts) -> bool:
    """Not one token generated (or, where tokens are not counted, not one request finished)."""
    out, done = f.opt["output_throughput"], f.opt["request_throughput"]
    return out == 0 or (out is None and done == 0)


def check_unknown(unknown) -> dict:
    if unknown is None:
        return {}
    if not isinstance(unknown, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in unknown.items()):
        raise ValueError(f"unknown must map keys to reasons (dict of str), got {unknown!r}")
    return dict(unknown)


def resolve_crossover(crossover, context: float | None, unknown: dict) -> tuple:
    """(crossover at the window's context, weights-only crossover or None) from a number
    or a function of the context length."""
    if not callable(crossover):
        return positive("crossover", crossover, allow_none=True), None
    weights = positive("crossover(0)", crossover(0.0))
    if context is None:
        unknown.setdefault("mean_context_len", "not known, so the crossover is the weights-only one "
                                               "(KV reads would move it right)")
        return weights, None
    at = crossover(context)
    if not isinstance(at, (int, float)) or not at > 0:
        raise ValueError(f"crossover({context:g}) must be a positive number, got {at!r}")
    return float(at), weights
