"""The simulator against published vLLM runs (tinyserve.sim.fidelity): the data, the
split, the front end, and the held-out errors within the issue's bounds.

Everything is computed from the data file and the simulator; nothing is a stored
prediction.
"""

import json
import math

import numpy as np
import pytest

from tinyserve.sim import fidelity, simulate
from tinyserve.sim.cost_model import ROOFLINE, VLLM_LIKE
from tinyserve.workload import RequestSpec

# Held out like the others, but at 32-512 concurrent requests of a 14B model, outside the
# goal (its "in_goal": false in the data file): the bounds of
# test_held_out_errors_stay_within_the_bounds were set on the sources of at most 48; where
# vllm-like misses this one, and which terms are at fault, the tests at the end say.
HIGH_CONCURRENCY = "notes-rtx-pro-6000-phi4"


def test_no_source_is_on_both_sides_of_the_split():
    splits = fidelity.splits_by_source()
    assert set(splits.values()) == {"calibration", "held-out"}
    calibration = {m["source"] for m in fidelity.measurements("calibration")}
    held_out = {m["source"] for m in fidelity.measurements("held-out")}
    assert not calibration & held_out
    assert set(fidelity.published()["sources"]) == calibration | held_out
    # The check itself refuses a source on both sides.
    rows = fidelity.measurements()
    mixed = [dict(rows[0], split="held-out" if rows[0]["split"] == "calibration" else "calibration")]
    with pytest.raises(ValueError, match="has points in both splits"):
        fidelity.splits_by_source(rows + mixed)


def test_a_seeded_benchmark_is_drawn_again_exactly():
    # nano-vllm's bench.py: its README prints 133,966 output tokens; the 142,827 prompt
    # tokens are what a rerun of the same script reports.
    m = next(m for m in fidelity.measurements() if "seeded_lengths" in m["workload"])
    specs = fidelity.workload(m)
    assert len(specs) == 256
    assert sum(s.output_len for s in specs) == 133_966
    assert sum(s.prompt_len for s in specs) == 142_827
    assert all(100 <= s.prompt_len <= 1024 and 100 <= s.output_len <= 1024 for s in specs)
    assert all(s.arrival == 0.0 for s in specs)            # offline: one batch at t=0


def test_a_source_that_printed_only_totals_borrows_a_recorded_shape():
    # The RTX PRO 6000 notes print total tokens only: the lengths are the Lambda ShareGPT
    # trace's, cycled to 1000 requests and scaled to the run's totals.
    m = next(m for m in fidelity.measurements() if m["id"] == "rtxpro6000-phi4-sharegpt-c32")
    specs = fidelity.workload(m)
    assert len(specs) == 1000 and all(s.arrival == 0.0 for s in specs)
    assert sum(s.prompt_len for s in specs) == pytest.approx(214_316, rel=0.005)
    assert sum(s.output_len for s in specs) == pytest.approx(91_928, rel=0.005)
    trace = next(t for t in fidelity.measurements() if t["id"] == "h100-mistral7b-sharegpt320-v0.5.4")
    longest = max(range(320), key=trace["workload"]["input_lens"].__getitem__)
    assert max(s.prompt_len for s in specs) == specs[longest].prompt_len == specs[longest + 320].prompt_len
    # Run after the same prompts on the same server: simulated with their blocks cached.
    assert m["workload"]["warm_prefix_cache"] and m["engine"]["enable_prefix_caching"]
    hits = fidelity.predict(m, "roofline", extra=("prefix_cache_hit_rate",))["prefix_cache_hit_rate"]
    first = next(r for r in fidelity.measurements() if r["id"] == "rtxpro6000-phi4-sharegpt-all-at-once")
    assert hits > 0.3 and fidelity.predict(first, "roofline", extra=("prefix_cache_hit_rate",))[
        "prefix_cache_hit_rate"] == 0


def test_runs_the_simulator_cannot_price_are_listed_with_why():
    # MoE, state-space and sliding-window models, FP4 weights: found, named, never fitted.
    skipped = fidelity.published()["not_modelled"]
    assert any("MoE" in e["why"] for e in skipped)
    for e in skipped:
        assert all(e[k] for k in ("where", "engine", "gpu", "model", "load", "why")), e
    assert not any("Nemotron" in str(m["model"]) or "Scout" in str(m["model"]) for m in fidelity.measurements())


