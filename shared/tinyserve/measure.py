"""Benchmark tooling: this machine's two roofline ceilings, and the knee of a curve.

``measure_device`` times a large copy (memory bandwidth) and large matmuls per
dtype (FLOP/s) and returns them as a ``hardware.HardwareSpec``, so the roofline
of ``tinyserve.hardware`` can predict this machine's crossover; on a CPU the
peak is the fastest of torch's matmul and the packed GEMMs the sweeps run.
``read_bandwidth`` times a read-only pass. ``fit_knee`` / ``find_knee`` locate
the crossover in a measured curve of step time against batch size: a
flat-then-linear hinge, fitted by least squares. ``this_machine`` says what a
number was measured on (CPU model, cores, L3, copy bandwidth, versions).

What the engine itself asks of the host (its L3, its free cores) and the timing
discipline (``median_time``, ``paired_ratio``) are in ``tinyserve.host``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tinyserve.hardware import HardwareSpec
from tinyserve.host import cpu_name, l3_cache_bytes, median_time, usable_cores


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("nan")


def _median_time(fn, sync, seconds: float, min_reps: int = 3) -> float:
    """Median of repeated timings of ``fn`` (after one warm-up), within about ``seconds``."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < 50):
        times.append(fn())
    return statistics.median(times)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _triton_version() -> str:
    from tinyserve.kernels.triton_setup import HAS_TRITON   # whether it imports, not whether it is installed

    return _version("triton") if HAS_TRITON else "does not import"


@dataclass(frozen=True)
class Machine:
    """What a result was measured on."""

    cpu: str
    cores: int
    l3_bytes: int | None
    copy_bandwidth: float     # bytes/s, a 256 MiB copy (read + write)
    gpu: str | None
    torch: str
    triton: str
    date: str

    def __str__(self) -> str:
        l3 = f"{self.l3_bytes / 2**20:.0f} MiB L3" if self.l3_bytes else "L3 unknown"
        gpu = f" | GPU {self.gpu}" if self.gpu else ""
        return (f"machine: {self.cpu}, {self.cores} cores, {l3}, copy {self.copy_bandwidth / 1e9:.1f} GB/s"
                f"{gpu} | torch {self.torch}, triton {self.triton} | {self.date}")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def this_machine(copy_mib: int = 256) -> Machine:
    """The machine at hand, with its copy bandwidth measured now (about 0.3 s)."""
    import torch

    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / median_time(lambda: dst.copy_(src), repeats=5)
    del src, dst
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return Machine(cpu=cpu_name(), cores=usable_cores(), l3_bytes=l3_cache_bytes(),
                   copy_bandwidth=bandwidth, gpu=gpu, torch=torch.__version__,
                   triton=_triton_version(),
                   date=datetime.datetime.now().isoformat(timespec="seconds"))


