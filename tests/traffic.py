"""A vLLM or SGLang server's ``/metrics`` made the way the engine makes it, request by request.

The metric definitions of vLLM's ``loggers.py`` and SGLang's ``collector.py`` (names,
types, labels, bucket bounds; ``metric_fixtures.ENGINES``, plus the KV-connector and
abort counters below) registered in a ``prometheus_client`` registry, fed requests,
and written by ``generate_latest()``, ``_created`` series included. The ``clock``
fixture stands in for ``prometheus_client``'s ``time.time()`` so that a restart's
timestamps are known. Used by tests/test_diagnose_traffic.py and
tests/test_diagnose_operators.py.
"""

import socketserver
import threading
import types

import numpy as np
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

import metric_fixtures as mf

TTFT_SLO, TPOT_SLO = 0.5, 0.05
CROSSOVER = 153.0
START = 1.75e9                          # the fake clock's first reading (unix seconds)

# vLLM's KV-connector reuse (vllm/v1/metrics/loggers.py, PrometheusStatLogger) and
# SGLang's aborts (python/sglang/srt/metrics/collector.py, TokenizerMetricsCollector).
VLLM_REUSE = {
    "external_queries": ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
                         "connector cross-instance cache sharing, in terms of number of queried tokens.", []),
    "external_hits": ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                      "cross-instance cache sharing, in terms of number of cached tokens.", []),
    "prompt_by_source": ("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"]),
    "cached_prompt_tokens": ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                             []),
}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SGLANG_ABORTS = {"aborted": ("sglang:num_aborted_requests_total", "Number of requests aborted.", [])}


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    """prometheus_client's clock (it stamps each series' ``_created``), moved by hand."""
    now = [START]
    monkeypatch.setattr(prometheus_client.metrics, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


class ProcessStart:
    """The ``process_start_time_seconds`` of prometheus_client's process collector, fixed."""
    def __init__(self, start: float):
        self.start = start

    def collect(self):
        yield GaugeMetricFamily("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", value=self.start)


class Server:
    """One engine version's /metrics (``metric_fixtures.ENGINES``), for engine indexes
    ``engines``; ``extra`` adds counters (role -> (name, help, extra label names))."""

    def __init__(self, engine: str, engines=("0",), model=mf.MODEL, extra=None, process_start=None):
        self.d, self.model, self.engines = mf.ENGINES[engine], model, engines
        self.registry, self.metrics, self.extra_labels = CollectorRegistry(), {}, {}
        names = list(self.d.labels)
        for role, name in self.d.gauges.items():
            self.metrics[role] = Gauge(name, mf.DOCS[role], list(self.labels("0", role)), registry=self.registry)
        for role, name in self.d.counters.items():
            more = ["finished_reason"] if role == "finished" and self.d.finished_reasons else []
            self.metrics[role] = Counter(name, mf.DOCS[role], list(self.labels("0", role)) + more,
                                         registry=self.registry)
        for role, (name, buckets) in self.d.histograms.items():
            self.metrics[role] = Histogram(name, mf.DOCS[role], names, buckets=buckets, registry=self.registry)
        for role, (name, doc, more) in (extra or {}).items():
            self.metrics[role] = Counter(name, doc, names + more, registry=self.registry)
        if process_start is not None:      # prometheus_client's process collector, as a fixed gauge
            self.registry.register(ProcessStart(process_start))
        for idx in engines:
            self.create(idx)

    def labels(self, idx, role="", rank="0") -> dict:
        """The labels of engine ``idx``'s series of ``role`` (SGLang's scheduler metrics: at ``rank``)."""
        labels = dict(self.d.labels, model_name=self.model)
        if role in mf.SCHEDULER_ROLES:
            labels |= {k: rank if k == "tp_rank" else v for k, v in self.d.rank_labels.items()}
        return labels | ({"engine": idx} if "engine" in labels else {})

    def create(self, idx) -> None:
        """Series an engine creates at start (vLLM: every finished_reason, every source)."""
        for reason in self.d.finished_reasons:
            self.metrics["finished"].labels(**self.labels(idx), finished_reason=reason)
        if "prompt_by_source" in self.metrics:
            for source in SOURCES:
                self.metrics["prompt_by_source"].labels(**self.labels(idx), source=source)

    def restart(self, idx) -> None:
        """Engine ``idx`` starts again: its series are removed and made anew."""
        for role, metric in self.metrics.items():
            base = list(self.labels(idx, role).values())
            extra = ([(r,) for r in self.d.finished_reasons] if role == "finished" and self.d.finished_reasons
                     else [(s,) for s in SOURCES] if role == "prompt_by_source" else [()])
            for more in extra:
                try:
                    metric.remove(*base, *more)
                except KeyError:
                    pass
        self.create(idx)

    def inc(self, role, amount, idx="0", **extra):
        if role in self.metrics and amount:
            self.metrics[role].labels(**self.labels(idx, role), **extra).inc(amount)

    def observe(self, role, values, idx="0"):
        if role in self.metrics:
            child = self.metrics[role].labels(**self.labels(idx))
            for v in np.atleast_1d(values):
                child.observe(float(v))

    def finish(self, n, idx="0", seed=0, ttft=(0.12, 0.35), gap=(0.022, 0.15), ttft_max=0.38, hit_share=0.5,
               prompts=True, queue_share=0.1, stall=(0.0, 0.0), prompt_len=(100, 800)):
        """``n`` requests finish on engine ``idx`` (``prompts``: and count their prompt
        tokens); ``stall``: (probability, seconds) of a gap stuck behind a whole prefill;
        returns their per-request TPOTs and gaps."""
        rng = np.random.default_rng(seed)
        tpots, all_gaps = [], []
        for _ in range(n):
            prompt, output = int(rng.integers(*prompt_len)), int(rng.integers(60, 200))
            first = min(rng.lognormal(np.log(ttft[0]), ttft[1]), ttft_max)
            gaps = rng.lognormal(np.log(gap[0]), gap[1], output - 1)
            gaps[rng.random(output - 1) < stall[0]] = stall[1]
            tpots.append(gaps.mean())
            all_gaps.extend(gaps)
            for role, values in (("ttft", first), ("itl", gaps), ("tpot", gaps.mean()),
                                 ("e2e", first + gaps.sum()), ("queue_time", queue_share * first)):
                self.observe(role, values, idx)
            extra = {"finished_reason": "stop"} if self.d.finished_reasons else {}
            self.inc("finished", 1, idx, **extra)
            self.inc("generation_tokens", output, idx)
            if prompts:
                self.inc("prompt_tokens", prompt, idx)
                self.inc("prefix_queries", prompt, idx)
                self.inc("prefix_hits", round(hit_share * prompt), idx)
        return np.array(tpots), np.array(all_gaps)

    def level(self, role, value, idx="0", ranks=("0",)):
        if role in self.metrics:
            for rank in ranks:          # every rank of a tensor-parallel group reports the same level
                self.metrics[role].labels(**self.labels(idx, role, rank)).set(value)

    def levels(self, running, waiting, kv=0.4, idx="0", ranks=("0",)):
        self.level("running", running, idx, ranks)
        self.level("waiting", waiting, idx, ranks)
        self.level("kv_usage", kv, idx, ranks)
        self.level("prefix_hit_rate", 0.5, idx, ranks)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def calm(server, idx="0", seed=99):
    server.finish(300, idx, seed=seed)
    server.levels(40, 0, idx=idx)


def live(first, second, seconds=mf.WINDOW, **knobs):
    knobs = {"ttft_slo": TTFT_SLO, "tpot_slo": TPOT_SLO, "crossover": CROSSOVER, "max_num_seqs": 256} | knobs
    return mf.diagnose_texts(first, second, seconds, sources=("before.prom", "after.prom"), **knobs)


LOAD_ENGINES = ["vllm", "vllm-0.8", "sglang"]      # sglang-old exports no finished-requests counter


@pytest.fixture
def http_server():
    servers = []

    def start(handler):
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
