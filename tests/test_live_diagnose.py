"""`tinyserve diagnose`: the tuning order on two scrapes of a server's /metrics.

vLLM and SGLang: fixtures built by ``metric_fixtures`` from each engine's own metric
definitions, five scenarios (plus older metric names), each diagnosed as the
scenario was built. The window's numbers are checked against the requests that
made them, and the histogram quantiles against numpy. Our own server: real
scrapes of a real server on 127.0.0.1 under load (``test_live_server_*``).
"""

import json
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram as PromHistogram, generate_latest

import metric_fixtures as mf
from tinyserve.cli import main
from tinyserve.hardware import A100_SXM_80GB, LLAMA_7B, crossover_batch
from tinyserve.serving.client import benchmark
from tinyserve.serving.histogram import Histogram
from tinyserve.serving.live_diagnose import (NO_MAX_NUM_SEQS, SKIPPED_CROSSOVER, crossover_of,
                                             diagnose_under_load, window_summary)
from tinyserve.serving.processes import ServerProcess
from tinyserve.serving.scrape import Window, metrics_url, parse_metrics
from tinyserve.workload import make_workload

TTFT_SLO, TPOT_SLO = 0.5, 0.05


def knobs_of(scenario):
    k = dict(mf.SCENARIOS[scenario].knobs)
    crossover, note = crossover_of(k.pop("hardware"), k.pop("model_spec"))
    return k | {"crossover": crossover, "crossover_note": note}


def live_of(engine, scenario, **extra):
    before, after = (p.read_text() for p in mf.paths(engine, scenario))
    return mf.diagnose_texts(before, after, mf.WINDOW, ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO,
                          **(knobs_of(scenario) | extra))


ACTIONS = {"overload": "add capacity", "batch_too_small": "raise max_num_seqs",
           "long_prompts_unchunked": "enable_chunked_prefill", "low_hit_rate": "route cache-aware",
           "healthy": "model-level levers"}


@pytest.mark.parametrize("engine, scenario", mf.cases())
def test_each_scenario_is_diagnosed_as_it_was_built(engine, scenario):
    live = live_of(engine, scenario)
    d = live.diagnosis
    assert d.stage == mf.SCENARIOS[scenario].expect, str(live)
    assert d.action.startswith(ACTIONS[scenario]), d.action
    assert live.engine == engine.split("-")[0]


@pytest.mark.parametrize("engine, scenario", mf.cases())
def test_the_fixtures_are_the_engines_definitions_rebuilt(engine, scenario):
    # Compared as parsed samples, so that another prometheus_client's number formatting passes.
    for path, text in zip(mf.paths(engine, scenario), mf.build(engine, scenario)):
        assert parse_metrics(path.read_text()) == parse_metrics(text), \
            f"{path} is stale: run .venv/bin/python tests/metric_fixtures.py"


def test_the_window_numbers_are_those_of_the_requests_in_it():
    first, second, log = mf.serve("vllm", "overload")
    s = mf.SCENARIOS["overload"]
    summary, unknown = window_summary(Window(parse_metrics(first), parse_metrics(second), mf.WINDOW))
    assert summary["completed"] == s.requests
    held = sum(s.running) - 2 * s.running[0] + s.waiting[1] - s.waiting[0]
    assert summary["arrival_rate"] == pytest.approx((s.requests + held) / mf.WINDOW)
    assert summary["request_throughput"] == pytest.approx(s.requests / mf.WINDOW)
    assert summary["queue_growth_rate"] == pytest.approx((s.waiting[1] - s.waiting[0]) / mf.WINDOW)
    assert summary["max_queue_length"] == max(s.waiting)
    assert summary["mean_batch_size"] == np.mean(s.running)
    assert summary["mean_kv_usage"] == pytest.approx(np.mean(s.kv_usage))
    assert summary["num_preemptions"] == s.preemptions
    assert summary["prefix_cache_hit_rate"] == pytest.approx(sum(log["hits"]) / sum(log["prompt"]))
    # Means are exact (sum / count); quantiles fall in the bucket of the true quantile.
    for role in ("ttft", "tpot", "itl", "e2e"):
        assert summary[f"mean_{role}"] == pytest.approx(np.mean(log[role]))
        bounds = dict(mf.VLLM.histograms)[role][1]
        for stat, q in (("median", 0.5), ("p99", 0.99)):
            assert_same_bucket(summary[f"{stat}_{role}"], np.quantile(log[role], q, method="inverted_cdf"),
                               bounds)
    assert summary["mean_queue_time"] == pytest.approx(np.mean(log["queue_time"]))
    assert "p99_tpot" not in unknown


