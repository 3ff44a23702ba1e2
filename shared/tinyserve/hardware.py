"""Roofline arithmetic for a decode step, and a measurement of this machine.

This is the model behind the chapter section 「批多大才划算」. In a decode
step every running request contributes one new token, and the step has two
costs:

* **Reading the weights.** Each step streams every parameter from memory once,
  however many requests share it. For a 7B-parameter model in fp16 that is
  7e9 x 2 bytes = 14 GB; at an A100's 2039 GB/s it takes about 6.9 ms. This is
  the floor of the step time, already paid at batch size 1.
* **Computing.** One token costs about 2 FLOPs per parameter (a multiply and an
  add), 14 GFLOP for the 7B model, which the A100's 312 TFLOP/s of dense fp16
  tensor-core throughput finishes in about 45 us. This cost grows with the batch.

While batch x 45 us is below 6.9 ms the arithmetic hides under the memory
traffic, the step time stays flat and throughput grows linearly with the batch.
The two meet at 6.9 ms / 45 us = 153 requests. That ratio is no accident: the
bytes per parameter and the 2 FLOPs per parameter cancel (exactly, in fp16),
leaving peak FLOP/s / bandwidth = 312e12 / 2039e9 = 153, the arithmetic
intensity at which the hardware turns from memory-bound to compute-bound.
Past the crossover every extra request makes every user's step longer, which is
why engines keep the batch near it rather than in the thousands.

``decode_step_time`` puts both costs into one roofline,
``max(bytes / bandwidth, FLOPs / peak)``, and also counts the KV cache that
attention reads once ``context_len > 0``. ``measure_device`` measures the two
ceilings of the machine it runs on, and ``fit_knee`` / ``find_knee`` locate the
crossover in a measured curve of step time against batch size.

All times are in seconds, sizes in bytes, throughputs in FLOP/s and bytes/s.
Dtypes are strings: "fp32", "tf32", "fp16", "bf16", "fp8", "int8".

>>> crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16")  # doctest: +ELLIPSIS
153.0...
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np

BYTES_PER_ELEMENT: dict[str, int] = {
    "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1,
}


def lookup(table: dict, name: str, what: str):
    """``table[name]``, or a ValueError that lists the choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]


def bytes_per_element(dtype: str) -> int:
    return lookup(BYTES_PER_ELEMENT, dtype, "dtype")


# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class HardwareSpec:
    """The ceilings of one accelerator (or CPU).

    ``flops`` maps a dtype to the dense peak in FLOP/s (no structured
    sparsity); ``memory_bandwidth`` is in bytes/s and ``memory_size`` in bytes.
    ``source`` says where the figures come from.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory_size: float
    source: str = ""

    def peak_flops(self, dtype: str) -> float:
        bytes_per_element(dtype)  # validates the name
        if dtype not in self.flops:
            raise ValueError(f"{self.name}: no peak FLOP/s for dtype {dtype!r}; "
                             f"known: {sorted(self.flops)}")
        return self.flops[dtype]

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte at which compute time equals memory time."""
        return self.peak_flops(dtype) / self.memory_bandwidth


T = 1e12
A100_SXM_80GB = HardwareSpec(
    name="A100-SXM4-80GB",
    flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T, "int8": 624 * T},
    memory_bandwidth=2039e9,
    memory_size=80e9,
    source="NVIDIA A100 datasheet, SXM 80GB column, dense (fp32 without tensor cores)",
)
H100_SXM = HardwareSpec(
    name="H100-SXM5-80GB",
    flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989 * T, "bf16": 989 * T,
           "fp8": 1979 * T, "int8": 1979 * T},
    memory_bandwidth=3.35e12,
    memory_size=80e9,
    source="NVIDIA H100 datasheet, SXM column, dense (half the with-sparsity figures)",
)
# The same Hopper chip as the H100 (same FLOP/s), with more and faster HBM.
H200 = dataclasses.replace(
    H100_SXM,
    name="H200-SXM-141GB",
    memory_bandwidth=4.8e12,
    memory_size=141e9,
    source="NVIDIA H200 datasheet, SXM column, dense (half the with-sparsity figures)",
)
del T

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "A100_SXM_80GB": A100_SXM_80GB,
    "H100_SXM": H100_SXM,
    "H200": H200,
}


def get_hardware(name: str) -> HardwareSpec:
    return lookup(HARDWARE_PRESETS, name, "hardware preset")


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """What the roofline needs to know about a decoder-only model."""

    name: str
    num_parameters: float
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config, name: str = "custom") -> "ModelSpec":
        """From a ``tinyserve.model.ModelConfig`` (e.g. the ``cpu-bench`` preset)."""
        return cls(name=name, num_parameters=config.num_parameters(),
                   hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   vocab_size=config.vocab_size)


