"""`tinyserve diagnose` where operators need it most (issue 40), and the context-aware crossover.

Every window is two scrapes of ``traffic.Server``: the engine's own metric definitions
(``metric_fixtures.ENGINES``) in a ``prometheus_client`` registry, fed requests. Before
each window the server has served calm traffic, so only the deltas give the verdict.
"""

import gzip
import http.server
from functools import partial

import numpy as np
import prometheus_client
import pytest

import metric_fixtures as mf
from tinyserve.cli import main
from tinyserve.diagnose import diagnose
from tinyserve.diagnose_facts import ITL_SPIKE
from tinyserve.hardware import A100_SXM_80GB, LLAMA_7B, crossover_batch, decode_step_bytes, decode_step_flops
from tinyserve.serving.live_diagnose import crossover_of
from tinyserve.serving.scrape import fetch_metrics
from traffic import (LOAD_ENGINES, START, TPOT_SLO, TTFT_SLO, Server, calm, clock,  # noqa: F401
                     http_server, live)  # clock, http_server: fixtures

H100_8B = 295.0          # the tester's crossover: H100, Llama-3-8B fp16
WAIT = "new arrival's wait = queue_length_at_end / request_throughput (s)"
UNTIL = "seconds until that wait passes ttft_slo at this growth"


def window(engine, before, during, after, **knobs):
    """calm traffic, ``before(server)``, scrape, ``during(server)``, ``after(server)``, scrape."""
    server = Server(engine)
    calm(server)
    before(server)
    first = server.text()
    during(server)
    after(server)
    return live(first, server.text(), **knobs)


# ---- 1. an overload that is starting: the queue grows while the batch is at its cap -------------

@pytest.mark.parametrize("engine", LOAD_ENGINES)
@pytest.mark.parametrize("queue, wait", [(60, 1.5), (200, 5.0)])
def test_a_queue_growing_at_the_batch_cap_is_overload_whatever_the_excess(engine, queue, wait):
    result = window(engine, lambda s: s.levels(256, 0), lambda s: s.finish(2400, seed=1),
                    lambda s: s.levels(256, queue))
    s, d = result.summary, result.diagnosis
    # Arrivals exceed completions by less than the 20% the excess rule needs; latency holds.
    assert s["arrival_rate"] < 1.2 * s["request_throughput"]
    assert s["p99_ttft"] < TTFT_SLO
    assert d.stage == "overload", str(d)
    assert "batch is at its cap" in d.finding and d.action.startswith("add capacity")
    assert d.evidence[WAIT] == pytest.approx(wait)
    assert f"already waits about {wait:.3g} s" in d.finding


def test_a_queue_growing_at_the_cap_says_how_long_until_ttft_breaks():
    result = window("vllm", lambda s: s.levels(256, 0), lambda s: s.finish(2400, seed=1),
                    lambda s: s.levels(256, 10))
    d = result.diagnosis
    # 40 finish per second: 10 waiting is 0.25 s; the queue grows by 1/6 per second, so the
    # wait grows by 1/240 s per second and reaches 0.5 s in (0.5 - 0.25) * 240 = 60 s.
    assert d.stage == "overload" and d.evidence[WAIT] == pytest.approx(0.25)
    assert d.evidence[UNTIL] == pytest.approx(60.0)
    assert "TTFT breaks its SLO in about 60 s" in d.finding


def test_a_growing_queue_below_the_cap_with_arrivals_matching_completions_is_not_overload():
    result = window("vllm", lambda s: s.levels(100, 0), lambda s: s.finish(2400, seed=1),
                    lambda s: s.levels(100, 10))
    assert result.diagnosis.stage == "healthy", str(result.diagnosis)


# ---- 2. long prompts prefilled whole: both miss, nothing queues ----------------------------------

LONG_PROMPTS = dict(ttft=(1.2, 0.3), ttft_max=5.0, queue_share=0.01, gap=(0.02, 0.1), stall=(0.08, 0.6))


@pytest.mark.parametrize("engine", LOAD_ENGINES)
def test_unchunked_long_prompts_are_not_overload(engine):
    result = window(engine, lambda s: s.levels(60, 0), lambda s: s.finish(600, seed=3, **LONG_PROMPTS),
                    lambda s: s.levels(64, 2))
    d = result.diagnosis
    assert result.summary["p99_ttft"] > TTFT_SLO and result.summary["mean_tpot"] > TPOT_SLO
    assert d.stage == "prefill", str(d)
    assert d.evidence["queue share of TTFT (queueing at >= 50%)"] == pytest.approx(0.01, rel=0.05)
    assert "chunked prefill" in d.action and "--max-num-batched-tokens" in d.action
    assert not d.action.startswith("add capacity") and "more replicas would not help" in d.action