def assert_same_bucket(estimate, truth, bounds):
    edges = [0.0, *bounds, math.inf]
    b = next(i for i in range(1, len(edges)) if truth <= edges[i])
    assert edges[b - 1] <= estimate <= edges[b], (estimate, truth, edges[b - 1], edges[b])


@pytest.mark.parametrize("seed", range(5))
def test_histogram_quantiles_of_a_real_prometheus_client_histogram_agree_with_numpy(seed):
    rng = np.random.default_rng(seed)
    values = rng.lognormal(np.log(0.05), 1.0, 2000)
    registry = CollectorRegistry()
    h = PromHistogram("x_seconds", "x", buckets=mf.VLLM_TOKEN, registry=registry)
    for v in values:
        h.observe(v)
    hist = mf.histogram_of(generate_latest(registry).decode(), "x_seconds")
    assert hist.count == len(values) and hist.mean == pytest.approx(values.mean())
    for q in (0.1, 0.5, 0.9, 0.99):
        assert_same_bucket(hist.quantile(q), np.quantile(values, q, method="inverted_cdf"), mf.VLLM_TOKEN)


def test_histogram_quantile_follows_prometheus_rules():
    h = Histogram((1.0, 2.0, 4.0, math.inf), (10.0, 20.0, 30.0, 30.0), 50.0)
    assert h.quantile(0.5) == 1.5                      # rank 15: halfway through (1, 2]
    assert h.quantile(0.25) == 0.75                    # rank 7.5 of 10 in the first bucket, from 0
    assert h.quantile(1.0) == 4.0
    over = Histogram((1.0, 2.0, math.inf), (1.0, 2.0, 10.0), 50.0)
    assert over.quantile(0.99) == 2.0                  # in +Inf: the highest finite bound
    assert Histogram((0.0, 1.0, math.inf), (5.0, 10.0, 10.0), 2.0).quantile(0.2) == 0.0
    assert math.isnan(Histogram((1.0, math.inf), (0.0, 0.0), 0.0).quantile(0.5))
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        h.quantile(1.5)


def test_older_vllm_names_are_found_and_named():
    live = live_of("vllm-0.8", "overload")
    assert live.sources["kv_usage"].startswith("vllm:gpu_cache_usage_perc (vLLM < 0.10")
    assert live.sources["prefix_hits"].startswith("vllm:gpu_prefix_cache_hits_total")
    assert live.sources["itl"].startswith("vllm:time_per_output_token_seconds (the per-token gaps' name before 0.11")
    assert live.sources["tpot"].startswith("stand-in: vllm:time_per_output_token_seconds")
    # Mean with mean: the mean gap is the token-weighted mean TPOT; a p99 of gaps is no p99 of TPOT.
    assert live.summary["mean_tpot"] == live.summary["mean_itl"]
    assert "p99_tpot" not in live.summary and "not a p99 of TPOT" in live.unknown["p99_tpot"]
    new = live_of("vllm", "overload")
    assert new.sources["tpot"].startswith("vllm:request_time_per_output_token_seconds")
    assert new.sources["itl"].startswith("vllm:inter_token_latency_seconds")
    # v0.11 exports the gaps under both names and no per-request TPOT: the new name, and the stand-in.
    v011 = live_of("vllm-0.11", "overload")
    assert v011.sources["itl"].startswith("vllm:inter_token_latency_seconds")
    assert v011.sources["tpot"].startswith("stand-in: vllm:inter_token_latency_seconds")
    assert v011.diagnosis.stage == new.diagnosis.stage == "overload"


def test_what_a_dialect_lacks_is_stated_not_guessed():
    live = live_of("sglang-old", "overload")
    assert live.unknown["num_preemptions"] == "metric sglang:num_retracted_requests_total not exported"
    assert live.unknown["arrival_rate"] == "metric sglang:num_requests_total not exported"
    assert "num_preemptions" not in live.summary and "arrival_rate" not in live.summary
    text = str(live.diagnosis)
    assert "num_preemptions: unknown (metric sglang:num_retracted_requests_total not exported)" in text
    # No hit counters: the hit-rate gauge, named as such.
    assert live.sources["prefix_hit_rate"].startswith("sglang:cache_hit_rate")


def test_without_the_gpu_and_model_the_crossover_step_is_skipped_with_a_line():
    knobs = knobs_of("batch_too_small") | {"crossover": None, "crossover_note": None}
    before, after = (p.read_text() for p in mf.paths("vllm", "batch_too_small"))
    live = mf.diagnose_texts(before, after, mf.WINDOW, ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO, **knobs)
    assert live.crossover == SKIPPED_CROSSOVER
    assert f"crossover: unknown ({SKIPPED_CROSSOVER})" in str(live.diagnosis)
    # Without the crossover it cannot blame the batch: the generic capacity advice.
    assert live.diagnosis.stage == "queueing" and live.diagnosis.action.startswith("add capacity")
    assert live_of("vllm", "healthy", max_num_seqs=None).unknown["max_num_seqs"] == NO_MAX_NUM_SEQS


