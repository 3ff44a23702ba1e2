"""Measure the batch-size crossover: ``python -m tinyserve.bench crossover [--out FILE]``.

The chapter section 「批多大才划算」 predicts that a decode step costs a flat
weight read until the batch reaches ``peak FLOP/s / bandwidth x bytes per
parameter / 2`` requests (153 for a 7B fp16 model on an A100), and grows
linearly after. This module checks that on the machine it runs on:

1. measure the two ceilings (``measure.measure_device``): copy bandwidth and
   matmul peak;
2. sweep the batch size (log-spaced; GPU 1...1024, CPU 1...256) for

   * a **GEMM stack**: the four weight matrices of a Llama layer (fused QKV,
     output, fused gate/up, down), repeated for several layers, each step
     multiplying a ``[B, in]`` activation by every weight once. On a GPU the
     layers have 7B shapes (hidden 4096, MLP 11008, 32 layers, fp16: 13 GB),
     replayed as one CUDA graph so kernel launches do not count. On a CPU they
     are scaled down to hidden 1024 (MLP 2752) in fp32, with enough layers for
     about 1 GiB of weights: many times a server CPU's last-level cache (tens
     of MiB), so every step streams the weights from DRAM, while each matrix
     (at most 22 MiB) still fits the cache that the BLAS library packs it
     through. (A CPU BLAS copies and repacks the weight of a thin GEMM; with
     7B-sized 360 MB matrices that repacking itself goes to DRAM and multiplies
     the step time at B >= 2.)
   * **tinyserve's own model**: pure decode steps of the ``cpu-bench`` preset
     through the engine (as notebook 01 does), timed from ``engine.step_stats``;

3. fit a flat-then-linear hinge to each curve (``measure.fit_knee``; on a CPU
   from B = 2, see ``fit_min_batch``) and print
   the measured knee next to the predicted crossover, and the B=1 step next to
   the weight-read floor ``weight bytes / copy bandwidth``.

``--out`` writes everything (machine, date, versions, measured ceilings, curves,
fits) as JSON; notebook 04 plots such a file when it finds one in
``tinyserve/data/`` (``bench_crossover_<gpu>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from tinyserve import hardware as hwm
from tinyserve import host, measure
from tinyserve.packed_gemm import PACKED_PATHS, prepacked_linear, weights_read

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MLP_RATIO = 11008 / 4096          # Llama-7B's intermediate / hidden
REPORT_KEYS = ("benchmark", "device", "machine", "date", "versions", "device_spec", "curves", "fits")


# ---- predictions ---------------------------------------------------------------------------

def predicted_crossover(hw: hwm.HardwareSpec, dtype: str) -> float:
    """Batch at which compute catches the weight read: peak / bandwidth x bytes per param / 2.

    A step reads ``bytes_per_param`` bytes and does 2 FLOPs per parameter and
    request, so the ridge point (FLOPs per byte) is reached at that batch: the
    ridge point itself in fp16/bf16, twice it in fp32.
    """
    return hw.peak_flops(dtype) / hw.memory_bandwidth * hwm.bytes_per_element(dtype) / 2


def weight_read_floor(hw: hwm.HardwareSpec, weight_bytes: float) -> float:
    """Seconds to stream ``weight_bytes`` once at the measured bandwidth."""
    return weight_bytes / hw.memory_bandwidth


def default_batch_sizes(device: str, max_batch: int | None = None) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... (powers of 2 and 1.5x them) up to 1024 (GPU) or 256 (CPU)."""
    top = max_batch or (1024 if device == "cuda" else 256)
    sizes, p = [], 1
    while p <= top:
        sizes += [p] + ([p * 3 // 2] if p >= 2 and p * 3 // 2 <= top else [])
        p *= 2
    return sorted(set(sizes))


# ---- (a) a stack of GEMMs shaped like Llama layers -----------------------------------------

def layer_shapes(hidden: int) -> list[tuple[int, int]]:
    """(in, out) of one layer's weights: fused QKV, output, fused gate/up, down."""
    inter = int(round(hidden * MLP_RATIO))
    return [(hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * inter), (inter, hidden)]


def stack_config(device: str, weight_gib: float | None = None) -> dict:
    """Default GEMM stack: 7B layers in fp16 on a GPU, hidden-1024 fp32 layers (~1 GiB) on a CPU."""
    if device == "cuda":
        dtype = "fp16"
        hidden, layers = 4096, 32
        if weight_gib:
            per_layer = sum(a * b for a, b in layer_shapes(hidden)) * 2
            layers = max(1, round(weight_gib * 2**30 / per_layer))
        return {"hidden": hidden, "num_layers": layers, "dtype": dtype}
    hidden = 1024
    per_layer = sum(a * b for a, b in layer_shapes(hidden)) * 4
    layers = max(1, round((weight_gib or 1.0) * 2**30 / per_layer))
    return {"hidden": hidden, "num_layers": layers, "dtype": "fp32"}


class GemmStack:
    """``num_layers`` Llama-shaped layers of weights; ``step(B)`` multiplies a B-row
    activation by every weight once (no attention, no elementwise ops).

    Weights are stored ``[in, out]``; inputs and outputs are one buffer per
    width, allocated for the largest batch and sliced, so a step is GEMMs and
    nothing else.
    """

    def __init__(self, hidden: int, num_layers: int, dtype: str = "fp32", device: str = "cpu",
                 seed: int = 0):
        self.hidden, self.num_layers, self.dtype, self.device = hidden, num_layers, dtype, device
        gen = torch.Generator(device=device).manual_seed(seed)   # drawn where they live: fast on a GPU
        tdtype = TORCH_DTYPES[dtype]
        self.shapes = layer_shapes(hidden) * num_layers
        self.weights = [torch.randn(i, o, generator=gen, device=device, dtype=tdtype).mul_(i**-0.5)
                        for i, o in self.shapes]
        self._ins: dict[int, torch.Tensor] = {}
        self._outs: dict[int, torch.Tensor] = {}

    @property
    def num_parameters(self) -> int:
        return sum(i * o for i, o in self.shapes)

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def reserve(self, max_batch: int) -> None:
        """Allocate activation buffers for batches up to ``max_batch``."""
        tdtype = TORCH_DTYPES[self.dtype]
        self._ins = {i: torch.randn(max_batch, i, device=self.device).to(tdtype) for i, _ in self.shapes}
        self._outs = {o: torch.empty(max_batch, o, device=self.device, dtype=tdtype) for _, o in self.shapes}

    def release(self) -> None:
        self._ins, self._outs = {}, {}

    def step_fn(self, batch: int, prepack: bool | str = False):
        """One step at ``batch`` rows. ``prepack`` (CPU fp32): every weight packed once for
        this batch, as a compiled engine's graph holds it (``packed_gemm.prepacked_linear``;
        a copy of the weights per call of step_fn), instead of re-packed on every call;
        True or "mkl" for MKL's packed GEMM, "onednn" for oneDNN's."""
        if not self._ins or next(iter(self._ins.values())).shape[0] < batch:
            self.reserve(batch)
        xs = [self._ins[w.shape[0]][:batch] for w in self.weights]
        path = "mkl" if prepack is True else prepack
        packed = [prepacked_linear(w.t(), batch, path) for w in self.weights] if prepack else []
        if packed and all(packed):
            def step():
                for x, layer in zip(xs, packed):
                    layer(x)
            return step
        pairs = [(x, w, self._outs[w.shape[1]][:batch]) for x, w in zip(xs, self.weights)]

        def step():
            for x, w, out in pairs:
                torch.mm(x, w, out=out)
        return step


def _gpu_time(fn, repeats: int, use_graph: bool = True) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), replayed as a CUDA graph when possible."""
    run = fn
    if use_graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()                                             # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception:                                        # noqa: BLE001 - fall back to eager
            run = fn
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sweep_gemm_stack(stack: GemmStack, batch_sizes, repeats: int = 3,
                     prepack: bool = False) -> list[float]:
    """Seconds per step of ``stack`` at each batch size.

    GPU: median of CUDA-event timings, batch size after batch size. CPU: the
    sweep runs ``repeats`` rounds over all batch sizes and keeps each one's best
    time, so a burst of load from another process spoils one point of a round,
    not a stretch of the curve. ``prepack`` (CPU): weights packed for each batch
    (see ``GemmStack.step_fn``); one batch size at a time, best of ``repeats``,
    since every batch size holds its own packed copy.
    """
    sizes = [int(b) for b in batch_sizes]
    stack.reserve(max(sizes))
    with torch.inference_mode():
        if stack.device == "cuda":
            times = [_gpu_time(stack.step_fn(b), max(repeats, 5)) for b in sizes]
        elif prepack:
            times = [_best_cpu_time(stack.step_fn(b, prepack=True), repeats) for b in sizes]
        else:
            fns = [stack.step_fn(b) for b in sizes]
            for fn in fns:
                fn()                                             # warm-up
            best = [float("inf")] * len(sizes)
            for _ in range(max(1, repeats)):
                for k, fn in enumerate(fns):
                    t = time.perf_counter()
                    fn()
                    best[k] = min(best[k], time.perf_counter() - t)
            times = best
    stack.release()
    return times


def packed_vs_eager(stack: GemmStack, batch_sizes, pairs: int = 5, eager_up_to: int = 64) -> list[dict]:
    """CPU: at each batch size, the packed step against the eager one, interleaved.

    The packed step uses whichever packed GEMM is faster on this CPU at that batch
    (MKL's or oneDNN's; ``fastest_packed`` decides); then, up to ``eager_up_to``,
    eager and packed alternate for ``pairs`` pairs (``host.paired_ratio``), so a
    busy moment slows both. Past it only the packed step is timed (the median of
    ``pairs``): the large batches are there for the compute slope, and eager steps
    there cost seconds. Each row: ``batch``, ``path``, ``packed_s``, ``eager_s``
    (medians; NaN past ``eager_up_to``) and ``ratio`` (the ``PairedRatio`` eager /
    packed, or None).
    """
    rows = []
    stack.reserve(max(int(b) for b in batch_sizes))
    with torch.inference_mode():
        for b in (int(b) for b in batch_sizes):
            eager = stack.step_fn(b)
            path, packed = fastest_packed(stack, b)
            if b <= eager_up_to:
                ratio = host.paired_ratio(eager, packed, pairs=pairs)
                row = {"packed_s": ratio.seconds_b, "eager_s": ratio.seconds_a, "ratio": ratio}
            else:
                row = {"packed_s": host.median_time(packed, repeats=pairs), "eager_s": float("nan"),
                       "ratio": None}
            rows.append({"batch": b, "path": path, **row})
            del packed
    stack.release()
    return rows


def fastest_packed(stack: GemmStack, batch: int, pairs: int = 5):
    """``(path, step)``: the faster packed step at ``batch`` on this CPU, MKL's or oneDNN's
    packed GEMM (the median of ``pairs`` interleaved pairs decides), or ``("eager", eager
    step)`` where this torch has neither. Two pairs were too few: one slow moment of the
    faster path on a 2-core AMD EPYC picked MKL's GEMM, no faster there than eager."""
    paths = [p for p in PACKED_PATHS if prepacked_linear(torch.zeros(1, 1), 1, p) is not None]
    if not paths:
        return "eager", stack.step_fn(batch)
    path, packed = paths[0], stack.step_fn(batch, prepack=paths[0])
    with torch.inference_mode():
        for other_path in paths[1:]:
            other = stack.step_fn(batch, prepack=other_path)
            if host.paired_ratio(packed, other, pairs=pairs).median > 1.0:
                path, packed = other_path, other
    return path, packed


def b1_over_read(stack: GemmStack, pairs: int = 7, path: str | None = None) -> host.PairedRatio:
    """CPU: the packed B=1 step over a plain read (a sum) of the same weights, interleaved:
    how close one decode step's GEMMs come to the weight-read floor, measured at the same
    moment as the floor itself. ``path``: "mkl" or "onednn"; by default the faster of the
    two at B=1 on this CPU (``fastest_packed``), as the sweep uses."""
    with torch.inference_mode():
        step = stack.step_fn(1, prepack=path) if path else fastest_packed(stack, 1)[1]
        ratio = host.paired_ratio(step, lambda: [w.sum() for w in stack.weights], pairs=pairs)
    stack.release()
    return ratio


def _best_cpu_time(fn, repeats: int) -> float:
    fn()                                                         # warm-up
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# ---- (b) tinyserve's own model, through the engine -----------------------------------------

TPOT_ROUNDS = 5     # LLM.generate calls per batch size, each beside a pure step


def sweep_engine(batch_sizes, model: str = "cpu-bench", steps: int = 3, prompt_len: int = 4,
                 seed: int = 0, dtype: str = "auto", enforce_eager: bool = True,
                 tpot_batches=()) -> tuple[list[float], dict]:
    """Median seconds of pure decode steps with B running requests, from ``engine.step_stats``.

    Returns the times and a description of the model (parameters and bytes read
    per step: every weight except the embedding table, of which a step reads a few
    rows, unless the output projection is that table, ``packed_gemm.weights_read``),
    with the compile seconds of each graph when ``enforce_eager=False``.
    """
    from tinyserve import LLM, SamplingParams

    top = int(max(batch_sizes))
    started = time.perf_counter()
    llm = LLM(model, seed=seed, max_num_seqs=top, max_num_batched_tokens=max(256, top * prompt_len),
              max_model_len=prompt_len + steps + 8, dtype=dtype, enforce_eager=enforce_eager)
    engine = llm.engine
    read = weights_read(llm.model)
    path = engine.executor.decode_path
    info = {"model": model, "num_parameters_read": int(sum(p.numel() for p in read)),
            "weight_bytes": int(sum(p.numel() * p.element_size() for p in read)),
            "dtype": {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[read[0].dtype],
            "enforce_eager": engine.executor.enforce_eager,
            "start_s": time.perf_counter() - started,
            "decode_path": None if path is None else path.describe(),
            "warm_up_s": None if path is None else path.warm_up_seconds}

    def decode_step(batch: int) -> float:
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(31 * i + 7 * j + batch) % 2000 + 10 for j in range(prompt_len)], params)
        first = engine.core.num_steps
        while engine.has_unfinished_requests():
            engine.step()
        durations = [s.duration for s in engine.core.steps_since(first)
                     if s.num_decode_tokens == batch and s.num_prefill_tokens == 0]
        return statistics.median(durations)

    decode_step(min(4, top))                                     # warm-up
    times = [decode_step(int(b)) for b in batch_sizes]
    # What a user sees: the mean TPOT of b requests sent together through LLM.generate
    # (scheduling, sampling, detokenizing included), each round right after a pure step
    # of the same batch, so that both see the machine in the same phase: medians over rounds.
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    info["tpot_s"], info["tpot_over_step"] = {}, {}
    for b in map(int, tpot_batches):
        prompts = [[(13 * i + j) % 2000 + 10 for j in range(prompt_len)] for i in range(b)]
        tpots, ratios = [], []
        for _ in range(TPOT_ROUNDS):
            step = decode_step(b)
            outs = llm.generate(prompts, [params] * b)
            tpots.append(statistics.mean(o.metrics.tpot for o in outs))
            ratios.append(tpots[-1] / step)
        info["tpot_s"][b], info["tpot_over_step"][b] = statistics.median(tpots), statistics.median(ratios)
    return times, info


