"""diagnose(): the chapter's tuning order, on summaries of real simulator runs.

Each branch is reached from a simulate()/simulate_cluster() run built to have
that one problem, and the fix the diagnosis names is checked to move the metric.
A few hand-made summaries cover the edges (batch capped while SLOs hold,
compute-bound batch, bad input).
"""

import math

import pytest

from tinyserve.sim.cluster import simulate_cluster
from tinyserve.hardware import A100_SXM_80GB, LLAMA_7B, crossover_batch
from tinyserve.diagnose import STAGES, Diagnosis, diagnose
from tinyserve.sim import simulate
from tinyserve.workload import make_workload

TTFT_SLO, TPOT_SLO = 0.5, 0.025
CROSSOVER = crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16")


def summary_of(result):
    return result.summary(ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO)


def chat_and_documents(seed=0):
    """Chat turns (short prompt, long answer) mixed with long documents (long prompt)."""
    chat = make_workload("short-in-long-out", 160, rate=8, seed=seed)
    docs = make_workload("long-in-short-out", 60, rate=3, seed=seed + 1, length_scale=1.5)
    return sorted(chat + docs, key=lambda s: s.arrival)


def prefix_share(specs):
    return sum(s.prefix_len for s in specs) / sum(s.prompt_len for s in specs)


@pytest.fixture(scope="module")
def mixed():
    return make_workload("mixed", 300, rate=10, seed=0)


def test_healthy_system_reaches_the_model_levers_last(mixed):
    d = diagnose(summary_of(simulate(mixed)), TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=256)
    assert isinstance(d, Diagnosis) and d.stage == "healthy"
    assert "quantization" in d.action and "speculative decoding" in d.action
    assert d.evidence["p99_ttft (s) vs ttft_slo"][1] == TTFT_SLO
    assert d.next == []


def test_overload_both_slow_and_capacity_fixes_it():
    specs = make_workload("mixed", 400, rate=60, seed=0)
    s = summary_of(simulate(specs))
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=256)
    assert d.stage == "overload"
    assert s["p99_ttft"] > TTFT_SLO and s["p99_tpot"] > TPOT_SLO
    assert d.evidence["queue_growth_rate"] > 1 and d.evidence["max_queue_length"] > 50
    assert "add capacity" in d.action
    # The fix it names: four replicas serve what one could not.
    fixed = summary_of(simulate_cluster(specs, num_replicas=4, routing="least_outstanding"))
    assert diagnose(fixed, TTFT_SLO, TPOT_SLO).stage == "healthy"
    assert fixed["goodput"] > 5 * s["goodput"]


def test_capped_small_batch_is_queueing_and_raising_max_num_seqs_fixes_it(mixed):
    s = summary_of(simulate(mixed, max_num_seqs=4))
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=4)
    assert d.stage == "queueing"
    assert d.evidence["queue share of TTFT (queueing at >= 50%)"] > 0.9
    assert "raise max_num_seqs" in d.action
    assert d.next[0].startswith("batch size")
    # Without the batch context it cannot blame the batch: the generic capacity advice.
    assert "add capacity" in diagnose(s, TTFT_SLO, TPOT_SLO).action
    fixed = summary_of(simulate(mixed, max_num_seqs=64))
    assert fixed["p99_ttft"] < TTFT_SLO < s["p99_ttft"]


def test_slow_prefill_without_queueing():
    specs = make_workload("long-in-short-out", 100, rate=2, seed=0)
    s = summary_of(simulate(specs))
    d = diagnose(s, 0.05, TPOT_SLO)
    assert d.stage == "prefill"
    assert d.evidence["queue share of TTFT (queueing at >= 50%)"] < 0.5
    assert d.evidence["prefill_token_share"] > 0.9


