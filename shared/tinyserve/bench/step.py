"""The decode step against the weight-read floor, eager and with
``enforce_eager=False``: ``python -m tinyserve.bench step [--model cpu-bench] [--out FILE]``.

A decode step reads every weight once, so its floor is ``weight bytes / read
bandwidth``, flat in the batch until compute catches up at the ceilings ratio
``peak FLOP/s / bandwidth x bytes per parameter / 2``. One run measures the
ceilings (a ``sum`` and a copy for bandwidth, for the peak a square matmul
through torch or a packed GEMM, whichever is faster),
then pure decode steps of the engine at B = 1 ... 64, eagerly and with
``enforce_eager=False`` (weights packed for oneDNN on a CPU, compiled graphs
on a GPU; each bucket keeps the faster path), and prints each step as a
multiple of the floor, the knee fitted on the fast curve against the ceilings
ratio, and what limits the curve past the knee. The start-up cost (seconds, and
peak RSS, and the data alone, against the checkpoint plus the KV cache) is measured in fresh
processes sharing one new Inductor cache: cold, then warm, then with the
packed/eager choice measured at start (``enforce_eager=None``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from tinyserve import measure
from tinyserve.bench.crossover import (TPOT_ROUNDS, knee_report, machine_info, predicted_crossover, sweep_engine,
                                       write_json)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)

# A fresh interpreter starting an engine: what a notebook pays, in seconds and memory. The
# checkpoint's own dtype, as the sweeps load it (sweep_engine's dtype="auto").
# Memory two ways: all of RSS, and its anonymous part (the data: weights, packed copies, KV
# cache, allocator slack). The rest is file-backed, mostly torch's and oneDNN's code paged
# in as the engine first runs it (about 70 MiB on cpu-bench), which no copy of the weights
# adds to. Linux keeps no high-water mark of the anonymous part, so a thread samples it.
PROBE = """\
import json, threading, time
started = time.perf_counter()
import torch, tinyserve.engine
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
baseline, baseline_anon = status("VmRSS"), status("RssAnon")
peak_anon, done = [baseline_anon], threading.Event()
def watch():
    while not done.wait(0.005):
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
threading.Thread(target=watch, daemon=True).start()
from tinyserve import LLM
llm = LLM({model!r}, dtype="auto", max_num_seqs={top}, max_model_len=16, enforce_eager={eager!r})
done.set()
anon = status("RssAnon")
path = llm.engine.executor.decode_path
checkpoint = sum({{id(p): p.numel() * p.element_size() for p in llm.model.parameters()}}.values())
print(json.dumps({{"start_s": time.perf_counter() - started,
                   "fast": path is not None and not llm.engine.executor.enforce_eager,
                   "warm_up_s": path.warm_up_seconds if path else None,
                   "path": path.describe() if path else None,
                   "baseline_rss": baseline, "rss": status("VmRSS"),
                   # VmHWM: this interpreter's own high-water mark. getrusage's ru_maxrss would
                   # also count the process this one was forked from (Linux keeps it across exec).
                   "peak_rss": status("VmHWM"),
                   "baseline_anon": baseline_anon, "anon": anon, "peak_anon": max(peak_anon[0], anon),
                   "checkpoint_bytes": checkpoint,
                   "kv_bytes": llm.engine.executor.kv_cache.nbytes}}))
"""

# The start-up runs: (name, enforce_eager). Cold and warm share one new Inductor cache
# (it matters where graphs are compiled); "measured" times packed against eager at start.
START_RUNS = (("cold", False), ("warm", False), ("measured", None))


def compile_cost(model: str, top: int, cache_dir: str) -> dict:
    """Start seconds and memory of an engine in a new process: ``enforce_eager=False``
    with ``cache_dir`` empty (cold), then again with what the first run left there
    (warm), then ``enforce_eager=None`` (the choice measured at start)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    runs = {}
    for name, eager in START_RUNS:
        out = subprocess.run([sys.executable, "-c", PROBE.format(model=model, top=top, eager=eager)],
                             env=env, capture_output=True, text=True, check=True)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return runs


def run(model: str = "cpu-bench", batch_sizes=BATCH_SIZES, steps: int = 5,
        measure_compile: bool = True, verbose: bool = True) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    batch_sizes = list(batch_sizes)
    # Both dtypes a CPU checkpoint comes in: the model's own sets the floor and the knee.
    hw = measure.measure_device("cpu", dtypes=("fp32", "bf16"))
    read = measure.read_bandwidth("cpu")
    best = max(read, hw.memory_bandwidth)
    say(f"read bandwidth: sum {read / 1e9:.1f} GB/s, copy (read + write) "
        f"{hw.memory_bandwidth / 1e9:.1f} GB/s; matmul "
        + ", ".join(f"{d} {f / 1e9:.0f} GFLOP/s" for d, f in hw.flops.items()))
    report = {"benchmark": "step", "machine": machine_info("cpu"), "model": model,
              "read_bandwidth": read, "copy_bandwidth": hw.memory_bandwidth,
              "best_bandwidth": best, "batch_sizes": batch_sizes}
    with tempfile.TemporaryDirectory(prefix="tinyserve-inductor-") as cache:
        if measure_compile:
            say("compiling in two fresh processes (cold, then warm) ...")
            report["compile"] = compile_cost(model, max(batch_sizes), cache)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        for name, eager in (("eager", True), ("compiled", False)):
            started = time.perf_counter()
            times, info = sweep_engine(batch_sizes, model, steps=steps, enforce_eager=eager,
                                       tpot_batches=[b for b in (1, 8) if b in batch_sizes])
            say(f"{name}: swept in {time.perf_counter() - started:.0f} s")
            report[name] = times
            report[f"{name}_tpot_s"] = info["tpot_s"]
            report[f"{name}_tpot_over_step"] = info["tpot_over_step"]
        if os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    report.update(info)             # the model, and the fast engine's decode path
    floor = info["weight_bytes"] / best
    on_best = replace(hw, memory_bandwidth=best)
    report["floor_s"] = floor
    report["matmul_flops"] = hw.peak_flops(info["dtype"])      # the model's dtype
    report["predicted_crossover"] = predicted_crossover(on_best, info["dtype"])
    report["fits"] = {"eager": knee_report(batch_sizes, report["eager"], on_best, info["dtype"],
                                           info["weight_bytes"], min_batch=2),
                      "compiled": knee_report(batch_sizes, report["compiled"], on_best,
                                              info["dtype"], info["weight_bytes"])}
    fit = report["fits"]["compiled"]
    # Past the knee each extra request adds 2 FLOPs per parameter read.
    report["tail_flops"] = (2 * info["num_parameters_read"] / fit["fit_slope_s"]
                            if fit["fit_slope_s"] > 0 else None)
    if verbose:
        print_report(report)
    return report


