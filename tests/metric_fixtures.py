"""vLLM and SGLang ``/metrics`` fixtures, built offline from each engine's own metric definitions.

vLLM and SGLang cannot run here. Both write their ``/metrics`` with
``prometheus_client``, so each fixture is made the way the engine makes it: the
engine's metric names, types, labels and bucket bounds (as defined in its
source; see ``tinyserve.serving.dialects`` for the files and commits) registered
in a ``prometheus_client`` registry, fed the requests of one scenario, and
written with ``generate_latest()`` twice: before and after ``WINDOW`` seconds of
traffic. Before the window every server has served the same calm traffic, so a
diagnosis that forgot to subtract the first scrape would see it.

    .venv/bin/python tests/metric_fixtures.py      # rewrite tests/fixtures/metrics/

Engines: vLLM's v0.12 names (``vllm``), the v0.11 line (``vllm-0.11``: no per-request
TPOT histogram, the per-token gaps under both names), the v0.8 line (``vllm-0.8``);
SGLang (its scheduler's gauges and retractions labelled ``engine_type``, ``tp_rank``,
``pp_rank``) and its older exposition (``sglang-old``).

Scenarios (values chosen for an A100 serving a 7B model: crossover 153, SLOs
TTFT 0.5 s and TPOT 0.05 s), one request at a time: its TTFT, its inter-token
gaps (TPOT is their mean, E2E is TTFT + their sum), its queue time and lengths:

* ``overload``: 256 running (the cap), the queue grows by 4.5/s, KV cache full,
  preemptions; TTFT ~6 s and every step ~70 ms.
* ``batch_too_small``: ``max_num_seqs`` 8, the queue grows; TTFT ~20 s, almost
  all of it queueing; steps ~11 ms.
* ``long_prompts_unchunked``: no queue; 8% of the gaps are ~0.6 s stalls behind
  a whole long prefill, the rest ~15 ms.
* ``low_hit_rate``: SLOs hold, 15% of prompt tokens hit the prefix cache where
  90% could.
* ``healthy``: the same with 85% hits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tinyserve.serving.histogram import Histogram as ScrapedHistogram
from tinyserve.serving.live_diagnose import diagnose_window
from tinyserve.serving.scrape import Window, histograms_by_series, parse_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
WINDOW = 60.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# ---- each engine's definitions (names, types, bucket bounds as its source has them) -------

VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_STEP_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_E2E = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
              1800, 2400]
SGLANG_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
              0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
SGLANG_QUEUE = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
                300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]
# Older SGLang (docs/references/production_metrics.md at 40ef116): the per-token histogram's name
SGLANG_OLD_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 15.0, 20.0, 25.0, 30.0]
SGLANG_OLD_TOKEN = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5]
SGLANG_OLD_E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]


@dataclass
class Engine:
    """One engine version's /metrics: role -> metric definition."""
    name: str
    labels: dict
    gauges: dict                      # role -> name
    counters: dict                    # role -> name (as the source passes it to Counter)
    histograms: dict                  # role -> (name, buckets)
    finished_reasons: tuple = ()      # vLLM labels request_success by finished_reason
    scenarios: tuple = ()             # () = all of them
    rank_labels: dict = field(default_factory=dict)   # what the scheduler's metrics add (SGLang: its ranks)


#: Roles an SGLang scheduler reports (with its rank labels); its tokenizer manager reports the rest.
SCHEDULER_ROLES = {"running", "waiting", "kv_usage", "prefix_hit_rate", "preemptions"}
SGLANG_LABELS = {"model_name": MODEL, "engine_type": "unified"}
SGLANG_RANKS = {"tp_rank": "0", "pp_rank": "0"}


# The HELP text of each metric, as the engines document them.
DOCS = {
    "running": "Number of requests in model execution batches.",
    "waiting": "Number of requests waiting to be processed.",
    "kv_usage": "KV-cache usage. 1 means 100 percent usage.",
    "prefix_hit_rate": "The prefix cache hit rate.",
    "finished": "Count of successfully processed requests.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "preemptions": "Cumulative number of preemption from the engine.",
    "ttft": "Histogram of time to first token in seconds.",
    "itl": "Histogram of inter-token latency in seconds.",
    "itl_deprecated": "Histogram of time per output token in seconds. DEPRECATED: Use "
                      "vllm:inter_token_latency_seconds instead.",
    "tpot": "Histogram of time_per_output_token_seconds per request.",
    "e2e": "Histogram of e2e request latency in seconds.",
    "queue_time": "Histogram of time spent in WAITING phase for request.",
    "step_tokens": "Histogram of number of tokens per engine_step.",
}


# The V1 engine's gauges and counters, the same in 0.11 and 0.12.
VLLM_V1_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
                  "kv_usage": "vllm:kv_cache_usage_perc"}