def test_both_missing_without_a_queue_or_stalls_is_slow_steps_not_long_prompts():
    summary = {"p99_ttft": 0.9, "p99_tpot": 0.06, "mean_ttft": 0.5, "mean_queue_time": 0.01,
               "median_itl": 0.055, "p99_itl": 0.07, "mean_batch_size": 200.0}
    d = diagnose(summary, 0.5, 0.05, crossover=153.0, max_num_seqs=256)
    assert d.stage == "decode" and "every step is slow" in d.finding, str(d)
    assert d.action.startswith("lower max_num_seqs toward the crossover")
    stalled = diagnose(summary | {"p99_itl": 0.6}, 0.5, 0.05, crossover=153.0, max_num_seqs=256)
    assert stalled.stage == "prefill" and "chunked prefill" in stalled.action


# ---- 3. stalls without a queue -------------------------------------------------------------------

@pytest.mark.parametrize("engine", LOAD_ENGINES)
def test_stalls_without_a_queue_name_chunked_prefill(engine):
    # TTFT misses, nothing queues, 2% of the gaps wait 0.41 s behind a whole prefill: 34x the median.
    server = Server(engine)
    calm(server)
    first = server.text()
    tpots, gaps = server.finish(600, seed=4, ttft=(0.9, 0.2), ttft_max=3.0, queue_share=0.01,
                                gap=(0.012, 0.1), stall=(0.02, 0.41))
    server.levels(40, 0)
    d = live(first, server.text()).diagnosis
    assert np.quantile(gaps, 0.99) / np.median(gaps) == pytest.approx(34, rel=0.05)
    assert np.quantile(tpots, 0.99) < TPOT_SLO
    assert d.stage == "prefill", str(d)
    assert d.evidence[f"p99_itl / median_itl (stalls at >= {ITL_SPIKE:g})"] >= ITL_SPIKE
    assert "chunked prefill" in d.action and "reuse prefixes" not in d.action


# ---- 4. a stalled server, an idle window --------------------------------------------------------

@pytest.mark.parametrize("engine", LOAD_ENGINES + ["sglang-old"])
def test_a_flat_stuck_queue_with_no_tokens_is_a_stalled_server(engine):
    result = window(engine, lambda s: s.levels(64, 50), lambda s: None, lambda s: s.levels(64, 50))
    d = result.diagnosis
    assert d.stage == "stalled", str(d)
    assert d.evidence["output_throughput"] == 0 and d.evidence["mean_batch_size"] == 64
    assert d.action.startswith("check the server")


@pytest.mark.parametrize("engine", LOAD_ENGINES + ["sglang-old"])
def test_an_idle_window_has_nothing_to_judge(engine):
    d = window(engine, lambda s: s.levels(0, 0), lambda s: None, lambda s: s.levels(0, 0)).diagnosis
    assert d.stage == "idle" and "no traffic in this window: nothing to judge" in d.finding


def test_the_same_file_twice_has_nothing_to_judge(tmp_path, capsys):
    server = Server("vllm")
    calm(server)
    server.levels(44, 0)
    path = tmp_path / "metrics.prom"
    path.write_text(server.text())
    main(["diagnose", "--once", str(path), str(path), "--window", "60"])
    out = capsys.readouterr().out
    assert "[idle]" in out and "no traffic in this window: nothing to judge" in out


# ---- 5. data-parallel engines, tensor-parallel ranks -----------------------------------------------

def slow_decodes(server, idx):
    server.finish(600, idx, seed=int(idx) + 10, gap=(0.06, 0.1))     # every step ~60 ms: TPOT misses


def test_data_parallel_engines_are_judged_per_engine():
    server = Server("vllm", engines=("0", "1"))
    for idx in "01":
        calm(server, idx, seed=20 + int(idx))
        server.levels(200, 0, idx=idx)
    first = server.text()
    for idx in "01":
        slow_decodes(server, idx)
    result = live(first, server.text(), crossover=H100_8B)
    d = result.diagnosis
    assert result.summary["engines"] == 2 and result.summary["mean_batch_size"] == 200
    assert [note for note in result.notes if "mean_batch_size is per engine" in note]
    assert d.stage == "decode" and "past the crossover" not in d.finding, str(d)
    assert "below the crossover" in d.finding and not d.action.startswith("lower max_num_seqs toward")
    # One engine holding the same 400 is past it.
    one = window("vllm", lambda s: s.levels(400, 0), lambda s: slow_decodes(s, "0"), lambda s: s.levels(400, 0),
                 crossover=H100_8B, max_num_seqs=512)
    assert "past the crossover" in one.diagnosis.finding