def print_report(r: dict) -> None:
    floor = r["floor_s"]
    print(f"\n{r['model']} ({r['dtype']}): {r['weight_bytes'] / 2**20:.0f} MiB of weights read per "
          f"step; floor = that / {r['best_bandwidth'] / 1e9:.1f} GB/s = {floor * 1e3:.2f} ms")
    print(f"{'B':>4}{'eager ms':>10}{'x floor':>9}{'fast ms':>13}{'x floor':>9}{'speed-up':>10}")
    for b, e, c in zip(r["batch_sizes"], r["eager"], r["compiled"]):
        print(f"{b:>4}{e * 1e3:>10.2f}{e / floor:>9.2f}{c * 1e3:>13.2f}{c / floor:>9.2f}{e / c:>9.2f}x")
    for name, f in r["fits"].items():
        knee = f">={f['knee']:.0f} (flat)" if f["flat"] else f"{f['knee']:.1f}"
        print(f"knee fitted on the {name} curve: {knee}; ceilings ratio {f['predicted_crossover']:.1f} "
              f"(knee / ratio = {f['knee_over_predicted']:.2f})")
    if r["tail_flops"]:
        print(f"past the knee each request adds {r['fits']['compiled']['fit_slope_s'] * 1e3:.2f} ms: "
              f"{r['tail_flops'] / 1e9:.0f} GFLOP/s against a measured {r['dtype']} matmul peak of "
              f"{r['matmul_flops'] / 1e9:.0f} GFLOP/s ({r['tail_flops'] / r['matmul_flops']:.0%})")
    for b, tpot in r["compiled_tpot_s"].items():
        print(f"through LLM.generate, B={b}: mean TPOT {tpot * 1e3:.2f} ms = {tpot / floor:.2f}x floor, "
              f"{r['compiled_tpot_over_step'][b] - 1:+.0%} over the step beside it "
              f"(eager {r['eager_tpot_s'][b] * 1e3:.2f} ms; medians of {TPOT_ROUNDS} rounds)")
    print(f"enforce_eager=False: {r['decode_path']}")
    for name, c in r.get("compile", {}).items():
        print(f"{name} start (max_num_seqs={max(r['batch_sizes'])}): {c['start_s']:.1f} s, of which "
              f"packing or compiling and choosing {c['warm_up_s']:.1f} s" if c["fast"] else
              f"{name} start: {c['start_s']:.1f} s, the engine runs eagerly")
        # Memory: what the process holds beyond the interpreter and torch (the baseline,
        # read before the model is built) against the weights plus the KV cache.
        need = c["checkpoint_bytes"] + c["kv_bytes"]
        print(f"  peak RSS {c['peak_rss'] / 2**20:.0f} MiB, RSS after start-up {c['rss'] / 2**20:.0f} MiB; "
              f"baseline (torch imported) {c['baseline_rss'] / 2**20:.0f} MiB; checkpoint "
              f"{c['checkpoint_bytes'] / 2**20:.0f} MiB + KV cache {c['kv_bytes'] / 2**20:.0f} MiB: "
              f"(peak - baseline) / that = {(c['peak_rss'] - c['baseline_rss']) / need:.2f}x, "
              f"(after start-up - baseline) / that = {(c['rss'] - c['baseline_rss']) / need:.2f}x")
        print(f"  data alone (anonymous RSS, sampled every 5 ms) over the same: peak "
              f"{(c['peak_anon'] - c['baseline_anon']) / need:.2f}x, after start-up "
              f"{(c['anon'] - c['baseline_anon']) / need:.2f}x; the rest of the growth is code "
              f"paged in ({(c['rss'] - c['anon'] - c['baseline_rss'] + c['baseline_anon']) / 2**20:.0f} MiB)")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="cpu-bench", help="preset or checkpoint directory")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch (powers of 2)")
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed per batch size")
    parser.add_argument("--no-compile-cost", action="store_true",
                        help="skip the cold/warm start measurement (two fresh processes)")
    parser.add_argument("--out", help="also write the report as JSON to this path")


def main(args) -> dict:
    sizes = [b for b in BATCH_SIZES if b <= args.max_batch]
    report = run(args.model, sizes, args.steps, measure_compile=not args.no_compile_cost)
    if args.out:
        print(f"wrote {write_json(report, args.out)}")
    return report