VLLM_V1_COUNTERS = {"finished": "vllm:request_success", "prompt_tokens": "vllm:prompt_tokens",
                    "generation_tokens": "vllm:generation_tokens",
                    "prefix_queries": "vllm:prefix_cache_queries", "prefix_hits": "vllm:prefix_cache_hits",
                    "preemptions": "vllm:num_preemptions"}

VLLM = Engine(  # vllm/v1/metrics/loggers.py, the v0.12 names: a per-request TPOT histogram
    "vllm", {"model_name": MODEL, "engine": "0"},
    gauges=VLLM_V1_GAUGES, counters=VLLM_V1_COUNTERS,
    histograms={"ttft": ("vllm:time_to_first_token_seconds", VLLM_TTFT),
                "itl": ("vllm:inter_token_latency_seconds", VLLM_TOKEN),
                "tpot": ("vllm:request_time_per_output_token_seconds", VLLM_TOKEN),
                "e2e": ("vllm:e2e_request_latency_seconds", VLLM_REQUEST),
                "queue_time": ("vllm:request_queue_time_seconds", VLLM_REQUEST),
                "step_tokens": ("vllm:iteration_tokens_total", VLLM_STEP_TOKENS)},
    finished_reasons=("stop", "length", "abort"))

VLLM_0_11 = Engine(  # the v0.11 line: inter_token_latency_seconds, and the same gaps under the old
    # name time_per_output_token_seconds (deprecated); no per-request TPOT histogram yet
    "vllm-0.11", {"model_name": MODEL, "engine": "0"},
    gauges=VLLM_V1_GAUGES, counters=VLLM_V1_COUNTERS,
    histograms={"ttft": ("vllm:time_to_first_token_seconds", VLLM_TTFT),
                "itl": ("vllm:inter_token_latency_seconds", VLLM_TOKEN),
                "itl_deprecated": ("vllm:time_per_output_token_seconds", VLLM_TOKEN),
                "e2e": ("vllm:e2e_request_latency_seconds", VLLM_REQUEST),
                "queue_time": ("vllm:request_queue_time_seconds", VLLM_REQUEST)},
    finished_reasons=("stop", "length", "abort"), scenarios=("overload", "long_prompts_unchunked"))

VLLM_0_8 = Engine(  # the same file at a6f0308 (v0.8): gpu_* names, TPOT observed per token
    "vllm-0.8", {"model_name": MODEL, "engine": "0"},
    gauges={"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
            "kv_usage": "vllm:gpu_cache_usage_perc"},
    counters={"finished": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
              "generation_tokens": "vllm:generation_tokens_total",
              "prefix_queries": "vllm:gpu_prefix_cache_queries", "prefix_hits": "vllm:gpu_prefix_cache_hits",
              "preemptions": "vllm:num_preemptions_total"},
    histograms={"ttft": ("vllm:time_to_first_token_seconds", VLLM_TTFT),
                "itl": ("vllm:time_per_output_token_seconds", VLLM_TOKEN),
                "e2e": ("vllm:e2e_request_latency_seconds", VLLM_REQUEST),
                "queue_time": ("vllm:request_queue_time_seconds", VLLM_REQUEST)},
    finished_reasons=("stop", "length", "abort"), scenarios=("overload", "long_prompts_unchunked"))

SGLANG = Engine(  # python/sglang/srt/metrics/collector.py at 00ae9c1
    "sglang", SGLANG_LABELS,
    gauges={"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
            "kv_usage": "sglang:token_usage", "prefix_hit_rate": "sglang:cache_hit_rate"},
    counters={"finished": "sglang:num_requests_total", "prompt_tokens": "sglang:prompt_tokens_total",
              "generation_tokens": "sglang:generation_tokens_total",
              "prefix_hits": "sglang:cached_tokens_total", "preemptions": "sglang:num_retracted_requests_total"},
    histograms={"ttft": ("sglang:time_to_first_token_seconds", SGLANG_TTFT),
                "itl": ("sglang:inter_token_latency_seconds", SGLANG_ITL),
                "e2e": ("sglang:e2e_request_latency_seconds", SGLANG_E2E),
                "queue_time": ("sglang:queue_time_seconds", SGLANG_QUEUE)},
    rank_labels=SGLANG_RANKS)

SGLANG_OLD = Engine(  # the older exposition of docs/references/production_metrics.md (40ef116)
    "sglang-old", SGLANG_LABELS,
    gauges={"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
            "kv_usage": "sglang:token_usage", "prefix_hit_rate": "sglang:cache_hit_rate"},
    counters={"prompt_tokens": "sglang:prompt_tokens_total",
              "generation_tokens": "sglang:generation_tokens_total"},
    histograms={"ttft": ("sglang:time_to_first_token_seconds", SGLANG_OLD_TTFT),
                "itl": ("sglang:time_per_output_token_seconds", SGLANG_OLD_TOKEN),
                "e2e": ("sglang:e2e_request_latency_seconds", SGLANG_OLD_E2E)},
    scenarios=("overload", "long_prompts_unchunked"), rank_labels=SGLANG_RANKS)