def test_a_rate_gives_poisson_arrivals_at_that_rate():
    m = next(m for m in fidelity.measurements() if "request_rate" in m["workload"])
    arrivals = [s.arrival for s in fidelity.workload(m)]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    rate = (len(arrivals) - 1) / arrivals[-1]
    assert rate == pytest.approx(m["workload"]["request_rate"], rel=0.15)


def test_the_front_end_serves_one_request_at_a_time():
    # 50 requests at once behind a server that takes 10 ms of its thread per request:
    # the k-th reaches the engine after (k + 1) x 10 ms + the latency, so the mean TTFT
    # grows by about 25 x 10 ms, and no more than 100 requests/s get through.
    specs = [RequestSpec(0.0, 16, 2) for _ in range(50)]
    engine = dict(hardware="H100_SXM", model="LLAMA_3_8B", dtype="bf16", max_num_seqs=256)
    alone = simulate(specs, **engine).summary()
    served = simulate(specs, frontend_time=0.01, frontend_latency=0.02, **engine).summary()
    assert served["mean_ttft"] - alone["mean_ttft"] == pytest.approx(0.255 + 0.02, rel=0.15)
    assert served["request_throughput"] <= 100.0
    first = min(o.metrics.ttft for o in simulate(specs, frontend_time=0.01, frontend_latency=0.02, **engine))
    assert first >= 0.03                                   # its own 10 ms + 20 ms before any step
    # No front end is the engine alone, step for step.
    plain = simulate(specs, **engine)
    zero = simulate(specs, frontend_time=0.0, frontend_latency=0.0, **engine)
    assert [s.duration for s in plain.steps] == [s.duration for s in zero.steps]
    with pytest.raises(ValueError, match="frontend_time must be >= 0"):
        simulate(specs, frontend_time=-1.0)


def test_offline_points_get_no_front_end():
    m = next(m for m in fidelity.measurements() if m["client"] == "offline")
    slow_server = VLLM_LIKE.with_params(frontend_time=1.0, frontend_latency=1.0)
    assert fidelity.predict(m, slow_server) == fidelity.predict(m, VLLM_LIKE)


@pytest.fixture(scope="module")
def comparisons():
    return fidelity.compare(("roofline", "vllm-like"))


def test_held_out_errors_stay_within_the_bounds(comparisons):
    worst = fidelity.worst(comparisons, "vllm-like", "held-out")
    # No held-out source prints a TPOT (the data file's sources say so): TPOT is bounded
    # where one appears.
    assert "throughput" in worst and "ttft" in worst
    for kind in ("throughput", "tpot"):
        if kind in worst:
            assert fidelity.miss(worst[kind], "vllm-like") <= fidelity.BOUNDS[kind], worst[kind]
    # TTFT within 2x wherever the server is not the bottleneck (RTX 4090, C <= 16).
    light = [r for r in comparisons if r.split == "held-out" and fidelity.METRIC_KINDS[r.metric] == "ttft"
             and r.id.startswith("rtx4090") and int(r.id.rsplit("c", 1)[1]) <= 16]
    assert light and all(fidelity.miss(r, "vllm-like") <= fidelity.BOUNDS["ttft"] for r in light)
    # Among the held-out points: two sources, preemption, and TTFT through an HTTP server.
    held = [m for m in fidelity.measurements("held-out") if fidelity.in_goal(m)]
    assert len({m["source"] for m in held}) >= 2
    assert any(fidelity.predict(m, VLLM_LIKE, extra=("num_preemptions",))["num_preemptions"] > 0
               for m in held)
    assert any(m["client"] == "http" and "mean_ttft" in m["measured"] for m in held)


@pytest.mark.xfail(strict=True, reason="RTX 4090, C >= 32: vLLM's TTFT is 2.5-5.5x the simulated one; "
                   "the calibration sources do not show what the server spends there (issue 29 report)")
def test_held_out_ttft_is_within_2x_at_every_concurrency(comparisons):
    worst = fidelity.worst(comparisons, "vllm-like", "held-out")
    assert fidelity.miss(worst["ttft"], "vllm-like") <= fidelity.BOUNDS["ttft"]