def test_unchunked_prefills_stall_decodes_and_chunking_fixes_it():
    specs = chat_and_documents()
    s = summary_of(simulate(specs, enable_chunked_prefill=False, max_num_batched_tokens=8192))
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=256)
    assert d.stage == "decode"
    assert "enable_chunked_prefill" in d.action
    assert d.evidence["p99_itl / median_itl (stalls at >= 6)"] >= 6
    fixed = summary_of(simulate(specs, enable_chunked_prefill=True, max_num_batched_tokens=512))
    assert fixed["p99_itl"] < s["p99_itl"] / 3
    assert diagnose(fixed, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=256).stage == "healthy"


def test_bandwidth_bound_decode_points_to_model_levers():
    s = summary_of(simulate(make_workload("mixed", 300, rate=20, seed=0)))
    d = diagnose(s, 0.5, 0.02, crossover=CROSSOVER, max_num_seqs=256)
    assert d.stage == "decode"
    assert "memory bandwidth" in d.finding and "quantization" in d.action


def test_lost_prefix_reuse_on_one_engine():
    specs = make_workload("shared-prefix", 200, rate=20, seed=0)
    share = prefix_share(specs)
    cold = summary_of(simulate(specs, enable_prefix_caching=False))
    d = diagnose(cold, TTFT_SLO, TPOT_SLO, prefix_share=share)
    assert d.stage == "cache" and "enable_prefix_caching" in d.action
    warm = summary_of(simulate(specs, enable_prefix_caching=True))
    assert diagnose(warm, TTFT_SLO, TPOT_SLO, prefix_share=share).stage == "healthy"
    assert warm["mean_ttft"] < cold["mean_ttft"]
    # Not told about prefix reuse, it does not judge the cache.
    assert diagnose(cold, TTFT_SLO, TPOT_SLO).stage == "healthy"


@pytest.fixture(scope="module")
def many_prefixes():
    # 64 system prompts, more than one replica's cache holds: round robin spreads each
    # prefix over all replicas and evicts it, cache-aware routing keeps it in one place.
    specs = make_workload("shared-prefix", 400, rate=80, seed=0, num_prefix_groups=64, prefix_len=1024)
    runs = {routing: simulate_cluster(specs, num_replicas=4, routing=routing,
                                      enable_prefix_caching=True, num_kv_blocks=2500)
            for routing in ("round_robin", "cache_aware")}
    return specs, runs


def test_round_robin_loses_prefix_hits_and_cache_aware_routing_recovers_them(many_prefixes):
    specs, runs = many_prefixes
    share = prefix_share(specs)
    rr, ca = summary_of(runs["round_robin"]), summary_of(runs["cache_aware"])
    d = diagnose(rr, TTFT_SLO, TPOT_SLO, prefix_share=share, routing="round_robin")
    assert d.stage in ("cache", "decode", "overload")
    assert "cache-aware" in d.action
    assert d.evidence["routing"] == "round_robin"
    assert diagnose(ca, TTFT_SLO, TPOT_SLO, prefix_share=share, routing="cache_aware").stage == "healthy"
    assert ca["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.2
    assert ca["mean_ttft"] < rr["mean_ttft"]


def test_batch_capped_below_crossover_while_slos_hold():
    s = {"p99_ttft": 0.2, "p99_tpot": 0.01, "mean_batch_size": 7.5}
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, max_num_seqs=8)
    assert d.stage == "batch" and "raise max_num_seqs" in d.action
    assert d.evidence["mean_batch_size"] == 7.5
    # Near the crossover, or not capped, the batch is no problem.
    assert diagnose(s | {"mean_batch_size": 120.0}, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER,
                    max_num_seqs=128).stage == "healthy"
    assert diagnose(s | {"mean_batch_size": 3.0}, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER,
                    max_num_seqs=8).stage == "healthy"


def test_batch_past_the_crossover_makes_decode_compute_bound():
    s = {"p99_ttft": 0.2, "p99_tpot": 0.08, "mean_batch_size": 300.0, "median_itl": 0.05, "p99_itl": 0.09}
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER)
    assert d.stage == "decode" and "lower max_num_seqs" in d.action


