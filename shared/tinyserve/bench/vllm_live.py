"""The simulator against a vLLM it can watch: ``vllm serve`` on this CPU, driven by our
own client from 1 to 256 concurrent requests over three length shapes; then the
``vllm-like`` cost model calibrated on one shape only and asked to predict the others.

    python -m tinyserve.bench sim --vllm-live                  # cpu-bench, fp32 (about 10 min)
    python -m tinyserve.bench sim --live-from run.json     # refit a saved sweep, no vLLM

Each point is one ``bench serve`` run at ``--max-concurrency`` c (2c requests, at least
16, all queued at t=0), with vLLM's own ``/metrics`` read before and after: its mean
running batch (generated tokens / engine steps) and its preemptions sit beside what the
simulator says of the same requests. The machine goes to the simulator as measured
(``measure_device``: read bandwidth and matmul peak), the model as its shape, the
scheduler as vLLM resolved its knobs and KV blocks here. Every point becomes a
measurement in ``tinyserve.sim.fidelity``'s format, so the fit and the comparison are
the ones the published GPU runs go through.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from tinyserve.bench import vllm_setup
from tinyserve.bench.random_checkpoint import checkpoint_dir, model_config
from tinyserve.hardware import ModelSpec
from tinyserve.sim import fidelity
from tinyserve.sim.cost_model import get_cost_model
from tinyserve.workload import make_workload

CONCURRENCIES = (1, 4, 16, 64, 128, 256)
SHAPES = ("mixed", "long-in-short-out", "short-in-long-out")
LENGTH_SCALE = 0.25             # the shapes' lengths, scaled to what 2 CPU cores serve in minutes
MAX_LEN = 1024                  # the random checkpoints' max_position_embeddings
MEASURED = ("output_throughput", "request_throughput", "mean_ttft", "median_ttft", "p99_ttft",
            "mean_tpot", "median_tpot", "p99_tpot")
JUDGED = ("output_throughput", "median_tpot", "median_ttft")     # the goal: each within 15%
GOAL = 0.15
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def requests(shape: str, concurrency: int, seed: int = 0):
    return make_workload(shape, max(16, 2 * concurrency), rate=math.inf, seed=seed, max_len=MAX_LEN,
                         length_scale=LENGTH_SCALE)


def run_point(url: str, shape: str, concurrency: int, label: str = "") -> dict:
    """One client run at ``concurrency``, with vLLM's counters over the same window. Its
    prompts are its own (seeded by the point): with one seed for all, request i of every
    point began with the same tokens, and vLLM's prefix cache served them (a first sweep:
    TTFT at c=4 a third of that at c=1)."""
    from tinyserve.serving.client import benchmark
    from tinyserve.serving.live_diagnose import window_summary
    from tinyserve.serving.scrape import Window, fetch_metrics

    specs = requests(shape, concurrency)
    before = fetch_metrics(url)
    s = benchmark(url, specs, max_concurrency=concurrency, progress=False,
                  seed=zlib.crc32(f"{label}{shape}-{concurrency}".encode()))
    after = fetch_metrics(url)
    window, _ = window_summary(Window(before, after, s["duration"]))
    return {"shape": shape, "concurrency": concurrency, "errors": s["errors"],
            "input_lens": [r.prompt_len for r in specs], "output_lens": [r.output_len for r in specs],
            "measured": {k: s[k] for k in MEASURED},
            "vllm": {k: window.get(k) for k in ("mean_batch_size", "num_preemptions", "prefix_cache_hit_rate")}}


def engine_of(url: str, resolved: dict) -> dict:
    """The scheduler knobs as ``simulate`` takes them: those vLLM resolved for this model,
    and the KV blocks it allocated (its ``cache_config_info``)."""
    from tinyserve.serving.scrape import fetch_metrics

    info = fetch_metrics(url).series("vllm:cache_config_info")
    labels = info[0][0] if info else {}
    knobs = {k: resolved[k] for k in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                       "enable_prefix_caching", "block_size")}
    if labels.get("num_gpu_blocks") not in (None, "None"):
        knobs["num_kv_blocks"] = int(labels["num_gpu_blocks"])
    knobs["max_model_len"] = MAX_LEN
    return knobs


def sweep(model_shape: str = "cpu-bench", dtype: str = "float32", shapes: Sequence[str] = SHAPES,
          concurrencies: Sequence[int] = CONCURRENCIES, enforce_eager: bool = False,
          verbose: bool = True) -> dict:
    """Start ``vllm serve`` (tuned: every core computes) on a random checkpoint of
    ``model_shape`` and run every (shape, concurrency) point; with the machine as measured."""
    from tinyserve.measure import measure_device

    reason = vllm_setup.vllm_unavailable()
    if reason:
        raise RuntimeError(f"--vllm-live needs vLLM: {reason}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: choose one of {sorted(DTYPES)}, got {dtype!r}")
    for shape in shapes:
        requests(shape, 1)          # a bad shape name fails before minutes of start-up
    hardware = measure_device(dtypes=("fp32", "bf16"))
    model = checkpoint_dir(model_shape, dtype)
    resolved = vllm_setup.installed_knobs(model)["resolved"]
    flags = ["--enforce-eager"] if enforce_eager else []
    started = time.perf_counter()
    with vllm_setup.serve(model, dtype, *flags, max_model_len=MAX_LEN) as server:
        start_up = time.perf_counter() - started
        run_point(server.url, shapes[0], 4, label="warm-up ")
        points = []
        for shape in shapes:
            for c in concurrencies:
                points.append(run_point(server.url, shape, c))
                if verbose:
                    p = points[-1]
                    print(f"  {shape:18s} c={c:<4d} {p['measured']['output_throughput']:8.1f} tok/s  "
                          f"TTFT p50 {p['measured']['median_ttft']:.3f} s  TPOT p50 "
                          f"{p['measured']['median_tpot'] * 1e3:.1f} ms  vLLM batch "
                          f"{p['vllm']['mean_batch_size'] or 0:.1f}, prefix hits "
                          f"{p['vllm']['prefix_cache_hit_rate'] or 0:.0%}", flush=True)
        engine = engine_of(server.url, resolved)
    return {"model": model_shape, "dtype": dtype, "hardware": asdict(hardware), "engine": engine,
            "enforce_eager": enforce_eager, "start_up_s": start_up, "points": points}


def measurements(run: dict, calibrate: str = "mixed") -> list[dict]:
    """The sweep's points in ``tinyserve.sim.fidelity``'s format: the ``calibrate``
    shape's points are the calibration split, the others held out (one source each)."""
    if calibrate not in {p["shape"] for p in run["points"]}:
        raise ValueError(f"calibrate: {calibrate!r} is not a shape of this sweep")
    spec = ModelSpec.from_config(model_config(run["model"]), name=run["model"])
    return [{"id": f"live-{p['shape']}-c{p['concurrency']}", "source": f"live vLLM, {p['shape']}",
             "split": "calibration" if p["shape"] == calibrate else "held-out",
             "hardware": run["hardware"], "model": asdict(spec), "dtype": DTYPES[run["dtype"]],
             "client": "http", "engine": run["engine"],
             "workload": {"input_lens": p["input_lens"], "output_lens": p["output_lens"],
                          "max_concurrency": p["concurrency"]},
             "measured": p["measured"], "vllm": p["vllm"]} for p in run["points"]]