def measure_device(device=None, seconds: float = 1.0, copy_mib: int | None = None,
                   matmul_size: int | None = None, dtypes: Sequence[str] | None = None) -> HardwareSpec:
    """Measure this machine's memory bandwidth and matmul peak; return a ``HardwareSpec``.

    Bandwidth: a large ``dst.copy_(src)`` moves ``2 x size`` bytes (read and
    write). Peak: an ``n x n`` matmul does ``2 n^3`` FLOPs, in ``dtypes``: by default
    fp32 on a CPU and fp16 and bf16 on a GPU (only measured dtypes appear in
    ``flops``; the matmul budget is shared among them). On a CPU
    the peak is the fastest of ``torch.matmul`` and the packed GEMMs that the
    crossover sweeps and ``enforce_eager=False`` run (``packed_gemm.prepacked_linear``):
    on some CPUs a packed GEMM outruns the default path by a wide margin, and a
    slope compared with 2P/F must use the F of the GEMM that made the slope. The
    ``source`` names the path that gave each dtype's peak, and every path's rate.
    Each figure is the median of a few runs within about ``seconds / 2``. Defaults:
    256 MiB buffers and n = 1536 on a CPU (about 1-3 s), 1 GiB and n = 8192 on a GPU.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    copy_mib = copy_mib or (1024 if on_gpu else 256)
    n = matmul_size or (8192 if on_gpu else 1536)
    budget = seconds / 2
    sync, timed = _gpu_clock(dev) if on_gpu else _cpu_clock()

    bandwidth = _copy_bandwidth(dev, copy_mib, sync, timed, budget)
    dtypes = tuple(dtypes or (("fp16", "bf16") if on_gpu else ("fp32",)))
    rates = {dtype: _matmul_flops(dev, dtype, n, sync, timed, budget / len(dtypes))
             for dtype in dtypes}
    flops = {dtype: max(by_path.values()) for dtype, by_path in rates.items()}

    name, memory = _device_name_and_memory(dev) if on_gpu else _host_name_and_memory()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    source = (f"measured by tinyserve.measure.measure_device on {date}: copy_ of {copy_mib} MiB, "
              f"{n}x{n} matmul ({'; '.join(_fastest_path(d, r) for d, r in rates.items())}), "
              f"torch {torch.__version__}")
    return HardwareSpec(name=name, flops=flops, memory_bandwidth=bandwidth,
                        memory_size=memory, source=source)


def _gpu_clock(dev):
    """``(sync, timed)`` for a GPU: CUDA events time the kernels, not the Python launching them."""
    import torch

    def sync():
        torch.cuda.synchronize(dev)

    def timed(op):
        def run():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return run
    return sync, timed


def _cpu_clock():
    """``(sync, timed)`` for a CPU: nothing to wait for, wall time around the call."""
    def sync():
        pass

    def timed(op):
        def run():
            t = time.perf_counter()
            op()
            return time.perf_counter() - t
        return run
    return sync, timed


def read_bandwidth(device=None, mib: int = 1024, seconds: float = 1.0) -> float:
    """Bytes/s of streaming ``mib`` MiB of fp32 through a ``sum``: reads only, like the
    weights in a decode step (``measure_device``'s copy also writes)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync, timed = _gpu_clock(dev) if dev.type == "cuda" else _cpu_clock()
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=dev)
    bandwidth = data.nbytes / _median_time(timed(lambda: data.sum()), sync, seconds)
    del data
    return bandwidth


def _copy_bandwidth(dev, copy_mib: int, sync, timed, budget: float) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``copy_mib`` MiB of fp32 (read + write: ``2 x size``)."""
    import torch

    numel = copy_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / _median_time(timed(lambda: dst.copy_(src)), sync, budget)
    del src, dst
    return bandwidth


def _matmul_flops(dev, dtype: str, n: int, sync, timed, budget: float) -> dict[str, float]:
    """FLOP/s of an ``n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs) by path: ``torch.matmul``
    into a preallocated output, and each packed GEMM this torch has for it (CPU fp32:
    ``b`` packed once for ``n`` rows, as the sweeps pack their weights). Bf16 on a CPU
    where oneDNN packs no bf16 (no native bf16) also by the path the engine runs there,
    fp32 compute on the bf16 weight (``packed_gemm.upcast_matmul``): torch's own bf16
    matmul can be a hundred times slower on such a CPU."""
    import torch

    from tinyserve.packed_gemm import (PACKED_PATHS, packs, prepacked_linear, upcast_matmul,
                                       upcast_scratch)

    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)
    c = torch.empty(n, n, device=dev, dtype=tdtype)
    ops = {"torch.matmul": lambda: torch.matmul(a, b, out=c)}
    for path in PACKED_PATHS:
        packed = prepacked_linear(b.t(), n, path)        # x -> x @ b, b packed once
        if packed is not None:
            ops[f"{path} packed"] = lambda packed=packed: packed(a)
    if dev.type == "cpu" and tdtype == torch.bfloat16 and not packs(tdtype):
        weight, scratch = b.t().contiguous(), upcast_scratch(n)
        ops["fp32 compute on bf16"] = lambda: upcast_matmul(a, weight, None, scratch)
    with torch.inference_mode():
        rates = {name: 2 * n**3 / _median_time(timed(op), sync, budget / len(ops))
                 for name, op in ops.items()}
    del a, b, c, ops
    return rates


def _fastest_path(dtype: str, rates: dict[str, float]) -> str:
    """``fp32 peak from onednn packed (torch.matmul x, mkl packed y, onednn packed z TFLOP/s)``."""
    best = max(rates, key=rates.get)
    each = ", ".join(f"{name} {rate / 1e12:.3g}" for name, rate in rates.items())
    return f"{dtype} peak from {best} ({each} TFLOP/s)"


def _device_name_and_memory(dev) -> tuple[str, float]:
    """A GPU's name and total memory in bytes."""
    import torch

    name = torch.cuda.get_device_name(dev)
    memory = float(torch.cuda.get_device_properties(dev).total_memory)
    return name, memory