def test_stat_selects_the_percentile_compared_with_the_slo():
    s = {"p99_ttft": 0.9, "p99_tpot": 0.01, "median_ttft": 0.1, "median_tpot": 0.01}
    assert diagnose(s, TTFT_SLO, TPOT_SLO, stat="median").stage == "healthy"
    assert diagnose(s, TTFT_SLO, TPOT_SLO).stage == "queueing"   # no queue data: assume queueing


def test_every_returned_stage_is_listed_and_str_shows_the_evidence(mixed):
    d = diagnose(summary_of(simulate(mixed, max_num_seqs=4)), TTFT_SLO, TPOT_SLO,
                 crossover=CROSSOVER, max_num_seqs=4)
    assert d.stage in STAGES
    text = str(d)
    assert text.startswith("[queueing]") and "action:" in text and "mean_batch_size" in text


@pytest.mark.parametrize("kwargs, message", [
    (dict(ttft_slo=0), "ttft_slo must be a positive finite number"),
    (dict(tpot_slo=-1), "tpot_slo must be a positive finite number"),
    (dict(tpot_slo=math.nan), "tpot_slo must be a positive finite number"),
    (dict(ttft_slo="0.5"), "ttft_slo must be a positive finite number"),
    (dict(crossover=0), "crossover must be a positive finite number"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer >= 1"),
    (dict(prefix_share=1.5), r"prefix_share must be in \[0, 1\]"),
    (dict(routing=3), "routing must be a policy name"),
    (dict(stat="p90"), "stat must be one of"),
])
def test_bad_arguments_name_the_field(kwargs, message):
    args = dict(ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO) | kwargs
    with pytest.raises(ValueError, match=message):
        diagnose({"p99_ttft": 0.1, "p99_tpot": 0.01}, **args)


@pytest.mark.parametrize("summary, message", [
    ({"p99_tpot": 0.01}, "summary: missing key 'p99_ttft'"),
    ({"p99_ttft": 0.1}, "summary: missing key 'p99_tpot'"),
    ({"p99_ttft": "fast", "p99_tpot": 0.01}, "summary: 'p99_ttft' must be a number"),
    ({"p99_ttft": math.nan, "p99_tpot": math.nan}, "no completed requests"),
    ([("p99_ttft", 0.1)], "summary must be a dict"),
])
def test_bad_summaries_are_rejected(summary, message):
    with pytest.raises(ValueError, match=message):
        diagnose(summary, TTFT_SLO, TPOT_SLO)


def test_summary_load_keys_tell_a_stable_queue_from_a_growing_one(mixed):
    calm = simulate(mixed).summary()
    busy = simulate(make_workload("mixed", 300, rate=60, seed=0)).summary()
    assert abs(calm["queue_growth_rate"]) < 0.5 < busy["queue_growth_rate"]
    for s in (calm, busy):
        assert 0 <= s["mean_queue_time"] <= s["mean_ttft"]
        assert 0 < s["prefill_token_share"] < 1 and 0 < s["mean_kv_usage"] <= 1
    assert calm["arrival_rate"] == pytest.approx(299 / (mixed[-1].arrival - mixed[0].arrival))


def test_overload_with_inter_token_spikes_also_points_at_prefill_chunking():
    s = {"p99_ttft": 5.0, "p99_tpot": 0.07, "median_itl": 0.015, "p99_itl": 0.12}
    d = diagnose(s, TTFT_SLO, TPOT_SLO)
    assert d.stage == "overload"
    assert d.action.startswith("add capacity") and "enable_chunked_prefill" in d.action
    calm = diagnose(s | {"p99_itl": 0.03}, TTFT_SLO, TPOT_SLO)
    assert "enable_chunked_prefill" not in calm.action


# ---- what a live server does not export (unknown) -------------------------------------

LOAD = {"max_queue_length": 40.0, "queue_growth_rate": 0.0, "arrival_rate": 9.0, "request_throughput": 9.0}


def test_without_a_percentile_the_stage_is_unknown_and_says_why():
    why = "metric tinyserve:time_to_first_token_seconds not exported"
    d = diagnose({"p99_tpot": 0.01} | LOAD, TTFT_SLO, TPOT_SLO, unknown={"p99_ttft": why})
    assert d.stage == "unknown" and d.stage in STAGES
    assert "p99_ttft" in d.finding
    assert d.evidence["p99_tpot (s) vs tpot_slo"] == (0.01, TPOT_SLO)
    assert d.evidence["arrival_rate"] == 9.0
    assert f"p99_ttft: unknown ({why})" in str(d)
    # Without TTFT, a queue that takes up arrivals the server does not finish is still overload.
    backlog = LOAD | {"queue_growth_rate": 2.0, "request_throughput": 5.0}
    assert diagnose({"p99_tpot": 0.01} | backlog, TTFT_SLO, TPOT_SLO, unknown={"p99_ttft": why}).stage == "overload"
    # Missing without a reason is still an error: a summary of ours never lacks it.
    with pytest.raises(ValueError, match="missing key 'p99_ttft'"):
        diagnose({"p99_tpot": 0.01}, TTFT_SLO, TPOT_SLO)


def test_unknown_inter_token_gaps_do_not_pass_for_the_bandwidth_floor():
    s = {"p99_ttft": 0.2, "p99_tpot": 0.08, "mean_batch_size": 20.0}
    gaps = {"median_itl": "no ITL histogram", "p99_itl": "no ITL histogram"}
    d = diagnose(s, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER, unknown=gaps)
    assert d.stage == "decode" and "memory bandwidth" not in d.finding
    assert "cannot be told from the bandwidth floor" in d.finding
    assert d.action.startswith("try enable_chunked_prefill")
    assert "median_itl, p99_itl: unknown (no ITL histogram)" in str(d)
    # Known gaps without a spike: the bandwidth floor, as before.
    known = diagnose(s | {"median_itl": 0.07, "p99_itl": 0.09}, TTFT_SLO, TPOT_SLO, crossover=CROSSOVER)
    assert "memory bandwidth" in known.finding


def test_without_queue_times_the_queue_length_tells_queueing_from_prefill():
    slow_first = {"p99_ttft": 2.0, "p99_tpot": 0.01, "mean_ttft": 1.0}
    why = {"mean_queue_time": "no queue-time histogram"}
    assert diagnose(slow_first | {"max_queue_length": 12.0}, TTFT_SLO, TPOT_SLO, unknown=why).stage == "queueing"
    assert diagnose(slow_first | {"max_queue_length": 0.0}, TTFT_SLO, TPOT_SLO, unknown=why).stage == "prefill"


def test_an_unexported_hit_rate_is_not_judged_as_lost():
    s = {"p99_ttft": 0.2, "p99_tpot": 0.01}
    # Never looked up (a summary without the key): lost, as before.
    assert diagnose(s, TTFT_SLO, TPOT_SLO, prefix_share=0.9).stage == "cache"
    d = diagnose(s, TTFT_SLO, TPOT_SLO, prefix_share=0.9,
                 unknown={"prefix_cache_hit_rate": "metric x not exported"})
    assert d.stage == "healthy" and d.finding.startswith("就已知的指标而言")
    assert "as far as the exported metrics show" in d.finding
    assert "prefix_cache_hit_rate: unknown (metric x not exported)" in str(d)


@pytest.mark.parametrize("unknown", [["p99_ttft"], {"p99_ttft": 3}, {1: "why"}])
def test_unknown_must_map_keys_to_reasons(unknown):
    with pytest.raises(ValueError, match="unknown must map keys to reasons"):
        diagnose({"p99_ttft": 0.1, "p99_tpot": 0.01}, TTFT_SLO, TPOT_SLO, unknown=unknown)


def test_overload_evidence_shows_the_kv_cache_and_preemptions():
    s = {"p99_ttft": 5.0, "p99_tpot": 0.07, "mean_kv_usage": 0.98, "num_preemptions": 40.0} | LOAD
    d = diagnose(s, TTFT_SLO, TPOT_SLO)
    assert d.evidence["mean_kv_usage"] == 0.98 and d.evidence["num_preemptions"] == 40.0