def test_sglang_tensor_parallel_ranks_are_read_once_and_said_so():
    server = Server("sglang")
    calm(server)
    server.levels(100, 0, ranks=("0", "1"))
    first = server.text()
    server.finish(600, seed=3)
    server.levels(100, 0, ranks=("0", "1"))
    result = live(first, server.text())
    assert result.summary["mean_batch_size"] == 100                   # not 200
    assert [note for note in result.notes if "read at tp_rank 0" in note]


# ---- also: restarts without timestamps, gzip, the token budget, cosmetics ------------------------

def test_a_restart_without_timestamps_that_every_series_outgrew_is_a_suspect_window():
    def process(ttfts, finished):
        server = Server("sglang")
        server.observe("ttft", ttfts)
        server.inc("finished", finished)
        server.inc("generation_tokens", 100 * finished)
        server.levels(40, 0)
        prometheus_client.disable_created_metrics()     # no _created, no process start time
        try:
            return server.text()
        finally:
            prometheus_client.enable_created_metrics()
    old = process([0.05] * 100 + [5.0] * 100, 200)
    new = process([0.05] * 150 + [1.8] * 300, 450)     # every bucket, the sum and the counters grew
    result = live(old, new)
    assert result.diagnosis.stage == "unknown" and "suspect window" in result.diagnosis.finding
    assert [note for note in result.notes if "sglang:time_to_first_token_seconds's sum" in note]


def test_a_gzip_answer_is_read_and_identity_is_asked_for(http_server):
    server = Server("vllm")
    calm(server)
    body, asked = gzip.compress(server.text().encode()), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.headers.get("Accept-Encoding"))
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    scrape = fetch_metrics(http_server(Handler))
    assert asked == ["identity"]
    assert scrape.series("vllm:num_requests_running")[0][1] == 40


def budget_window(step_tokens):
    server = Server("vllm")
    calm(server)
    server.levels(40, 0, kv=0.2)
    first = server.text()
    server.finish(300, seed=6, ttft=(1.5, 0.3), ttft_max=5.0, queue_share=0.9)
    server.observe("step_tokens", step_tokens)
    server.levels(40, 30, kv=0.2)
    return live(first, server.text())


def test_a_token_budget_that_throttles_admission_is_its_own_verdict():
    d = budget_window([128] * 5000 + [100] * 100).diagnosis      # every step at about 128 tokens
    assert d.stage == "batch" and d.action.startswith("raise --max-num-batched-tokens"), str(d)
    assert d.evidence["step_token_ceiling"] == 128 and d.evidence["step_share_at_ceiling"] > 0.9
    # Steps of every size: the budget is not what holds requests back.
    spread = budget_window(np.random.default_rng(0).integers(1, 2000, 5000)).diagnosis
    assert spread.stage == "queueing" and spread.action.startswith("add capacity")