def test_a_checkpoint_config_gives_the_same_crossover_as_the_preset(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    at, note = crossover_of("A100_SXM_80GB", model_dir=str(tmp_path))
    # The preset rounds the parameter count; KV reads make the crossover sensitive to it as
    # they near the compute per request (and past it, no batch is compute-bound).
    for context, rel in ((0, 1e-6), (20, 0.01), (1000, 0)):
        assert at(context) == pytest.approx(crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16", context), rel=rel)
    assert note.startswith("A100-SXM4-80GB, ")
    assert crossover_of() is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(model_spec="LLAMA_7B"), "needs both the GPU"),
    (dict(hardware="A100_SXM_80GB"), "needs both the GPU"),
    (dict(hardware="A100_SXM_80GB", model_spec="LLAMA_7B", model_dir="x"), "not both"),
    (dict(hardware="TPU", model_spec="LLAMA_7B"), "unknown hardware preset 'TPU'"),
    (dict(hardware="A100_SXM_80GB", model_spec="GPT5"), "unknown model spec 'GPT5'"),
])
def test_bad_crossover_flags_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        crossover_of(**kwargs)


def scrape_text(engine, scenario, n):
    return mf.paths(engine, scenario)[n].read_text()


@pytest.mark.parametrize("before, after, seconds, message", [
    ("vllm", "vllm", 0, "seconds must be a positive finite number"),
    ("vllm", "sglang", 60, "different engines"),
    ("empty", "vllm", 60, "exactly one engine"),
    ("reset", "vllm", 60, "went down .* the server restarted"),
])
def test_bad_windows_are_refused_with_a_reason(before, after, seconds, message):
    texts = {"vllm": scrape_text("vllm", "overload", 1), "sglang": scrape_text("sglang", "overload", 1),
             "empty": "# nothing here\n", "reset": scrape_text("vllm", "overload", 1)}
    first = texts[before]
    second = scrape_text("vllm", "overload", 0) if before == "reset" else texts[after]
    with pytest.raises(ValueError, match=message):
        window = Window(parse_metrics(first), parse_metrics(second), seconds)
        window_summary(window)


def test_several_models_need_a_choice():
    one = scrape_text("vllm", "healthy", 0)
    two = one + one.replace(mf.MODEL, "other-model").split("\n", 1)[1].replace("# HELP", "# x").replace(
        "# TYPE", "# x")
    with pytest.raises(ValueError, match="several models .*choose one with --model"):
        Window(parse_metrics(two), parse_metrics(two), 60)
    assert Window(parse_metrics(two), parse_metrics(two), 60, model="other-model").model == "other-model"


@pytest.mark.parametrize("text, message", [("vllm:x{ 1", "line 1: expected a sample"), (b"x 1", "must be a str")])
def test_what_is_not_prometheus_text_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_metrics(text)


def test_metrics_url():
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/metrics/") == "http://h:8000/metrics"
    with pytest.raises(ValueError, match="url must start with http"):
        metrics_url("h:8000")


def test_cli_once_prints_the_diagnosis_and_json(capsys):
    first, second = (str(p) for p in mf.paths("sglang", "batch_too_small"))
    main(["diagnose", "--once", first, second, "--window", "60", "--hardware", "A100_SXM_80GB",
          "--model-spec", "LLAMA_7B", "--max-num-seqs", "8"])
    text = capsys.readouterr().out
    assert "[queueing]" in text and "raise max_num_seqs" in text
    assert "tpot              stand-in: sglang:inter_token_latency_seconds" in text
    main(["diagnose", "--once", first, second, "--crossover", "153", "--max-num-seqs", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "sglang" and out["diagnosis"]["stage"] == "queueing"
    assert out["crossover"] == "153 (given)"
    assert out["diagnosis"]["evidence"]["p99_ttft (s) vs ttft_slo"][1] == TTFT_SLO


def test_cli_errors_exit_with_the_reason(capsys, tmp_path):
    first, second = (str(p) for p in mf.paths("vllm", "healthy"))
    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "--once", first, second, "--model-spec", "LLAMA_7B"])
    assert exc.value.code == 2
    assert "needs both the GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diagnose", "--url", "http://127.0.0.1:9", "--window", "0.01", "--timeout", "1"])
    assert "could not read http://127.0.0.1:9/metrics" in capsys.readouterr().err


# ---- our own server: real scrapes on 127.0.0.1 under controlled load -------------------