def test_the_roofline_is_far_too_fast_where_the_engine_calibration_is_not(comparisons):
    # The default teaching model is an upper bound on throughput: faster than vLLM on
    # every V1-era point. Its TTFT, with no front end, is far too short under load. (Its
    # TPOT is not a bound: with no server metering them in, all 500 H100 requests decode
    # at once in the roofline, and their KV reads make its steps longer than vLLM's.)
    by_id = {m["id"]: m for m in fidelity.measurements()}
    v1 = [r for r in comparisons if by_id[r.id].get("engine_generation") is None]
    speed = [r for r in v1 if fidelity.METRIC_KINDS[r.metric] == "throughput"]
    assert all(r.speed_error("roofline") > 0 for r in speed)
    ttft = [r for r in v1 if r.metric == "mean_ttft" and r.measured > 1.0]
    assert ttft and all(r.error("roofline") < 0 for r in ttft)
    # Far too short where the wait is the server's (500 small requests at once on an H100),
    # not prefill compute (1000 ShareGPT prompts at once on a 14B model: -30%).
    assert all(r.error("roofline") < -0.5 for r in ttft if r.source == "kvcached-h100")


def test_the_worst_row_is_the_largest_miss():
    rows = [fidelity.Comparison("h100-qwen3-0.6b-rate16", "kvcached-h100", "calibration", "mean_ttft",
                                0.04, {"m": 0.01}),
            fidelity.Comparison("h100-qwen3-0.6b-rate16", "kvcached-h100", "calibration", "mean_ttft",
                                0.04, {"m": 0.1}),
            fidelity.Comparison("h100-qwen3-0.6b-rate16", "kvcached-h100", "calibration", "mean_tpot",
                                0.002, {"m": 0.0025})]
    worst = fidelity.worst(rows, "m", "calibration")
    assert fidelity.miss(worst["ttft"], "m") == pytest.approx(4.0)   # 4x too short beats 2.5x too long
    assert fidelity.miss(worst["tpot"], "m") == pytest.approx(0.25)
    assert math.isclose(fidelity.miss(rows[1], "m"), 2.5)


def test_the_roofline_preset_is_untouched_by_the_calibrated_terms():
    assert ROOFLINE.name == "roofline" and not hasattr(ROOFLINE, "frontend_time")
    assert simulate([RequestSpec(0.0, 100, 4)]).config["cost_model"] == "roofline"


def test_the_fidelity_report_simulates_each_point_once_per_cost_model(monkeypatch):
    """``bench sim --fidelity`` prints the simulated batch and preemptions beside the
    errors: from the same runs as the predictions (one per point and model), not from
    runs of their own, and equal to what ``predict`` reports for that point."""
    from tinyserve.bench import sim as bench_sim

    few = sorted(fidelity.measurements(), key=lambda m: len(fidelity.workload(m)))[:2]   # quick ones
    monkeypatch.setattr(fidelity, "measurements",
                        lambda split=None: [m for m in few if split in (None, m["split"])])
    runs = []
    real_simulate = fidelity.simulate
    monkeypatch.setattr(fidelity, "simulate", lambda *a, **k: runs.append(a) or real_simulate(*a, **k))
    report = bench_sim.published_fidelity("vllm-like", verbose=False)
    assert len(runs) == 2 * len(few)                          # roofline and vllm-like, once each
    extra = ("mean_batch_size", "num_preemptions")
    for m in few:
        predicted = fidelity.predict(m, "vllm-like", extra)
        assert report["running"][m["id"]] == {key: predicted[key] for key in extra}


def test_only_the_high_concurrency_source_is_outside_the_goal_and_it_says_why(comparisons):
    sources = fidelity.published()["sources"]
    outside = [name for name in sources if not fidelity.source_in_goal(name)]
    assert outside == [HIGH_CONCURRENCY] and sources[HIGH_CONCURRENCY]["why_not_in_goal"]
    # It is compared like every other source, and left out of the worst rows only.
    assert any(r.source == HIGH_CONCURRENCY for r in comparisons)
    for split in ("calibration", "held-out"):
        assert all(r.source != HIGH_CONCURRENCY for r in fidelity.worst(comparisons, "vllm-like", split).values())


@pytest.mark.xfail(strict=True, reason="RTX PRO 6000, Phi-4 14B, C=64-512: vllm-like's TPOT is 1.3-1.8x vLLM's and "
                   "its TTFT 2-5x, its throughput up to 16% low; the two terms at fault are tested below")