def calibrated(rows: Sequence[dict], iterations: int = 120, verbose: bool = False):
    """``vllm-like`` fitted on the calibration rows only (the held-out ones never reach it)."""
    calibration = [m for m in rows if m["split"] == "calibration"]
    fitted = fidelity.fit(calibration, start=get_cost_model("vllm-like"), iterations=iterations,
                          verbose=verbose)
    return fitted.with_params(source="fitted to a live vLLM on this machine: " + ", ".join(
        sorted({m["source"] for m in calibration})))


def report(run: dict, calibrate: str = "mixed", iterations: int = 120, verbose: bool = True) -> dict:
    """Fit on ``calibrate``, predict every point; print measured against predicted per
    point and metric, and vLLM's batch and preemptions against the simulator's."""
    rows = measurements(run, calibrate)
    model = calibrated(rows, iterations)
    compared = fidelity.compare((model,), rows, extra=("mean_batch_size", "num_preemptions"))
    by_id = {m["id"]: m for m in rows}
    lines, worst = [], {}
    for r in compared:
        m = by_id[r.id]
        error = r.error(model.name)
        judged = r.metric in JUDGED and r.split == "held-out"
        if judged and abs(error) > abs(worst.get(r.metric, (0.0, ""))[0]):
            worst[r.metric] = (error, r.id)
        lines.append({"id": r.id, "split": r.split, "concurrency": m["workload"]["max_concurrency"],
                      "metric": r.metric, "measured": r.measured, "predicted": r.predicted[model.name],
                      "error": error, "judged": judged, "within_goal": abs(error) <= GOAL if judged else None,
                      "vllm_batch": m["vllm"]["mean_batch_size"],
                      "sim_batch": r.extra[model.name]["mean_batch_size"],
                      "vllm_preemptions": m["vllm"]["num_preemptions"],
                      "sim_preemptions": r.extra[model.name]["num_preemptions"]})
    out = {"fitted": asdict(model), "calibrate": calibrate, "rows": lines,
           "worst_held_out": {k: {"error": e, "id": i} for k, (e, i) in worst.items()}}
    if verbose:
        print_report(run, out)
    return out


def print_report(run: dict, out: dict) -> None:
    hw = run["hardware"]
    print(f"\nvLLM live on {hw['name']}: {run['model']} {run['dtype']}, read {hw['memory_bandwidth'] / 1e9:.1f} GB/s, "
          f"start-up {run['start_up_s']:.0f} s; calibrated on {out['calibrate']} only")
    print(f"{'point':28s} {'split':11s} {'metric':18s} {'measured':>10s} {'predicted':>10s} {'error':>7s}  "
          f"batch vLLM/sim  preempt vLLM/sim")
    for r in out["rows"]:
        if r["metric"] not in JUDGED:
            continue
        flag = "" if r["within_goal"] is None else ("  ok" if r["within_goal"] else "  MISS")
        print(f"{r['id']:28s} {r['split']:11s} {r['metric']:18s} {r['measured']:10.4g} {r['predicted']:10.4g} "
              f"{r['error']:+7.1%}  {r['vllm_batch'] or 0:5.1f}/{r['sim_batch']:5.1f}  "
              f"{r['vllm_preemptions'] or 0:4.0f}/{r['sim_preemptions']:4.0f}{flag}")
    for metric, w in out["worst_held_out"].items():
        print(f"worst held-out {metric}: {w['error']:+.1%} at {w['id']} (goal: within {GOAL:.0%})")


def main(args) -> None:
    if args.live_from:
        saved = json.loads(Path(args.live_from).read_text())
        run = saved.get("run", saved)           # a file this wrote, or a bare sweep
    else:
        run = sweep(args.live_model, args.live_dtype,
                    concurrencies=tuple(int(c) for c in args.concurrencies.split(",")),
                    enforce_eager=args.enforce_eager)
    out = report(run, args.calibrate_on)
    path = Path(args.out or Path.home() / ".cache" / "tinyserve" / "sim" / "vllm_live.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run, "report": out}, indent=1) + "\n")
    print(f"wrote {path}")
