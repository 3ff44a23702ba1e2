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

import bisect
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


# ---- histograms for a server's /metrics ---------------------------------------------

# Bucket upper bounds (seconds), vLLM's extended down to the milliseconds a small model
# on a CPU takes per token.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
               20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens scheduled in one engine step (prefill + decode), as vLLM's iteration_tokens_total:
# powers of two, so that a step budget of 2^k tokens is a bucket's upper edge.
STEP_TOKEN_BUCKETS = tuple(2 ** k for k in range(15))


class Histogram:
    """Counts of observations per bucket, in Prometheus' conventions: bucket ``le=x``
    counts every observation <= x (cumulative), the last bucket is ``+Inf`` (= count),
    plus the sum and the count. Fixed buckets: memory does not grow with observations."""

    def __init__(self, buckets: tuple[float, ...]):
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be increasing and distinct, got {buckets!r}")
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.buckets) + 1)     # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> "Histogram":
        out = Histogram(self.buckets)
        out._counts, out.sum, out.count = list(self._counts), self.sum, self.count
        return out

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` for every bucket, ending with ``(inf, count)``."""
        out, running = [], 0
        for bound, n in zip(self.buckets + (float("inf"),), self._counts):
            running += n
            out.append((bound, running))
        return out