def _host_name_and_memory() -> tuple[str, float]:
    """The CPU's name with torch's thread count, and the host's physical memory in bytes."""
    import torch

    name = f"{cpu_name()} ({torch.get_num_threads()} threads)"
    memory = _host_memory()
    return name, memory


# --------------------------------------------------------------------------- knee fit


@dataclass(frozen=True)
class KneeFit:
    """A fitted hinge: ``floor`` up to ``knee``, then rising by ``slope`` seconds per request.

    ``flat`` is True when no rise was found; by convention ``knee`` is then the
    largest batch size measured (the crossover lies at or beyond it).
    """

    knee: float
    floor: float
    slope: float
    flat: bool = False

    def predict(self, batch_sizes) -> np.ndarray:
        b = np.asarray(batch_sizes, dtype=float)
        return self.floor + self.slope * np.maximum(b - self.knee, 0.0)


def fit_knee(batch_sizes, step_times, min_rise: float = 0.1, min_f: float = 10.0,
             num_candidates: int = 1000) -> KneeFit:
    """Fit ``t = floor`` for ``B <= knee`` and ``floor + slope (B - knee)`` after.

    For each candidate knee (log-spaced between the smallest and the largest
    batch size, as the sweep usually is) the floor and slope follow from a
    weighted least-squares line fit; the weights 1/t make it minimise relative
    error, so the flat part counts as much as the steep tail. The knee with the
    smallest residual wins.

    The curve is called flat, and the knee reported at ``B_max`` (the crossover
    lies at or beyond the sweep), when the fitted rise over the measured range,
    ``slope x (B_max - knee)``, is under ``min_rise`` of the floor, or when the
    hinge does not fit clearly better than a flat line: its two extra
    parameters must cut the residual by ``min_f`` times what noise alone
    would (an F statistic; with 5% noise a flat curve stays below 10). A knee below the
    smallest batch cannot be told apart from one at it, so ``knee >= B_min``.
    """
    b = np.asarray(batch_sizes, dtype=float).ravel()
    t = np.asarray(step_times, dtype=float).ravel()
    if b.shape != t.shape:
        raise ValueError(f"batch_sizes and step_times differ in length ({b.size} vs {t.size})")
    if b.size < 3:
        raise ValueError(f"need at least 3 points to fit a knee, got {b.size}")
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(t)) and np.all(b > 0) and np.all(t > 0)):
        raise ValueError("batch sizes and step times must be positive and finite")
    if np.unique(b).size < 2:
        raise ValueError("need at least 2 distinct batch sizes")
    b_min, b_max = b.min(), b.max()

    knees = np.geomspace(b_min, b_max, num_candidates)                     # (K,)
    x = np.maximum(b[None, :] - knees[:, None], 0.0)                       # (K, n)
    w = 1.0 / t**2                                                         # relative error
    sw, sy = w.sum(), (w * t).sum()
    sx, sxx, sxy = (w * x).sum(1), (w * x * x).sum(1), (w * x * t).sum(1)
    det = sw * sxx - sx**2
    ok = det > 1e-12 * sw * np.maximum(sxx, 1e-300)
    slope = np.where(ok, (sw * sxy - sx * sy) / np.where(ok, det, 1.0), 0.0)
    slope = np.maximum(slope, 0.0)                                         # a step never gets faster
    floor = (sy - slope * sx) / sw
    resid = (w * (t[None, :] - floor[:, None] - slope[:, None] * x) ** 2).sum(1)
    i = int(np.argmin(resid))
    knee, fl, s = float(knees[i]), float(floor[i]), float(slope[i])
    mean = sy / sw
    rss_flat, rss_hinge = float((w * (t - mean) ** 2).sum()), float(resid[i])
    dof = b.size - 3
    if dof > 0 and rss_hinge > 0:
        f_stat = (rss_flat - rss_hinge) / 2 / (rss_hinge / dof)
    else:
        f_stat = math.inf if rss_flat > rss_hinge else 0.0
    if s * (b_max - knee) < min_rise * fl or f_stat < min_f:
        return KneeFit(knee=float(b_max), floor=float(mean), slope=0.0, flat=True)
    return KneeFit(knee=knee, floor=fl, slope=s)


def find_knee(batch_sizes, step_times, **kwargs) -> float:
    """The crossover batch of a measured curve: ``fit_knee(...).knee`` (see there)."""
    return fit_knee(batch_sizes, step_times, **kwargs).knee