def test_the_high_concurrency_sweep_is_within_the_bounds(comparisons):
    rows = [r for r in comparisons if r.source == HIGH_CONCURRENCY]
    assert len(rows) >= 25
    for r in rows:
        assert fidelity.miss(r, "vllm-like") <= fidelity.BOUNDS[fidelity.METRIC_KINDS[r.metric]], r


def _sweep_point(concurrency, room_for_every_prompt=False, front_end=True):
    """vllm-like's predicted / measured TTFT and TPOT on one RTX PRO 6000 point, and its hit
    rate; optionally with twice vLLM's default cache (0.9 of 96 GiB less the weights: room
    for a whole run's prompts and answers and the next run's), or with no front end."""
    from tinyserve.sim.simulator import default_num_kv_blocks
    m = next(m for m in fidelity.measurements() if m["source"] == HIGH_CONCURRENCY
             and m["workload"].get("max_concurrency") == concurrency)
    if room_for_every_prompt:
        blocks = 2 * default_num_kv_blocks(fidelity.hardware_of(m), fidelity.model_of(m), m["dtype"], 16)
        m = dict(m, engine={**m["engine"], "num_kv_blocks": blocks})
    model = VLLM_LIKE if front_end else VLLM_LIKE.with_params(frontend_time=0.0, frontend_latency=0.0)
    p = fidelity.predict(m, model, extra=("prefix_cache_hit_rate",))
    return (p["mean_ttft"] / m["measured"]["mean_ttft"], p["mean_tpot"] / m["measured"]["mean_tpot"],
            p["prefix_cache_hit_rate"])


def test_the_high_concurrency_tpot_miss_is_the_prefix_cache_left_by_the_previous_run():
    # The default cache about holds one run's prompts and answers: the next run evicts what
    # it is about to need, and its misses are prefilled inside decode steps. A cache that
    # keeps them all brings TPOT within the 20% bound.
    _, tpot, hits = _sweep_point(128)
    assert tpot > 1.2 and hits < 0.6
    _, tpot, hits = _sweep_point(128, room_for_every_prompt=True)
    assert abs(tpot - 1) < 0.2 and hits > 0.9


def test_the_high_concurrency_ttft_miss_is_the_front_end():
    # With every prompt cached, prefill no longer explains the wait: the front end fitted on
    # the H100 source (10.6 ms of serial work per request) does, for a burst of 512 requests.
    ttft, _, _ = _sweep_point(512, room_for_every_prompt=True)
    assert ttft > 3
    ttft, _, _ = _sweep_point(512, room_for_every_prompt=True, front_end=False)
    assert ttft < 1


def live_run():
    """A sweep as ``tinyserve.bench.vllm_live.sweep`` records one (two shapes, two
    concurrencies and a Poisson rate each), its numbers those of the simulator with a
    known cost model."""
    from dataclasses import asdict

    from tinyserve.bench import vllm_live
    from tinyserve.hardware import HardwareSpec

    cpu = HardwareSpec("a 2-core CPU", {"fp32": 2e11, "bf16": 4e11}, 4e10, 24e9)
    run = {"model": "cpu-bench", "dtype": "float32", "hardware": asdict(cpu),
           "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
                      "enable_prefix_caching": True, "block_size": 16, "max_model_len": 1024},
           "enforce_eager": True, "start_up_s": 1.0, "points": []}
    for shape in ("mixed", "short-in-long-out"):
        for c, rate in ((1, None), (8, None), (None, 4.0)):
            run["points"].append({"shape": shape, "load": "poisson" if rate else f"c{c}", "concurrency": c,
                                  "request_rate": rate, "errors": 0, "measured": {},
                                  "workload": vllm_live.point_workload(shape, c, rate, seed=7),
                                  "vllm": {"mean_batch_size": float(c or 4), "num_preemptions": 0.0}})
    for m, p in zip(vllm_live.measurements(run), run["points"]):
        p["measured"] = fidelity.predict(m | {"measured": dict.fromkeys(vllm_live.MEASURED)}, LIVE_TRUTH)
    return run


LIVE_TRUTH = VLLM_LIKE.with_params(step_overhead=2e-3, frontend_time=5e-4)