# Parameter counts rounded the way the chapter rounds them (7e9 -> 14 GB in fp16).
LLAMA_7B = ModelSpec("Llama-7B", 7e9, hidden_size=4096, num_layers=32,
                     num_kv_heads=32, head_dim=128, vocab_size=32000)
LLAMA_13B = ModelSpec("Llama-13B", 13e9, hidden_size=5120, num_layers=40,
                      num_kv_heads=40, head_dim=128, vocab_size=32000)
LLAMA_70B = ModelSpec("Llama-70B", 70e9, hidden_size=8192, num_layers=80,
                      num_kv_heads=8, head_dim=128, vocab_size=32000)  # grouped-query attention

MODELS: dict[str, ModelSpec] = {"LLAMA_7B": LLAMA_7B, "LLAMA_13B": LLAMA_13B, "LLAMA_70B": LLAMA_70B}


# --------------------------------------------------------------------------- roofline


def weight_bytes(model: ModelSpec, dtype: str) -> float:
    return model.num_parameters * bytes_per_element(dtype)


def weight_read_time(hw: HardwareSpec, model: ModelSpec, dtype: str) -> float:
    """Streaming every weight once: the floor of a decode step."""
    return weight_bytes(model, dtype) / hw.memory_bandwidth


def per_request_compute_time(hw: HardwareSpec, model: ModelSpec, dtype: str) -> float:
    """2 FLOPs per parameter for one new token, at peak."""
    return 2 * model.num_parameters / hw.peak_flops(dtype)


def crossover_batch(hw: HardwareSpec, model: ModelSpec, dtype: str) -> float:
    """Batch size at which compute catches up with the weight read.

    Equals peak / bandwidth x (bytes per parameter / 2): the ridge point itself in fp16.
    """
    return weight_read_time(hw, model, dtype) / per_request_compute_time(hw, model, dtype)


def kv_bytes_per_token(model: ModelSpec, dtype: str) -> float:
    """K and V of one token, all layers."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_element(dtype)


def _check_batch(batch: float, context_len: float) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")


def step_bytes(model: ModelSpec, dtype: str, kv_tokens: float) -> float:
    """Bytes one forward pass moves: every weight once, plus ``kv_tokens`` tokens of KV cache."""
    return weight_bytes(model, dtype) + kv_tokens * kv_bytes_per_token(model, dtype)


def step_flops(model: ModelSpec, tokens: float, attention_pairs: float) -> float:
    """2 FLOPs per parameter per new token, plus attention: QK^T and PV are 2 x 2 x hidden
    FLOPs per (query, key) pair per layer."""
    return 2 * model.num_parameters * tokens + 4 * model.num_layers * model.hidden_size * attention_pairs


def step_time(hw: HardwareSpec, model: ModelSpec, dtype: str, tokens: float, kv_tokens: float,
              attention_pairs: float) -> float:
    """Roofline of any step (prefill chunks and decodes mixed): the slower of memory and compute."""
    return max(step_bytes(model, dtype, kv_tokens) / hw.memory_bandwidth,
               step_flops(model, tokens, attention_pairs) / hw.peak_flops(dtype))


def decode_step_bytes(model: ModelSpec, batch: float, dtype: str, context_len: float = 0) -> float:
    """Weights once, plus every request's KV cache."""
    _check_batch(batch, context_len)
    return step_bytes(model, dtype, batch * context_len)


def decode_step_flops(model: ModelSpec, batch: float, context_len: float = 0) -> float:
    """One new token per request, each attending over ``context_len`` tokens."""
    _check_batch(batch, context_len)
    return step_flops(model, batch, batch * context_len)


def decode_step_time(hw: HardwareSpec, model: ModelSpec, batch: float, dtype: str,
                     context_len: float = 0) -> float:
    """Roofline of a decode step: ``step_time`` with one token per request."""
    _check_batch(batch, context_len)
    return step_time(hw, model, dtype, batch, batch * context_len, batch * context_len)


def arithmetic_intensity(model: ModelSpec, batch: float, dtype: str, context_len: float = 0) -> float:
    """FLOPs per byte moved in one decode step (= batch in fp16 when context_len = 0)."""
    return decode_step_flops(model, batch, context_len) / decode_step_bytes(model, batch, dtype, context_len)


def tokens_per_second(hw: HardwareSpec, model: ModelSpec, batch: float, dtype: str,
                      context_len: float = 0) -> tuple[float, float]:
    """(per-user tokens/s, total tokens/s) at this batch size."""
    step = decode_step_time(hw, model, batch, dtype, context_len)
    return 1.0 / step, batch / step


# --------------------------------------------------------------------------- measurement


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


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
    source = (f"measured by tinyserve.hardware.measure_device on {date}: copy_ of {copy_mib} MiB, "
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

    name = f"{_cpu_name()} ({torch.get_num_threads()} threads)"
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