# ---- fits and the report -------------------------------------------------------------------

def fit_min_batch(device: str) -> int:
    """Smallest batch size the knee fit uses: 2 on a CPU, 1 on a GPU.

    At B = 1 a CPU BLAS runs a matrix-vector kernel (GEMV) that streams the
    weights at close to copy speed; from B = 2 on it runs a general GEMM that
    repacks them first, a different and slower code path. Its point sits far
    below the GEMM plateau and would drag the hinge to B = 1, so the fit of the
    GEMM regime starts at 2 (B = 1 is still reported against the floor).
    """
    return 1 if device == "cuda" else 2


def knee_report(batch_sizes, step_times, hw: hwm.HardwareSpec, dtype: str, weight_bytes: float,
                min_batch: int = 1) -> dict:
    """Hinge fit of one curve (points with B >= ``min_batch``) next to the roofline's predictions."""
    b, t = np.asarray(batch_sizes, dtype=float), np.asarray(step_times, dtype=float)
    keep = b >= min_batch
    if np.unique(b[keep]).size < 3:                              # too few points left: fit them all
        keep[:], min_batch = True, 1
    fit = measure.fit_knee(b[keep], t[keep])
    floor = weight_read_floor(hw, weight_bytes)
    pred = predicted_crossover(hw, dtype)
    return {"knee": fit.knee, "fit_floor_s": fit.floor, "fit_slope_s": fit.slope, "flat": fit.flat,
            "predicted_crossover": pred, "knee_over_predicted": fit.knee / pred,
            "weight_read_floor_s": floor, "b1_time_s": float(step_times[0]),
            "b1_over_floor": float(step_times[0]) / floor, "dtype": dtype, "fit_min_batch": min_batch}


