"""Is the simulator right, and is it fast? ``python -m tinyserve.bench sim``.

Against real engines (``--fidelity``): published vLLM measurements on GPUs
(``tinyserve/data/published_vllm.json``) replayed through the simulator with the
pure roofline and with the calibrated ``"vllm-like"`` cost model, one table of
source, setup, measured, both predictions and their errors (``--refit`` first
fits the cost model again on the calibration half; it takes minutes).

Against our own engine (the default): the real engine serves a small workload on this CPU in real time;
the simulator serves the same workload with this CPU's *measured* spec, and
the two are compared step time by step time, and on mean TTFT and TPOT.

The spec is measured, not guessed: the memory bandwidth, the FLOP/s and the
fixed cost of a step (Python, the scheduler, many small kernel launches) are
the roofline that best fits the engine's own step times on controlled steps:
pure decodes at batch 2 to 64 and single prefills of 16 to 256 tokens. The
bandwidth may not exceed what a plain copy reaches (``measure_device``).

Batch 1 is left out on purpose: with one row, torch multiplies by the weights
as a matrix-vector product, a different and faster path (``python -m
tinyserve.bench step`` prints the B=1 step beside the others). A roofline has one floor;
it is fitted to the matrix-matrix path that almost every step of a served
workload takes, so a lone request's steps come out too slow.

Nothing of the fidelity workload is used to calibrate. Speed: 10,000 requests
of Llama-7B on an A100 through ``simulate``, timed on this machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from tinyserve.hardware import HardwareSpec, ModelSpec
from tinyserve.measure import measure_device
from tinyserve.metrics import summarize
from tinyserve.sim import SimExecutor, simulate
from tinyserve.workload import make_workload, prompt_token_ids

ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, block_size=16)


def measure_steps(llm, decode_batches=(2, 4, 8, 16, 32, 64), prefill_lens=(16, 64, 256),
                  context: int = 16, steps: int = 5) -> list[tuple[int, int, int, float]]:
    """Median engine step times for controlled steps: (tokens, kv_tokens, pairs, seconds).

    Pure decode steps at each batch size (every request at about ``context``
    tokens), and single prefills of each length.
    """
    from tinyserve import SamplingParams
    engine, rows = llm.engine, []
    for batch in decode_batches:
        first = engine.core.num_steps
        for i in range(batch):
            engine.add_request([11 + i % 500] * context,
                               SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        times = [s.duration for s in engine.core.steps_since(first)
                 if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch]
        c = context + steps // 2 + 1         # a middle decode step's context
        rows.append((batch, batch * c, batch * c, statistics.median(times)))
    for n in prefill_lens:
        times = []
        for rep in range(3):
            first = engine.core.num_steps
            engine.add_request([13 + rep] * n, SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            times.append(engine.core.steps_since(first)[0].duration)
        rows.append((n, n, n * (n + 1) // 2, statistics.median(times)))
    return rows


def calibrate(llm, model: ModelSpec, measured: HardwareSpec | None = None,
              rows: list[tuple[int, int, int, float]] | None = None) -> tuple[HardwareSpec, float]:
    """This CPU as a ``HardwareSpec`` (fp32), plus the fixed overhead of a step in seconds.

    The bandwidth, FLOP/s and overhead are the ones that best fit the engine's
    controlled steps (``measure_steps``) in relative error: a log grid over
    bandwidth (up to the copy bandwidth ``measure_device`` finds) and FLOP/s
    (1% to 200% of its matmul peak), with the best overhead for each pair in
    closed form.
    """
    import numpy as np

    measured = measured or measure_device("cpu")
    rows = rows or measure_steps(llm)
    seconds = np.array([r[3] for r in rows])
    weights = 1 / seconds ** 2
    best = None
    copy, peak = measured.memory_bandwidth, measured.peak_flops("fp32")
    for bandwidth in np.geomspace(copy / 8, copy, 40):
        for flops in np.geomspace(peak / 100, 2 * peak, 200):
            executor = SimExecutor(dataclasses.replace(measured, flops={"fp32": flops},
                                                       memory_bandwidth=bandwidth), model, "fp32")
            roof = np.array([executor.time_for(t, kv, pairs) for t, kv, pairs, _ in rows])
            overhead = max(0.0, float(np.sum(weights * (seconds - roof)) / np.sum(weights)))
            error = float(np.sum(weights * (seconds - roof - overhead) ** 2))
            if best is None or error < best[0]:
                best = (error, bandwidth, flops, overhead)
    _, bandwidth, flops, overhead = best
    spec = dataclasses.replace(
        measured, name=f"{measured.name} (engine-calibrated)", flops={"fp32": flops},
        memory_bandwidth=bandwidth,
        source=f"{measured.source}; bandwidth, FLOP/s and per-step overhead fitted to "
               f"{len(rows)} engine steps (decode batches and prefills)")
    return spec, overhead


def fidelity(preset: str = "cpu-bench", num_requests: int = 48, rate: float = 6.0, seed: int = 0,
             measured: HardwareSpec | None = None, verbose: bool = True) -> dict:
    """Run the same workload on the real engine (real time) and in the simulator; compare."""
    import torch

    from tinyserve import LLM, LLMEngine, SamplingParams
    from tinyserve.serving.replay import replay
    from tinyserve.scheduler import SchedulerConfig

    # Calibrate on an engine with enough seats for the batch sizes, then serve
    # the workload on a fresh engine over the same weights with ENGINE's knobs.
    # Eager, as the serving LLMEngine below: calibrated and served on the same decode path.
    llm = LLM(preset, seed=0, dtype="float32", device="cpu", enable_prefix_caching=False,
              max_num_seqs=64, max_num_batched_tokens=256, enforce_eager=True)
    model = ModelSpec.from_config(llm.model.config, name=preset)
    max_len = llm.engine.config.max_model_len
    calibration = measure_steps(llm)
    spec, overhead = calibrate(llm, model, measured=measured, rows=calibration)
    fitted = SimExecutor(spec, model, "fp32", overhead)
    num_blocks = llm.engine.block_manager.num_blocks
    engine = LLMEngine(llm.model, llm.tokenizer, SchedulerConfig(max_model_len=max_len, **ENGINE),
                       num_blocks)
    specs = make_workload("mixed", num_requests, rate=rate, seed=seed, max_len=max_len,
                          length_scale=1 / 8)
    trace = [(s.arrival, prompt_token_ids(s, i, seed), SamplingParams(max_tokens=s.output_len,
                                                                      ignore_eos=True))
             for i, s in enumerate(specs)]
    with torch.inference_mode():
        outputs = replay(engine, trace)
    real = summarize([o.metrics for o in outputs])
    real_steps = [s.duration for s in engine.step_stats if s.num_scheduled_tokens]
    sim = simulate(specs, spec, model, "fp32", overhead=overhead, max_model_len=max_len,
                   num_kv_blocks=num_blocks, **ENGINE)
    predicted = sim.summary()
    rows = [("mean step time (ms)", 1e3 * statistics.fmean(real_steps), 1e3 * predicted["mean_step_time"]),
            ("steps", len(real_steps), predicted["num_steps"]),
            ("mean TTFT (ms)", 1e3 * real["mean_ttft"], 1e3 * predicted["mean_ttft"]),
            ("mean TPOT (ms)", 1e3 * real["mean_tpot"], 1e3 * predicted["mean_tpot"]),
            ("output tokens/s", real["output_throughput"], predicted["output_throughput"])]
    result = {"machine": spec.name, "date": time.strftime("%Y-%m-%d"), "preset": preset,
              "calibration": [{"tokens": t, "kv_tokens": kv, "pairs": p, "measured_s": m,
                               "fitted_s": fitted.time_for(t, kv, p)} for t, kv, p, m in calibration],
              "spec": {"memory_bandwidth": spec.memory_bandwidth, "flops_fp32": spec.flops["fp32"],
                       "overhead_s": overhead, "source": spec.source},
              "workload": {"name": "mixed", "num_requests": num_requests, "rate": rate, "seed": seed},
              "rows": [{"metric": m, "engine": a, "simulator": b, "error": (b - a) / a}
                       for m, a, b in rows]}
    if verbose:
        print(f"Simulator vs engine: {preset} on {spec.name}")
        print(f"  calibrated: {spec.memory_bandwidth / 1e9:.1f} GB/s, "
              f"{spec.flops['fp32'] / 1e9:.1f} GFLOP/s effective, overhead {overhead * 1e3:.1f} ms/step")
        print("  calibration steps (tokens: measured / fitted ms): " + ", ".join(
            f"{c['tokens']}: {1e3 * c['measured_s']:.0f}/{1e3 * c['fitted_s']:.0f}"
            for c in result["calibration"]))
        print(f"  workload: mixed x1/8, {num_requests} requests at {rate:g}/s, seed {seed}")
        print(f"  {'metric':<22}{'engine':>10}{'simulator':>11}{'error':>9}")
        for r in result["rows"]:
            print(f"  {r['metric']:<22}{r['engine']:>10.1f}{r['simulator']:>11.1f}{100 * r['error']:>8.1f}%")
    return result


def setup_of(measurement: dict) -> str:
    """One line: GPU, model, lengths, load, client."""
    from tinyserve.sim.fidelity import hardware_of, model_of
    w = measurement["workload"]
    if "seeded_lengths" in w:
        g = w["seeded_lengths"]
        lengths = f"{g['num_seqs']} x {g['input_range'][0]}-{g['input_range'][1]}->{g['output_range'][0]}-{g['output_range'][1]} tok"
    elif "input_lens" in w:
        lengths = f"{len(w['input_lens'])}-request trace"
    elif "lengths_like" in w:
        g = w["lengths_like"]
        lengths = (f"{g['num_prompts']} x ~{g['input_tokens'] / g['num_prompts']:.0f}->"
                   f"~{g['output_tokens'] / g['num_prompts']:.0f} tok, shaped like {g['measurement']}")
    else:
        out = w.get("output_len") or f"~{w['mean_output_len']}"
        lengths = f"{w['num_prompts']} x {w['input_len']}->{out} tok"
    if "max_concurrency" in w:
        load = f"C={w['max_concurrency']}"
    elif "request_rate" in w:
        load = f"{w['request_rate']:g} req/s"
    else:
        load = "all at t=0"
    if w.get("warm_prefix_cache"):
        load += " after a run of the same prompts"
    gpu = hardware_of(measurement).name.replace("GeForce-", "")
    return f"{gpu}, {model_of(measurement).name}, {lengths}, {load}, {measurement['client']}"


def published_fidelity(cost_model="vllm-like", verbose: bool = True) -> dict:
    """The simulator against published vLLM measurements: per source and point, every
    metric the source printed (throughput, TPOT, TTFT), measured and predicted by the
    roofline and by ``cost_model``, with the simulated mean running batch; then the
    worst error of each kind on each split, against the bounds of ``fidelity.BOUNDS``."""
    from tinyserve.sim.cost_model import get_cost_model
    from tinyserve.sim.fidelity import (BOUNDS, METRIC_KINDS, compare, measurements, miss, published,
                                        source_in_goal, worst)

    model = get_cost_model(cost_model)
    name = model.name
    by_id = {m["id"]: m for m in measurements()}
    rows = compare(("roofline", model), extra=("mean_batch_size", "num_preemptions"))
    running = {r.id: r.extra[name] for r in rows}
    if verbose:
        print(f"Simulator vs published vLLM measurements (cost models: roofline, {name})")
        if hasattr(model, "step_overhead"):
            print(f"  {name}: {model.step_overhead * 1e3:.2f} ms/step + {model.seq_overhead * 1e6:.1f} us/seq; "
                  f"weights at {model.weight_efficiency:.0%} and KV at {model.kv_efficiency:.0%} of bandwidth; "
                  f"GEMMs at {model.gemm_efficiency:.0%} of peak, interference {model.interference:.2f}; "
                  f"front end {model.frontend_time * 1e3:.1f} ms/request serial + "
                  f"{model.frontend_latency * 1e3:.1f} ms latency")
        print(f"  {'split':<12}{'source':<26}{'point':<40}{'run':>5}{'pre':>5}  {'metric':<19}{'measured':>10}"
              f"{'roofline':>10}{'err':>6}{name:>11}{'err':>6}")
        last = None
        for r in rows:
            point = r.id if r.id != last else ""
            extra = running[r.id]
            run = f"{extra['mean_batch_size']:>5.0f}{extra['num_preemptions']:>5d}" if point else " " * 10
            if point:
                print(f"  {'':<12}{'':<26}{setup_of(by_id[r.id])}")
            print(f"  {r.split if point else '':<12}{r.source if point else '':<26}{point:<40}{run}  "
                  f"{r.metric:<19}{r.measured:>10.4g}{r.predicted['roofline']:>10.4g}"
                  f"{100 * r.error('roofline'):>5.0f}%{r.predicted[name]:>11.4g}{100 * r.error(name):>5.0f}%")
            last = r.id
        print("  (run: simulated mean running sequences per step; pre: simulated preemptions; "
              "err: predicted / measured - 1)")
    summary = {split: {c: worst(rows, c, split) for c in ("roofline", name)}
               for split in ("calibration", "held-out")}
    if verbose:
        print("  worst error on the points in the goal (vLLM V1 era; throughput and TPOT: "
              "|predicted / measured - 1|; TTFT: the ratio, either way):")
        for split, by_model in summary.items():
            for kind, bound in BOUNDS.items():
                cells = []
                for c in ("roofline", name):
                    r = by_model[c].get(kind)
                    if r is not None:
                        value = miss(r, c)
                        text = f"{value:.2f}x" if kind == "ttft" else f"{100 * value:.0f}%"
                        cells.append(f"{c} {text:>6} ({r.id})")
                if cells:
                    goal = f"{bound:g}x" if kind == "ttft" else f"{100 * bound:.0f}%"
                    print(f"    {split:<12}{kind:<11}goal {goal:>5}   " + "   ".join(cells))
        sources = sorted({by_id[r.id]["source"] for r in rows if r.split == "held-out"
                          and by_id[r.id].get("engine_generation") is None})
        print(f"  held-out sources (V1 era): {len(sources)}: {', '.join(sources)}")
        for source in sources:
            if not source_in_goal(source):
                print(f"    {source} is not in the goal: {published()['sources'][source]['why_not_in_goal']}")
            mine = [r for r in rows if by_id[r.id]["source"] == source]
            cells = []
            for c in ("roofline", name):
                speed = [r.error(c) for r in mine if METRIC_KINDS[r.metric] == "throughput"]
                ttft = [r.predicted[c] / r.measured for r in mine if METRIC_KINDS[r.metric] == "ttft"]
                cells.append(f"{c}: throughput {100 * min(speed):+.0f}% to {100 * max(speed):+.0f}%"
                             + (f", TTFT x{min(ttft):.2f} to x{max(ttft):.2f}" if ttft else ""))
            print(f"    {source:<26}" + "   ".join(cells))
        skipped = published()["not_modelled"]
        print(f"  found but not simulated ({len(skipped)} sources, each with why):")
        for entry in skipped:
            print(f"    {entry['gpu']}, {entry['model']}, {entry['engine']}: {entry['why']}")
        for r in rows:
            if by_id[r.id].get("engine_generation"):
                print(f"    engine {by_id[r.id]['engine_generation']} ({r.id}, not in the goal): {r.metric} "
                      f"roofline {100 * r.error('roofline'):+.0f}%, {name} {100 * r.error(name):+.0f}%")
    return {"rows": rows, "summary": summary, "running": running}


def speed(num_requests: int = 10_000, rate: float = 16.0, verbose: bool = True) -> dict:
    """Wall time to simulate ``num_requests`` mixed requests of Llama-7B on an A100."""
    specs = make_workload("mixed", num_requests, rate=rate, seed=0)
    start = time.perf_counter()
    result = simulate(specs, "A100_SXM_80GB", "LLAMA_7B")
    wall = time.perf_counter() - start
    s = result.summary()
    out = {"num_requests": num_requests, "wall_s": wall, "simulated_s": s["duration"],
           "num_steps": s["num_steps"], "output_tokens": s["total_output_tokens"]}
    if verbose:
        print(f"Simulator speed: {num_requests} requests (Llama-7B, A100, mixed at {rate:g}/s): "
              f"{wall:.1f} s wall for {s['duration']:.0f} s simulated, {s['num_steps']} steps, "
              f"{s['total_output_tokens']} output tokens ({s['num_steps'] / wall:.0f} steps/s)")
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="cpu-bench", help="real model for the fidelity run")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=6.0, help="fidelity workload, requests/s")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", help="also write the fidelity comparison as JSON to this path")
    parser.add_argument("--fidelity", action="store_true",
                        help="compare with published vLLM measurements on GPUs instead (no engine run)")
    parser.add_argument("--refit", action="store_true",
                        help="with --fidelity: fit the vllm-like cost model again first (minutes)")
    parser.add_argument("--vllm-live", action="store_true",
                        help="run vllm serve on this CPU from 1 to 256 concurrent requests, calibrate "
                             "vllm-like on one length shape and predict the others (needs make vllm)")
    parser.add_argument("--live-model", default="cpu-bench", help="--vllm-live: cpu-bench or qwen2.5-0.5b-shape")
    parser.add_argument("--live-dtype", default="float32", help="--vllm-live: float32 or bfloat16")
    parser.add_argument("--concurrencies", default="1,4,16,64,128,256", help="--vllm-live: comma-separated")
    parser.add_argument("--calibrate-on", default="mixed", help="--vllm-live: the one shape the fit sees")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--vllm-live: skip vLLM's start-up compile (faster start, slower steps)")
    parser.add_argument("--live-from", help="--vllm-live: refit and report a saved sweep instead of running vLLM")


def main(args) -> None:
    if args.vllm_live or args.live_from:
        from tinyserve.bench import vllm_live
        vllm_live.main(args)
        return
    if args.fidelity:
        model = "vllm-like"
        if args.refit:
            from tinyserve.sim.fidelity import fit
            model = fit(verbose=True)
            print(f"refitted: {model}")
        published_fidelity(model)
        return
    result = fidelity(args.preset, args.num_requests, args.rate)
    if args.out:
        import json
        from pathlib import Path
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if not args.skip_speed:
        speed()