def test_the_mean_batch_counts_every_step_not_the_two_gauge_readings():
    # A live vLLM at 4 seats with a growing queue had its running gauge read 0 at a
    # scrape while its steps ran 4 sequences (tests/test_vllm.py): the window's steps,
    # each carrying one token per running sequence, say what the batch was.
    server = Server("vllm")
    calm(server)
    server.levels(0, 10)
    first = server.text()
    server.finish(200, seed=3)
    generated = mf.parse_metrics(server.text()).total("vllm:generation_tokens_total") \
        - mf.parse_metrics(first).total("vllm:generation_tokens_total")
    server.observe("step_tokens", [4] * int(generated // 4))
    server.levels(0, 40)
    s = live(first, server.text(), max_num_seqs=4).summary
    assert s["mean_batch_size"] == pytest.approx(generated / int(generated // 4))
    # Without the steps histogram the two gauge readings are all there is.
    old = Server("vllm-0.8")
    calm(old)
    old.levels(2, 10)
    before = old.text()
    old.finish(200, seed=3)
    old.levels(6, 40)
    assert live(before, old.text(), max_num_seqs=4).summary["mean_batch_size"] == 4


def test_an_http_error_says_could_not_read_once(http_server, capsys):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(502)
            self.end_headers()

        def log_message(self, *args):
            pass

    with pytest.raises(SystemExit):
        main(["diagnose", "--url", http_server(Handler), "--window", "0.01"])
    err = capsys.readouterr().err
    assert err.count("could not read") == 1 and "HTTP 502" in err


def test_a_restart_note_prints_two_different_times(clock):
    old = Server("vllm", process_start=START)
    calm(old)
    new = Server("vllm", process_start=START + 0.4)
    new.finish(10, seed=1)
    new.levels(40, 0)
    note = " ".join(live(old.text(), new.text()).notes)
    assert f"{START:.1f} to {START + 0.4:.1f}" in note


def test_a_model_name_with_a_newline_stays_on_the_header_line():
    server = Server("vllm", model="a\nb")
    calm(server)
    first = server.text()
    server.finish(100, seed=1)
    result = live(first, server.text())
    assert str(result).splitlines()[0].endswith("model a\\nb: a window of 60.0 s")


def test_window_zero_is_named_as_the_window(tmp_path, capsys):
    path = tmp_path / "m.prom"
    server = Server("vllm")
    calm(server)
    path.write_text(server.text())
    with pytest.raises(SystemExit):
        main(["diagnose", "--once", str(path), str(path), "--window", "0"])
    assert "window (--window) must be a positive number of seconds" in capsys.readouterr().err


def test_after_a_restart_the_queue_and_batch_are_the_live_process_gauges(clock):
    server = Server("vllm", engines=("0", "1"))
    for idx in "01":
        calm(server, idx, seed=30 + int(idx))
    server.levels(50, 0, idx="0")
    server.levels(200, 100, idx="1")         # engine 1's last reading before it died
    first = server.text()
    server.finish(300, "0", seed=7)
    clock[0] += 100
    server.restart("1")
    server.finish(50, "1", seed=8)
    server.levels(50, 0, idx="0")
    server.levels(10, 0, idx="1")
    s = live(first, server.text()).summary
    assert s["queue_length_at_start"] == 0 and s["queue_growth_rate"] == 0
    assert s["mean_batch_size"] == pytest.approx((50 + 10) / 2)


# ---- physics: the crossover moves right as contexts grow (issue 37 §3) --------------------------

AT = partial(crossover_batch, A100_SXM_80GB, LLAMA_7B, "fp16")
SLOW_DECODE = {"p99_ttft": 0.2, "p99_tpot": 0.04, "median_itl": 0.03, "p99_itl": 0.05, "mean_batch_size": 168.0}


@pytest.mark.parametrize("context", [0, 20, 80, 120])
def test_the_context_aware_crossover_is_where_memory_and_compute_take_equally_long(context):
    batch = AT(context)
    memory = decode_step_bytes(LLAMA_7B, batch, "fp16", context) / A100_SXM_80GB.memory_bandwidth
    compute = decode_step_flops(LLAMA_7B, batch, context) / A100_SXM_80GB.peak_flops("fp16")
    assert memory == pytest.approx(compute, rel=1e-9)
    assert AT(context) >= AT(0)


def test_a_batch_past_153_with_long_contexts_is_memory_bound():
    # 168 requests at 160 tokens of context: KV reads about as long as the weight read, and
    # the two together outlast the compute.
    memory = decode_step_bytes(LLAMA_7B, 168, "fp16", 160) / A100_SXM_80GB.memory_bandwidth
    compute = decode_step_flops(LLAMA_7B, 168, 160) / A100_SXM_80GB.peak_flops("fp16")
    assert memory > 1.5 * compute
    d = diagnose(SLOW_DECODE | {"mean_context_len": 160.0}, 0.5, 0.025, crossover=AT, max_num_seqs=512)
    assert d.stage == "decode" and "memory-bound" in d.finding and "compute-bound" not in d.finding, str(d)
    assert d.evidence["crossover at this context"] == pytest.approx(AT(160))
    assert AT(160) > 168 > AT(0) == pytest.approx(153, abs=0.1)
    assert d.action.startswith("lower max_num_seqs toward the weights-only crossover")
    # With short contexts the same batch is compute-bound.
    short = diagnose(SLOW_DECODE | {"mean_context_len": 2.0}, 0.5, 0.025, crossover=AT, max_num_seqs=512)
    assert "compute-bound" in short.finding


def test_without_the_context_the_crossover_is_the_weights_only_one_and_says_so():
    d = diagnose(SLOW_DECODE, 0.5, 0.025, crossover=AT, max_num_seqs=512)
    assert "compute-bound" in d.finding and "KV reads would move it right" in d.unknown["mean_context_len"]


def test_the_live_diagnosis_reads_the_crossover_at_the_window_context():
    at, note = crossover_of("A100_SXM_80GB", "LLAMA_7B")
    long_context = dict(gap=(0.06, 0.1), prompt_len=(1500, 2500))
    result = window("vllm", lambda s: s.levels(200, 0), lambda s: s.finish(600, seed=2, **long_context),
                    lambda s: s.levels(200, 0), crossover=at, crossover_note=note, max_num_seqs=512)
    d = result.diagnosis
    assert result.summary["mean_context_len"] > 1500
    assert d.stage == "decode" and "memory-bound" in d.finding, str(d)
    assert "with weights only, read at the window's mean context" in result.crossover