ENGINES = {e.name: e for e in (VLLM, VLLM_0_11, VLLM_0_8, SGLANG, SGLANG_OLD)}


# ---- scenarios ---------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    requests: int                     # finished in the window
    running: tuple                    # (first scrape, second scrape)
    waiting: tuple
    kv_usage: tuple
    ttft: tuple                       # lognormal (median s, sigma), clipped at ttft_max
    gap: tuple                        # lognormal (median s, sigma) of one inter-token gap
    queue_share: float                # queue time / TTFT
    hit_share: float                  # prefix-cache hits / prompt tokens
    preemptions: int
    stall: tuple = (0.0, 0.0)         # (probability, seconds) of a gap stalled behind a prefill
    ttft_max: float = float("inf")
    seed: int = 0
    knobs: dict = field(default_factory=dict)    # what the operator tells `tinyserve diagnose`
    expect: str = ""                  # the stage the diagnosis must find


# The operator's knobs: the crossover of an A100 + 7B fp16, the server's batch cap.
A100_7B = {"hardware": "A100_SXM_80GB", "model_spec": "LLAMA_7B", "max_num_seqs": 256}
CALM = Scenario("calm", 300, (40, 40), (0, 0), (0.3, 0.3), ttft=(0.12, 0.35), gap=(0.022, 0.15),
                queue_share=0.1, hit_share=0.5, preemptions=0, ttft_max=0.38, seed=99)
SCENARIOS = {s.name: s for s in (
    Scenario("overload", 600, (256, 256), (150, 420), (0.97, 0.99), ttft=(6.0, 0.5), gap=(0.07, 0.15),
             queue_share=0.97, hit_share=0.45, preemptions=40, seed=1, knobs=A100_7B, expect="overload"),
    Scenario("batch_too_small", 120, (8, 8), (60, 300), (0.05, 0.05), ttft=(20.0, 0.6),
             gap=(0.011, 0.1), queue_share=0.995, hit_share=0.45, preemptions=0, seed=2,
             knobs=A100_7B | {"max_num_seqs": 8}, expect="queueing"),
    Scenario("long_prompts_unchunked", 500, (60, 64), (0, 0), (0.6, 0.62), ttft=(0.12, 0.4),
             gap=(0.015, 0.1), stall=(0.08, 0.6), queue_share=0.2, hit_share=0.3, preemptions=0,
             ttft_max=0.38, seed=3, knobs=A100_7B, expect="decode"),
    Scenario("low_hit_rate", 600, (40, 44), (0, 0), (0.35, 0.36), ttft=(0.12, 0.35), gap=(0.022, 0.15),
             queue_share=0.1, hit_share=0.15, preemptions=0, ttft_max=0.38, seed=4,
             knobs=A100_7B | {"prefix_share": 0.9, "routing": "round_robin"}, expect="cache"),
    Scenario("healthy", 600, (40, 44), (0, 0), (0.35, 0.36), ttft=(0.12, 0.35), gap=(0.022, 0.15),
             queue_share=0.1, hit_share=0.85, preemptions=0, ttft_max=0.38, seed=5,
             knobs=A100_7B | {"prefix_share": 0.9}, expect="healthy"),
)}


