"""The host at run time: what it is, and how to time anything on it fairly.

What the engine asks of the machine it runs on lives here, apart from the
benchmark tooling of ``tinyserve.measure``: ``l3_cache_bytes`` (does a model's
weight stack fit the last-level cache?), ``cpu_name``, ``usable_cores`` and
``free_cores`` (those other programs leave free), ``fixed_threads`` (run a block
on a given number of torch threads, by default the free cores), and
``keep_freed_memory`` (the C library's allocator keeps what a step frees for the next)
and ``return_freed_memory`` (hand what start-up freed back to the OS).

The discipline every timing in the book follows is here too, in one place:
``median_time`` (warm-up, then the median of repeats) and ``paired_ratio`` (A and
B interleaved, the median of per-pair ratios, with their spread, so a busy moment
slows both sides of a pair alike); the engine uses it to choose between eager
and packed decode steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where the kernel reports them
    (x86): a virtual machine often shows a bare "AMD EPYC" or "Intel(R) Xeon(R) Processor",
    which says nothing of the generation (AMD family 25 is Zen 3 and 4, 26 is Zen 5)."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            # The first processor's lines only: the file holds a block per processor (hundreds
            # on a server), and native.load asks at every start.
            name = describe_cpu("".join(itertools.takewhile(str.strip, f)))
        if name:
            return name
    return platform.processor() or platform.machine() or "CPU"


def describe_cpu(cpuinfo: str) -> str:
    """``cpu_name`` from the text of ``/proc/cpuinfo`` (its first processor), "" without a
    model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break           # the blank line after the first processor
            continue
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    if name and "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def cache_root() -> Path:
    """Where tinyserve keeps what it builds once per machine (random checkpoints, compiled
    kernels): ``$TINYSERVE_CACHE``, else ``~/.cache/tinyserve``."""
    return Path(os.environ.get("TINYSERVE_CACHE") or Path.home() / ".cache" / "tinyserve")


def cpu_flags() -> str:
    """The instruction-set extensions this CPU reports (``/proc/cpuinfo``'s "flags" on x86,
    "Features" on ARM), "" where unknown: what code built for ``-march=native`` relies on."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    return ""


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


def interleaved_times(fns: dict[str, Callable[[], object]], rounds: int,
                      sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds of every call: ``rounds`` rounds of one call of each function, the order
    rotating from round to round. A slow moment of the machine, or a drift of its memory
    speed, falls on all of them alike, and none is always first or last."""
    if rounds < 1:
        raise ValueError(f"rounds: need at least 1, got {rounds}")
    sync = sync or (lambda: None)
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    if repeats < 1:
        raise ValueError(f"repeats: need at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    return statistics.median(interleaved_times({"fn": fn}, repeats, sync)["fn"])


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
    for _ in range(warmup):
        a(), b()
    if sync:
        sync()
    times = interleaved_times({"a": a, "b": b}, pairs, sync)     # a b, b a, a b, ...
    ta, tb = times["a"], times["b"]
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


# glibc's malloc gives a freed block above its mmap threshold back to the OS, and trims
# the top of its heap once more than its trim threshold lies free there; both thresholds
# move with the sizes freed. An engine step frees its activations (megabytes in a prefill
# of hundreds of tokens) and the next step asks for them again, so the kernel faults in
# and zeroes every page anew. tiny-zh prefilling 16 prompts of 64 tokens in one step, on
# an AMD EPYC Zen 5 (2 cores, 32 MiB L3): 6,900-12,100 minor page faults a step and a
# median step of 26.8-32.4 ms; with the thresholds fixed, 1-4 faults and 18.9-19.2 ms
# (21 steps each, two processes each way); cpu-bench's B=1, B=32 and 32 mixed requests
# through LLM.generate within 1% either way. PyTorch keeps freed GPU memory in its caching
# allocator for the same reason, and vLLM's CPU backend preloads tcmalloc.
KEEP_MMAP_THRESHOLD = 32 * 2**20    # glibc's largest: bigger blocks are still mapped apart
KEEP_TRIM_THRESHOLD = 2**30         # trim only past this (explicit malloc_trim still trims)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt's parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Have the C library keep the memory a step frees, for the next step to reuse, instead
    of handing it back to the OS (``mallopt``: fixed mmap and trim thresholds), once per
    process; True where that took (glibc). ``TINYSERVE_KEEP_FREED_MEMORY=0`` leaves the
    allocator as it is. A no-op elsewhere."""
    if os.environ.get("TINYSERVE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return (mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD) == 1
            and mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD) == 1)


def return_freed_memory() -> None:
    """Give freed weights back to the OS. glibc keeps freed heap chunks below its mmap
    threshold (most weight matrices) in the process, where RSS still counts them;
    ``malloc_trim`` returns them, whatever ``keep_freed_memory`` set. A no-op where the C
    library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_cores(sample: float = 0.3) -> int:
    """The usable cores that other programs are not keeping busy right now (at least 1).

    A torch op split over N threads waits for its slowest thread, so one thread sharing
    a core with a busy program slows every op down, and a whole notebook with it.
    Where ``/proc`` is missing, all usable cores.
    """
    if not (hasattr(os, "sched_getaffinity") and os.path.exists("/proc/stat")):
        return usable_cores()
    return max(1, usable_cores() - round(cores_busy_with_others(sample)))


def cores_busy_with_others(sample: float = 0.3) -> float:
    """How many of this process's usable cores other programs kept busy over ``sample``
    seconds (Linux): their busy time (``/proc/stat``) minus this process's own CPU time.
    A virtual machine's steal time (the host running someone else on our core) counts as
    busy: the core is not ours then."""
    cpus = os.sched_getaffinity(0)
    busy0, total0, own0 = *_cpu_jiffies(cpus), _own_jiffies()
    time.sleep(sample)
    busy1, total1, own1 = *_cpu_jiffies(cpus), _own_jiffies()
    if total1 <= total0:
        return 0.0
    return max(0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * len(cpus)


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