TINY = ["serve", "--model", "tiny", "--seed", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def servers():
    """Three real servers, started together: a batch capped at 2, a `small` model with 32
    seats, and one without prefix caching."""
    procs = {"capped": ServerProcess(TINY + ["--max-num-seqs", "2"]),
             "wide": ServerProcess(["serve", "--model", "small", "--seed", "0", "--threads", "1",
                                    "--max-num-seqs", "32"]),
             "no_cache": ServerProcess(TINY + ["--max-num-seqs", "8", "--no-enable-prefix-caching"])}
    try:
        yield {name: p.wait() for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def diagnose_under(server, specs, warm=1.5, window=2.0, **knobs):
    return diagnose_under_load(server.url, specs, window, warm, **knobs)


def shared_prefix(n, rate):
    specs = make_workload("shared-prefix", n, rate=rate, seed=0, max_len=512, length_scale=0.25,
                          num_prefix_groups=2)
    return specs, sum(s.prefix_len for s in specs) / sum(s.prompt_len for s in specs)


# The crossover of `tiny` and `small` on this CPU lies past 16: a decode step of 16
# requests costs well under 16 single steps (measured: tiny 1.6 ms at 1, 2.7 ms at 16).
CPU_CROSSOVER = 16


def test_live_server_batch_too_small(servers):
    # 120 requests/s against 2 seats, which serve 15-50/s depending on the CPU (an AMD EPYC
    # with a 32 MiB L3 finished 45-48/s, too close to the 60/s this once sent): the queue
    # grows, TTFT is the wait. 600 requests keep arriving through the warm-up and the window.
    specs = make_workload("mixed", 600, rate=120, seed=0, max_len=512, length_scale=0.25)
    live = diagnose_under(servers["capped"], specs, ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO,
                          crossover=CPU_CROSSOVER, max_num_seqs=2)
    s, d = live.summary, live.diagnosis
    assert live.engine == "tinyserve" and live.sources["ttft"] == "tinyserve:time_to_first_token_seconds"
    assert s["arrival_rate"] > 1.3 * s["request_throughput"] and s["queue_growth_rate"] > 0, str(live)
    # Generated tokens / steps: both seats sample in nearly every step (a finished request's
    # seat is filled, prefill and first token, in the next). The running gauge read at the
    # two scrapes said 1 once, beside a busy loop: each landed between a finish and an admission.
    assert live.sources["step_tokens"].startswith("tinyserve:iteration_tokens_total")
    assert 1.8 <= s["mean_batch_size"] <= 2, str(live)
    assert d.stage == "queueing" and d.action.startswith("raise max_num_seqs"), str(live)
    # Ours has no queue-time histogram: the queue length stood in, and that is said.
    assert d.unknown["mean_queue_time"] == "tinyserve exports no queue-time histogram"


def test_live_server_healthy_then_overloaded(servers):
    wide = servers["wide"]
    alone = benchmark(wide.url, make_workload("mixed", 4, rate=2, seed=1, max_len=1024,
                                              length_scale=0.25), progress=False)
    tpot_slo = 2 * alone["p99_tpot"]            # twice what one request alone takes here
    specs, share = shared_prefix(16, rate=5)
    calm = diagnose_under(wide, specs, ttft_slo=TTFT_SLO, tpot_slo=max(tpot_slo, TPOT_SLO),
                          crossover=CPU_CROSSOVER, max_num_seqs=32, prefix_share=share)
    assert calm.diagnosis.stage == "healthy", str(calm)
    assert calm.summary["prefix_cache_hit_rate"] > share / 2
    # 80 requests/s against ~30: 32 seats fill, every step slows, and the queue grows.
    busy = diagnose_under(wide, make_workload("mixed", 400, rate=80, seed=2, max_len=1024,
                                              length_scale=0.25),
                          ttft_slo=TTFT_SLO, tpot_slo=tpot_slo, crossover=CPU_CROSSOVER, max_num_seqs=32)
    s, d = busy.summary, busy.diagnosis
    assert d.stage == "overload" and d.action.startswith("add capacity"), str(busy)
    assert s["queue_growth_rate"] > 0 and s["mean_batch_size"] > 24
    assert s["p99_tpot"] > tpot_slo > alone["p99_tpot"]


def test_live_server_without_prefix_caching_has_a_low_hit_rate(servers):
    specs, share = shared_prefix(16, rate=5)
    live = diagnose_under(servers["no_cache"], specs, ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO,
                          crossover=CPU_CROSSOVER, max_num_seqs=8, prefix_share=share)
    assert live.summary["prefix_cache_hit_rate"] == 0.0
    assert "prefix caching is off" in live.sources["prefix_queries"]
    assert live.diagnosis.stage == "cache", str(live)
    assert live.diagnosis.action.startswith("enable_prefix_caching=True")