def spec_to_dict(hw: hwm.HardwareSpec) -> dict:
    return asdict(hw)


def machine_info(device: str) -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(), "cpu": host.cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def run(device: str | None = None, batch_sizes=None, weight_gib: float | None = None,
        engine_batch_sizes=None, engine_model: str | None = "cpu-bench", repeats: int = 3,
        engine_steps: int = 3, measure_seconds: float = 1.0, verbose: bool = True,
        engine_dtype: str = "auto", engine_enforce_eager: bool = True) -> dict:
    """Measure ceilings, sweep both curves, fit them; return the report (see ``REPORT_KEYS``)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    say = print if verbose else (lambda *a, **k: None)
    hw = measure.measure_device(device, seconds=measure_seconds)
    say(f"ceilings on {hw.name}: copy bandwidth {hw.memory_bandwidth / 1e9:.1f} GB/s, "
        + ", ".join(f"{d} matmul {f / 1e12:.3f} TFLOP/s" for d, f in hw.flops.items()))
    say(f"  {hw.source}")

    cfg = stack_config(device, weight_gib)
    batch_sizes = list(batch_sizes or default_batch_sizes(device))
    stack = GemmStack(cfg["hidden"], cfg["num_layers"], cfg["dtype"], device)
    say(f"GEMM stack: {cfg['num_layers']} layers of hidden {cfg['hidden']} in {cfg['dtype']}, "
        f"{stack.weight_bytes / 2**30:.2f} GiB of weights; batch sizes {batch_sizes[0]}..{batch_sizes[-1]}")
    t0 = time.perf_counter()
    stack_times = sweep_gemm_stack(stack, batch_sizes, repeats, prepack=not engine_enforce_eager)
    say(f"  swept in {time.perf_counter() - t0:.1f} s")
    curves = {"gemm_stack": {"batch_sizes": batch_sizes, "step_times_s": stack_times, **cfg,
                             "num_parameters": stack.num_parameters, "weight_bytes": stack.weight_bytes}}
    lo = fit_min_batch(device)
    fits = {"gemm_stack": knee_report(batch_sizes, stack_times, hw, cfg["dtype"], stack.weight_bytes, lo)}
    del stack
    if device == "cuda":
        torch.cuda.empty_cache()

    if engine_model:
        eb = list(engine_batch_sizes or [b for b in default_batch_sizes("cpu") if b & (b - 1) == 0])
        t0 = time.perf_counter()
        times, info = sweep_engine(eb, engine_model, steps=engine_steps, dtype=engine_dtype,
                                   enforce_eager=engine_enforce_eager)
        say(f"engine ({engine_model}): swept in {time.perf_counter() - t0:.1f} s")
        curves["engine"] = {"batch_sizes": eb, "step_times_s": times, **info}
        fits["engine"] = knee_report(eb, times, hw, info["dtype"], info["weight_bytes"], lo)

    report = {"benchmark": "crossover", "device": device, "machine": machine_info(device),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "python": platform.python_version(),
                           "numpy": np.__version__},
              "device_spec": spec_to_dict(hw), "curves": curves, "fits": fits}
    if verbose:
        print_report(report)
    return report


def print_report(report: dict) -> None:
    print(f"{'curve':<12}{'dtype':<7}{'knee (fit)':>11}{'predicted':>11}{'ratio':>7}"
          f"{'B=1 ms':>9}{'floor ms':>10}{'B=1/floor':>11}")
    for name, f in report["fits"].items():
        knee = f">={f['knee']:.0f}" if f["flat"] else f"{f['knee']:.1f}"
        print(f"{name:<12}{f['dtype']:<7}{knee:>11}{f['predicted_crossover']:>11.1f}"
              f"{f['knee_over_predicted']:>7.2f}{f['b1_time_s'] * 1e3:>9.2f}"
              f"{f['weight_read_floor_s'] * 1e3:>10.2f}{f['b1_over_floor']:>11.2f}")
    print("predicted = peak FLOP/s / copy bandwidth x bytes per parameter / 2; "
          "floor = weight bytes / copy bandwidth")
    lo = max(f.get("fit_min_batch", 1) for f in report["fits"].values())
    if lo > 1:
        print(f"knees fitted on B >= {lo}: at B = 1 the CPU BLAS runs a separate matrix-vector kernel")


def write_json(report: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def load_stored(directory=None) -> list[dict]:
    """Every ``bench_crossover_*.json`` in ``tinyserve/data`` (or ``directory``), newest name first."""
    directory = Path(directory) if directory else Path(__file__).parents[1] / "data"
    return [json.loads(p.read_text()) for p in sorted(directory.glob("bench_crossover_*.json"), reverse=True)]


def add_arguments(parser) -> None:
    parser.add_argument("--out", help="also write the report as JSON to this path")
    parser.add_argument("--cpu", action="store_true", help="measure the CPU even with a GPU")
    parser.add_argument("--max-batch", type=int, help="largest batch (default 1024 GPU, 256 CPU)")
    parser.add_argument("--weight-gib", type=float,
                        help="GiB of weights in the GEMM stack (default 1 on CPU; GPU: 32 7B layers)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per batch size")
    parser.add_argument("--no-engine", action="store_true", help="skip the tinyserve model sweep")
    parser.add_argument("--model", default="cpu-bench",
                        help="preset or checkpoint directory the engine sweep runs (default cpu-bench)")
    parser.add_argument("--dtype", default="auto",
                        help="the engine sweep's dtype: auto (the checkpoint's own), float32, bfloat16, float16")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-enforce-eager: the engine sweep runs compiled decode graphs, "
                             "and the GEMM stack's weights are packed once per batch size (CPU)")


def main(args) -> dict:
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    report = run(device, batch_sizes=default_batch_sizes(device, args.max_batch),
                 weight_gib=args.weight_gib, repeats=args.repeats,
                 engine_model=None if args.no_engine else args.model, engine_dtype=args.dtype,
                 engine_enforce_eager=args.enforce_eager)
    if args.out:
        print(f"wrote {write_json(report, args.out)}")
    return report