def test_a_live_point_gives_the_client_and_the_simulator_the_same_requests():
    from tinyserve.bench import vllm_live

    w = vllm_live.point_workload("mixed", rate=3.0, seed=11)
    specs = fidelity.workload({"workload": w})
    assert len(specs) == vllm_live.POISSON_REQUESTS and "max_concurrency" not in w
    assert [s.prompt_len for s in specs] == w["input_lens"] and specs == fidelity.workload({"workload": w})
    gaps = np.diff([s.arrival for s in specs])
    assert (gaps >= 0).all() and 1 / 3.0 * 0.7 < gaps.mean() < 1 / 3.0 * 1.3
    assert len(vllm_live.point_workload("mixed", 4)["input_lens"]) == 16
    with pytest.raises(ValueError, match="a concurrency or a rate \\(one of the two\\)"):
        vllm_live.point_workload("mixed", 4, 3.0)


def test_the_live_fit_sees_the_calibration_shape_only(monkeypatch):
    from tinyserve.bench import vllm_live

    rows = vllm_live.measurements(live_run(), calibrate="short-in-long-out")
    assert {m["split"] for m in rows if "short-in-long-out" in m["id"]} == {"calibration"}
    assert {m["split"] for m in rows if "mixed" in m["id"]} == {"held-out"}
    fidelity.splits_by_source(rows)                     # one split per source
    seen, asked = [], {}
    monkeypatch.setattr(fidelity, "fit", lambda rows, **kw: seen.extend(rows) or asked.update(kw) or VLLM_LIKE)
    vllm_live.calibrated(rows)
    assert seen and {m["split"] for m in seen} == {"calibration"}
    # A live sweep also fits how GEMM efficiency grows with the tokens in a step.
    assert set(asked["fields"]) == set(fidelity.FITTED) | {"gemm_tokens_exponent"}
    with pytest.raises(ValueError, match="calibrate: 'chat' is not a shape of this sweep"):
        vllm_live.measurements(live_run(), calibrate="chat")


def test_the_live_report_judges_held_out_points_and_sets_the_batches_side_by_side():
    from tinyserve.bench import vllm_live

    run = live_run()
    out = vllm_live.report(run, calibrate="mixed", iterations=10, verbose=False)
    judged = [r for r in out["rows"] if r["judged"]]
    assert judged and all(r["split"] == "held-out" and r["metric"] in vllm_live.JUDGED for r in judged)
    assert {r["load"] for r in judged} == {"c1", "c8", "poisson"}
    assert set(out["worst_held_out"]) == set(vllm_live.JUDGED)
    assert all(r["vllm_batch"] == {"c1": 1, "c8": 8, "poisson": 4}[r["load"]] for r in out["rows"])
    # Never more than the client lets in (Poisson arrivals: the engine's max_num_seqs).
    assert all(0 < r["sim_batch"] <= {"c1": 1, "c8": 8, "poisson": 256}[r["load"]] for r in out["rows"])
    assert all(("at_fault" in r) == (r["judged"] and not r["within_goal"]) for r in out["rows"])
    # Saved and replayed (notebook 06): the same predictions from the saved fit, its words kept.
    again = vllm_live.replay(json.loads(json.dumps({"run": run, "report": out})))
    assert [(r["id"], r["metric"], r["predicted"], r.get("at_fault")) for r in again["rows"]] == \
        [(r["id"], r["metric"], r["predicted"], r.get("at_fault")) for r in out["rows"]]


def test_a_live_miss_names_the_term_at_fault():
    from tinyserve.bench import vllm_live

    rows = [m for m in vllm_live.measurements(live_run()) if not m["id"].endswith("poisson")]   # faster
    # A model whose front end is a quarter of the truth's: on the held-out shape's points
    # the front end is what TTFT misses, and scaling it back is what closes it.
    light = LIVE_TRUTH.with_params(frontend_time=LIVE_TRUTH.frontend_time / 4,
                                   frontend_latency=LIVE_TRUTH.frontend_latency / 4)
    compared = fidelity.compare((light,), rows, extra=("mean_batch_size", "num_preemptions"))
    lines = [{"id": r.id, "load": r.id.rsplit("-", 1)[1], "metric": r.metric, "measured": r.measured, "predicted": r.predicted[light.name],
              "error": r.error(light.name), "judged": r.split == "held-out" and r.metric in vllm_live.JUDGED,
              "within_goal": abs(r.error(light.name)) <= 0.02, "vllm_batch": r.extra[light.name]["mean_batch_size"],
              "sim_batch": r.extra[light.name]["mean_batch_size"], "vllm_preemptions": 0.0,
              "sim_preemptions": 0.0} for r in compared]
    lines[0]["vllm_batch"] *= 2
    vllm_live.at_fault(rows, light, lines)
    missed = [line for line in lines if line["judged"] and not line["within_goal"]]
    print("\n".join(f"{line['id']} {line['metric']}: {line['at_fault']}" for line in missed))
    ttft = [line for line in missed if line["metric"] == "median_ttft"]
    assert ttft and all(line["at_fault"].startswith("front end: 4x of it brings this shape's worst median_ttft miss at a fixed") for line in ttft)
    assert all(("at_fault" in line) == (line in missed) for line in lines)
    # vLLM's own counters come first: a batch the replay did not reproduce.
    first = lines[0] | {"judged": True, "within_goal": False}
    vllm_live.at_fault(rows, light, [first])
    assert first["at_fault"].startswith(f"batch: vLLM ran {first['vllm_batch']:.1f} sequences per step")
    first |= {"vllm_preemptions": 3.0}
    vllm_live.at_fault(rows, light, [first])
    assert first["at_fault"] == "preemption: vLLM preempted 3 times, the simulator 0"


