"""Measuring the machine we run on: its two roofline ceilings, and the knee of a curve.

``measure_device`` times a large copy (memory bandwidth) and large matmuls per
dtype (FLOP/s) and returns them as a ``hardware.HardwareSpec``, so the roofline
of ``tinyserve.hardware`` can predict this machine's crossover.
``fit_knee`` / ``find_knee`` locate the crossover in a measured curve of step
time against batch size: a flat-then-linear hinge, fitted by least squares.

The discipline every timing in the book follows is here too, in one place:
``median_time`` (warm-up, then the median of repeats), ``paired_ratio`` (A and B
interleaved, the median of per-pair ratios, with their spread, so a busy moment
slows both sides of a pair alike), ``fixed_threads`` (by default on the ``free_cores``,
those other programs leave free) and ``this_machine`` (what a number was measured
on: CPU model, cores, L3, copy bandwidth, versions).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tinyserve.hardware import HardwareSpec

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def l3_cache_bytes() -> int | None:
    """This CPU's last-level cache in bytes (summed over instances), or None if unknown."""
    try:
        sizes = {}
        base = "/sys/devices/system/cpu"
        for cpu in sorted(os.listdir(base)):
            cache = os.path.join(base, cpu, "cache")
            if not cpu.startswith("cpu") or not os.path.isdir(cache):
                continue
            for index in os.listdir(cache):
                folder = os.path.join(cache, index)
                if not index.startswith("index"):
                    continue
                with open(os.path.join(folder, "level")) as f:
                    if f.read().strip() != "3":
                        continue
                with open(os.path.join(folder, "shared_cpu_list")) as f:
                    shared = f.read().strip()
                with open(os.path.join(folder, "size")) as f:
                    text = f.read().strip().upper()
                scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
                sizes[shared] = int(text.rstrip("KMG")) * scale
        return sum(sizes.values()) or None
    except (OSError, ValueError):
        return None


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


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    if repeats < 1:
        raise ValueError(f"repeats: need at least 1, got {repeats}")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class PairedRatio:
    """``time(a) / time(b)`` over interleaved pairs: the median, and the spread of the ratios."""

    median: float
    low: float        # the second-smallest ratio (the smallest for fewer than 5 pairs)
    high: float       # the second-largest ratio
    ratios: tuple[float, ...]
    seconds_a: float  # median time of a
    seconds_b: float  # median time of b

    @property
    def spread(self) -> float:
        """(high - low) / median: how much one run of this machine can be trusted."""
        return (self.high - self.low) / self.median if self.median else math.inf

    def __str__(self) -> str:
        return f"{self.median:.2f}x (pairs {self.low:.2f}-{self.high:.2f}, n={len(self.ratios)})"


def paired_ratio(a: Callable[[], object], b: Callable[[], object], pairs: int = 7,
                 warmup: int = 1, sync: Callable[[], None] | None = None) -> PairedRatio:
    """How many times slower ``a`` is than ``b``, measured robustly on a busy machine.

    Each pair times ``a`` and ``b`` back to back, in alternating order (ABBA...), so
    a slow moment of the machine slows both members of a pair and drift cancels;
    the result is the median of the per-pair ratios, not a ratio of best times.
    """
    if pairs < 1:
        raise ValueError(f"pairs: need at least 1, got {pairs}")
    sync = sync or (lambda: None)
    for _ in range(warmup):
        a(), b()
    sync()

    def timed(fn):
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    ta, tb = [], []
    for i in range(pairs):
        if i % 2 == 0:
            ta.append(timed(a)), tb.append(timed(b))
        else:
            tb.append(timed(b)), ta.append(timed(a))
    ratios = sorted(x / y for x, y in zip(ta, tb))
    k = 1 if len(ratios) >= 5 else 0
    return PairedRatio(statistics.median(ratios), ratios[k], ratios[-1 - k], tuple(ratios),
                       statistics.median(ta), statistics.median(tb))


@contextlib.contextmanager
def fixed_threads(n: int | None = None):
    """Run the block with torch on ``n`` threads (default: the cores free right now), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n or free_cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_cores(sample: float = 0.3) -> int:
    """The usable cores that other programs are not keeping busy right now (at least 1).

    Over ``sample`` seconds, the busy time of this process's cores (``/proc/stat``) minus
    this process's own CPU time says how many cores others use. A torch op split over
    N threads waits for its slowest thread, so one thread sharing a core with a busy
    program slows every op down (on a 2-core machine beside one busy process, a whole
    notebook ran over 10 times slower on 2 threads). A virtual machine's steal time (the
    host running someone else on our core) counts as busy: the core is not ours then.
    Where ``/proc`` is missing, all usable cores.
    """
    if not (hasattr(os, "sched_getaffinity") and os.path.exists("/proc/stat")):
        return usable_cores()
    cpus = os.sched_getaffinity(0)
    cores = len(cpus)
    busy0, total0, own0 = *_cpu_jiffies(cpus), _own_jiffies()
    time.sleep(sample)
    busy1, total1, own1 = *_cpu_jiffies(cpus), _own_jiffies()
    if total1 <= total0:
        return cores
    others = max(0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * len(cpus)
    return max(1, cores - round(others))


def _cpu_jiffies(cpus) -> tuple[int, int]:
    """(busy, total) clock ticks so far, summed over ``cpus`` (from /proc/stat)."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]     # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _own_jiffies() -> int:
    """This process's user + system clock ticks so far (/proc/self/stat)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


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
                   matmul_size: int | None = None) -> HardwareSpec:
    """Measure this machine's memory bandwidth and matmul peak; return a ``HardwareSpec``.

    Bandwidth: a large ``dst.copy_(src)`` moves ``2 x size`` bytes (read and
    write). Peak: an ``n x n`` matmul does ``2 n^3`` FLOPs, in fp32 on a CPU and
    in fp16 and bf16 on a GPU (only measured dtypes appear in ``flops``). Each
    figure is the median of a few runs within about ``seconds / 2``. Defaults:
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
    dtypes = ("fp16", "bf16") if on_gpu else ("fp32",)
    flops = {dtype: _matmul_flops(dev, dtype, n, sync, timed, budget / len(dtypes))
             for dtype in dtypes}

    name, memory = _device_name_and_memory(dev) if on_gpu else _host_name_and_memory()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    source = (f"measured by tinyserve.measure.measure_device on {date}: copy_ of {copy_mib} MiB, "
              f"{n}x{n} matmul, torch {torch.__version__}")
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


def _matmul_flops(dev, dtype: str, n: int, sync, timed, budget: float) -> float:
    """FLOP/s of an ``n x n`` matmul in ``dtype`` (``2 n^3`` FLOPs), into a preallocated output."""
    import torch

    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)
    c = torch.empty(n, n, device=dev, dtype=tdtype)
    t = _median_time(timed(lambda: torch.matmul(a, b, out=c)), sync, budget)
    del a, b, c
    return 2 * n**3 / t


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