class Server:
    """One engine's registry, fed request by request."""

    def __init__(self, engine: Engine):
        self.engine, self.registry = engine, CollectorRegistry()
        names = list(engine.labels)
        self.gauges = {r: Gauge(n, DOCS[r], list(self.labels_of(r)), registry=self.registry)
                       for r, n in engine.gauges.items()}
        self.counters = {r: Counter(n, DOCS[r], list(self.labels_of(r)) + (["finished_reason"] if r == "finished"
                                                                             and engine.finished_reasons else []),
                                    registry=self.registry)
                         for r, n in engine.counters.items()}
        self.histograms = {r: Histogram(n, DOCS[r], names, buckets=b, registry=self.registry)
                           for r, (n, b) in engine.histograms.items()}
        for reason in engine.finished_reasons:      # vLLM creates every reason's series up front
            self.label(self.counters["finished"], "finished", finished_reason=reason)

    def labels_of(self, role: str) -> dict:
        return self.engine.labels | (self.engine.rank_labels if role in SCHEDULER_ROLES else {})

    def label(self, metric, role: str = "", **extra):
        return metric.labels(**self.labels_of(role), **extra)

    def inc(self, role: str, amount: float, **extra) -> None:
        if role in self.counters:
            self.label(self.counters[role], role, **extra).inc(amount)

    def observe(self, role: str, values) -> None:
        self.log.setdefault(role, []).extend(np.atleast_1d(values).tolist())
        for each in (role, "itl_deprecated") if role == "itl" else (role,):    # vLLM 0.11 writes both
            if each in self.histograms:
                h = self.label(self.histograms[each])
                for v in np.atleast_1d(values):
                    h.observe(float(v))

    def serve(self, s: Scenario) -> None:
        """Finish ``s.requests`` requests of scenario ``s``; ``log`` keeps what they were."""
        self.log: dict = {}
        rng = np.random.default_rng(s.seed)
        for i in range(s.requests):
            prompt = int(np.clip(rng.lognormal(np.log(400), 0.6), 8, 4000))
            output = int(np.clip(rng.lognormal(np.log(120), 0.5), 2, 1000))
            ttft = min(rng.lognormal(np.log(s.ttft[0]), s.ttft[1]), s.ttft_max)
            gaps = rng.lognormal(np.log(s.gap[0]), s.gap[1], output - 1)
            gaps[rng.random(output - 1) < s.stall[0]] = s.stall[1]
            self.observe("ttft", ttft)
            self.observe("itl", gaps)
            self.observe("tpot", gaps.mean())
            self.observe("e2e", ttft + gaps.sum())
            self.observe("queue_time", s.queue_share * ttft)
            reasons = self.engine.finished_reasons
            extra = {"finished_reason": reasons[0 if i % 10 else 1]} if reasons else {}
            self.inc("finished", 1, **extra)
            self.inc("prompt_tokens", prompt)
            self.inc("generation_tokens", output)
            self.inc("prefix_queries", prompt)
            self.inc("prefix_hits", round(s.hit_share * prompt))
            self.log.setdefault("prompt", []).append(prompt)
            self.log.setdefault("hits", []).append(round(s.hit_share * prompt))
        self.inc("preemptions", s.preemptions)

    def scrape(self, s: Scenario, which: int) -> str:
        for role, gauge in self.gauges.items():
            level = s.hit_share if role == "prefix_hit_rate" else getattr(s, role)[which]
            self.label(gauge, role).set(level)
        # Without the *_created timestamps, so that the files are reproducible.
        prometheus_client.disable_created_metrics()
        try:
            return generate_latest(self.registry).decode()
        finally:
            prometheus_client.enable_created_metrics()


HEADER = ("# Fixture: the {engine} /metrics of scenario '{scenario}', scrape {n} of 2 "
          "({window:g} s apart), built by tests/metric_fixtures.py from the engine's metric "
          "definitions (see tinyserve.serving.dialects for the source files and commits).\n")


def serve(engine: str, scenario: str) -> tuple[str, str, dict]:
    """The two scrapes of ``scenario`` served by ``engine``, and the window's requests."""
    server, s = Server(ENGINES[engine]), SCENARIOS[scenario]
    server.serve(CALM)
    first = server.scrape(s, 0)
    server.serve(s)
    second = server.scrape(s, 1)
    first, second = (HEADER.format(engine=engine, scenario=scenario, n=n, window=WINDOW) + text
                     for n, text in ((1, first), (2, second)))
    return first, second, server.log


def diagnose_texts(before: str, after: str, seconds: float, model: str | None = None,
                   sources: tuple = ("the first scrape", "the second scrape"), **knobs):
    """Two scrapes held as Prometheus text, ``seconds`` apart; ``sources`` name them in errors."""
    first, second = (parse_metrics(text, source) for text, source in zip((before, after), sources))
    return diagnose_window(Window(first, second, seconds, model), **knobs)


def histogram_of(text: str, name: str) -> ScrapedHistogram:
    """Every series of histogram ``name`` in a scrape, added up."""
    total = None
    for h in histograms_by_series(parse_metrics(text), name, None).values():
        total = h if total is None else total.plus(h, name)
    return total


def build(engine: str, scenario: str) -> tuple[str, str]:
    return serve(engine, scenario)[:2]


def paths(engine: str, scenario: str) -> tuple[Path, Path]:
    return tuple(FIXTURES / engine / f"{scenario}_{n}.prom" for n in (1, 2))


def cases() -> list[tuple[str, str]]:
    """(engine, scenario) of every fixture pair."""
    return [(e.name, s) for e in ENGINES.values() for s in (e.scenarios or SCENARIOS)]


def write_all() -> None:
    for engine, scenario in cases():
        for path, text in zip(paths(engine, scenario), build(engine, scenario)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(FIXTURES.parent.parent.parent)}")


if __name__ == "__main__":
    sys.exit(write_all())