def test_a_poisson_miss_near_capacity_names_the_simulators_capacity():
    from tinyserve.bench import vllm_live

    rows = [m for m in vllm_live.measurements(live_run()) if "short-in-long-out" in m["id"]]
    top, point = rows[1], rows[2]                  # c8, the shape's highest concurrency; Poisson
    capacity = top["measured"]["request_throughput"]
    point = point | {"workload": point["workload"] | {"request_rate": 0.9 * capacity}}
    said = lambda share: vllm_live.capacity_at_fault(rows, point, {(top["id"], "request_throughput"): share * capacity})
    # At 90% load the queue grows as 0.9 / 0.1 = 9; 1% less capacity makes it 10.0 (+11%,
    # within the goal), 2% less 11.25 (+25%), 6% less 22.5.
    assert said(1.0) is None and said(0.99) is None
    assert said(0.98) is not None
    assert said(0.94) == (f"capacity: at c8 the simulator serves {0.94 * capacity:.3g} req/s where vLLM served "
                          f"{capacity:.3g} (-6%), so this rate loads it to 96% of its capacity, not 90%: a queue "
                          f"near capacity grows as load / (1 - load), 9.0 -> 22.5")
    assert said(1.1).startswith("capacity: at c8") and "not 90%: " in said(1.1)      # too much capacity
    assert said(0.85).endswith("loads it to 106% of its capacity, not 90%: a queue near capacity grows as "
                               "load / (1 - load), 9.0 -> unbounded")
    assert vllm_live.capacity_at_fault(rows, point, {}) is None                     # no prediction there
    # Through at_fault: a Poisson line that misses, and its capacity point's prediction.
    line = {"id": point["id"], "load": "poisson", "metric": "median_ttft", "predicted": 1.0, "error": -0.5, "judged": True,
            "within_goal": False, "vllm_preemptions": 0.0, "sim_preemptions": 0.0, "vllm_batch": 8.0,
            "sim_batch": 8.0}
    capacity_line = {"id": top["id"], "load": "c8", "metric": "request_throughput",
                     "predicted": 0.94 * capacity, "judged": False, "within_goal": None}
    vllm_live.at_fault([m if m["id"] != point["id"] else point for m in rows], VLLM_LIKE, [line, capacity_line])
    assert line["at_fault"] == said(0.94) and "at_fault" not in capacity_line
    # replay reads it again without the cost terms' search, which it leaves to the saved words.
    fixed = line | {"id": top["id"], "load": "c8", "metric": "median_tpot"}
    fixed.pop("at_fault")
    vllm_live.at_fault(rows, VLLM_LIKE, [fixed, capacity_line], search=False)
    assert "at_fault" not in fixed


def test_a_miss_where_the_machine_slowed_down_names_the_machine():
    from tinyserve.bench import vllm_live

    rows = vllm_live.measurements(live_run())
    for m in rows:      # the one-sequence decode step timed before each point: 60 ms, 69 ms before one
        m["probe_tpot"] = 0.060
    point = next(m for m in rows if m["id"] == "live-short-in-long-out-c8")
    point["probe_tpot"] = 0.069                     # 15% slower than the calibration's median
    said = lambda metric, error: vllm_live.machine_at_fault(rows, point, metric, error)
    words = ("machine: vLLM's one-sequence decode step, timed before this point, took 69.0 ms against 60.0 ms "
             "before the calibration points (+15%): this machine's speed moved between them, which no cost term models")
    # A slower machine: times measured longer (predicted short), throughput lower (predicted high).
    assert said("median_tpot", -0.2) == words and said("output_throughput", 0.25) == words
    assert said("median_tpot", 0.2) is None and said("output_throughput", -0.2) is None   # the other way
    assert said("median_ttft", -0.4) is None                   # 15% explains under half of a 40% miss
    point["probe_tpot"] = None
    assert said("median_tpot", -0.2) is None                   # a sweep without probes
    # Through at_fault, before the cost terms' search; vLLM's own counters still come first.
    point["probe_tpot"] = 0.069
    line = {"id": point["id"], "load": "c8", "metric": "median_tpot", "predicted": 0.1, "error": -0.2,
            "judged": True, "within_goal": False, "vllm_preemptions": 0.0, "sim_preemptions": 0.0,
            "vllm_batch": 8.0, "sim_batch": 8.0}
    vllm_live.at_fault(rows, VLLM_LIKE, [line], search=False)
    assert line["at_fault"] == words
    line = line | {"vllm_batch": 4.0}
    line.pop("at_fault")
    vllm_live.at_fault(rows, VLLM_LIKE, [line], search=False)
    assert line["at_fault"].startswith("batch: vLLM ran 4.0 sequences per step")


def test_the_live_sweep_describes_the_machine_by_the_median_of_its_measurements():
    from tinyserve.bench import vllm_live
    from tinyserve.hardware import HardwareSpec

    # A VM in three phases: one low measurement must not become the simulator's machine.
    samples = [HardwareSpec("vm", {"fp32": f, "bf16": 2 * f}, bw, 24e9, source="measured")
               for f, bw in [(221e9, 46.6e9), (162e9, 30.2e9), (210e9, 44.0e9)]]
    machine = vllm_live.described(samples)
    assert machine.flops == {"fp32": 210e9, "bf16": 420e9} and machine.memory_bandwidth == 44.0e9
    assert (machine.name, machine.memory_size) == ("vm", 24e9)
    assert machine.source == "measured; each figure the median of 3 such measurements over the sweep"


@pytest.mark.parametrize("model_shape, dtype, fixed_within", [
    ("cpu-bench", "float32", 12), ("cpu-bench", "bfloat16", 11), ("qwen2.5-0.5b-shape", "float32", 7),
    ("qwen2.5-0.5b-shape", "bfloat16", 11)])
def test_the_shipped_live_sweeps_are_predicted_from_their_calibration_shape(model_shape, dtype, fixed_within):
    # Today's simulator with the fit stored beside each real vLLM sweep (AMD EPYC, 2 cores,
    # 32 MiB L3): the held-out points at fixed concurrencies within 15% on each judged
    # metric, as when they were stored. cpu-bench (fp32, Zen 4): 12 of 12; in bf16 (Zen 5):
    # 11 or 12 of 12, its miss the TTFT of long-in-short-out at c1 (+21%), where vLLM's
    # one-sequence step ran 23% faster than before the calibration points. The 0.5B shape
    # in fp32 (Zen 4, c1-c64): 7 or 8 of 8, its miss short-in-long-out at c4, where vLLM's
    # 4-sequence step ran faster than its one-sequence step (56 against 74 ms), which no
    # cost term models. In bf16 (Zen 5, c1-c256): 11 or 12 of 12, its miss the TTFT of
    # short-in-long-out at c1 (+30%, the front end).
    from tinyserve.bench import vllm_live

    saved = vllm_live.stored(model_shape, dtype)
    assert (saved["run"]["model"], saved["run"]["dtype"]) == (model_shape, dtype)
    out = vllm_live.replay(saved)
    fixed = [r for r in out["rows"] if r["judged"] and r["load"] != "poisson"]
    for metric in vllm_live.JUDGED:
        assert sum(r["within_goal"] for r in fixed if r["metric"] == metric) >= fixed_within, metric
    with pytest.raises(ValueError, match="unknown model_shape 'llama'"):
        vllm_live.stored("llama")
    with pytest.raises(ValueError, match=r"unknown dtype of cpu-bench's stored sweeps 'float16'; choose one of \['bfloat16', 'float32'\]"):
        vllm_live.stored("cpu-bench", "float16")
