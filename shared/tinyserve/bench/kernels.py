"""Kernel benchmarks: ``python -m tinyserve.bench kernels [--out results.json]``.

Every kernel here is memory-bound, so each is reported as bandwidth: the bytes
its variant moves (from :func:`tinyserve.kernels.bytes_moved`) divided by its
median time, next to the bandwidth of a plain copy (``dst.copy_(src)``)
measured in the same run, which is about the best any kernel can do.

- CPU (no GPU): add + RMSNorm in bfloat16, eager unfused
  (``add_rmsnorm_unfused``) against the same function fused by
  ``torch.compile`` (inductor writes one C++ loop per row), once with all
  buffers reused between calls (the kernels alone) and once allocating
  results on every call (as a model does; see :func:`bench_cpu`). Triton's
  CPU interpreter is far too slow to time. Tensors are sized so the fused
  kernel touches ``--gib`` GiB (default 1), many times the last-level cache,
  so the bytes really come from DRAM.
- GPU: every op, eager torch against the fused Triton kernel, timed with
  ``triton.testing.do_bench`` (median), at sizes far past the L2 cache.

One table per run; ``--out`` also writes it as JSON with the machine, date and
torch/triton versions.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import statistics
from pathlib import Path

import torch

from tinyserve import kernels as K
from tinyserve.host import cpu_name, interleaved_times

GiB = 1 << 30
HIDDEN = 4096          # Llama-2-7B's hidden size
INTERMEDIATE = 11008   # and its MLP width
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- shared helpers ----------------------------------------------------------------------

def machine_info(device: str) -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1),
                    sm_count=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def versions() -> dict:
    out = {"torch": torch.__version__, "triton": None}
    if K.HAS_TRITON:
        import triton
        out["triton"] = triton.__version__
    return out


def row(op, variant, shape, dtype, nbytes, seconds, copy_gbps, baseline_s=None) -> dict:
    gbps = nbytes / seconds / 1e9
    return {"op": op, "variant": variant, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "bytes": nbytes, "median_ms": seconds * 1e3, "GBps": gbps,
            "frac_of_copy": gbps / copy_gbps,
            "speedup_vs_eager": None if baseline_s is None else baseline_s / seconds}


def print_table(title: str, copy_gbps: float, rows: list[dict]) -> None:
    print(title)
    print(f"copy bandwidth (dst.copy_(src), read + write): {copy_gbps:.1f} GB/s")
    head = f"{'op':<24}{'variant':<26}{'shape':<22}{'dtype':<9}{'MiB moved':>11}" \
           f"{'ms':>10}{'GB/s':>9}{'% copy':>8}{'speedup':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        speedup = "" if r["speedup_vs_eager"] is None else f"{r['speedup_vs_eager']:.2f}x"
        shape = "x".join(str(s) for s in r["shape"])
        print(f"{r['op']:<24}{r['variant']:<26}{shape:<22}{r['dtype']:<9}"
              f"{r['bytes'] / 2**20:>11.0f}{r['median_ms']:>10.2f}{r['GBps']:>9.1f}"
              f"{100 * r['frac_of_copy']:>7.0f}%{speedup:>9}")


# ---- CPU: eager vs torch.compile ---------------------------------------------------------

def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, timed in turn round after round
    (``host.interleaved_times``), so a burst of load from another process slows all
    of them rather than one."""
    for fn in fns.values():
        fn()                                  # warm-up
    return {name: statistics.median(ts) for name, ts in interleaved_times(fns, repeats).items()}


def _eager_into(x, residual, weight, eps, buf):
    """``add_rmsnorm_unfused``, step for step, into preallocated tensors ``buf``."""
    torch.add(x, residual, out=buf["h"])
    h32 = buf["h32"].copy_(buf["h"]) if "h32" in buf else buf["h"]
    torch.pow(h32, 2, out=buf["sq"])
    torch.mean(buf["sq"], -1, keepdim=True, out=buf["var"])
    torch.add(buf["var"], eps, out=buf["var_eps"])
    torch.rsqrt(buf["var_eps"], out=buf["rstd"])
    torch.mul(h32, buf["rstd"], out=buf["normed"])
    y = buf["y"].copy_(buf["normed"]) if "y" in buf else buf["normed"]
    torch.mul(weight, y, out=buf["out"])
    return buf["out"], buf["h"]


def _compiled_into(x, residual, weight, eps, out, new_residual):
    o, h = K.add_rmsnorm_unfused(x, residual, weight, eps)
    out.copy_(o)                 # inductor stores straight into the given tensors
    new_residual.copy_(h)


def bench_cpu(gib: float = 1.0, repeats: int = 5, hidden: int = HIDDEN,
              dtype: torch.dtype = torch.bfloat16, gemm_n: int = 0) -> tuple[float, list[dict]]:
    """add + RMSNorm, eager unfused against ``torch.compile``, two ways each.

    Rows are chosen so the fused variant moves ``gib`` GiB per call.

    - *reused buffers*: every output and intermediate is allocated once and
      rewritten on each call, so the time is the kernels' alone (on a GPU,
      PyTorch's caching allocator gives eager code this for free).
    - *allocating*: each call allocates its results, as a model's forward
      does. On a CPU a fresh large tensor comes straight from the OS, which
      maps and zeroes every page on first touch: one more write of each
      intermediate, plus a fault per 4 KiB page.

    The default dtype is bfloat16, as LLMs are served; its unfused chain
    also pays for the fp32 copies made to normalise in full precision.

    ``gemm_n`` > 0 adds three rows with reused buffers: the GEMM that reads the
    normalised rows (``[rows, hidden] @ [hidden, gemm_n]``, as the next layer's
    projection does) alone, then after the eager and after the compiled norm. Their
    ``flops`` say how much arithmetic sits next to the memory-bound norm.
    """
    shape, x, res, w = _cpu_inputs(gib, hidden, dtype)
    eps = 1e-5
    buf = _eager_buffers(x, w, shape, dtype)
    out, new_res = torch.empty_like(buf["out"]), torch.empty_like(x)
    compiled = torch.compile(K.add_rmsnorm_unfused, dynamic=False)
    compiled_into = torch.compile(_compiled_into, dynamic=False)
    _check_cpu_variants(x, res, w, eps, buf, compiled, compiled_into, out, new_res)

    src = torch.ones(int(gib * GiB) // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)               # touched, so no page faults inside the timing
    fns = {
        "copy": lambda: dst.copy_(src),
        "eager, reused buffers": lambda: _eager_into(x, res, w, eps, buf),
        "compile, reused buffers": lambda: compiled_into(x, res, w, eps, out, new_res),
        "eager, allocating": lambda: K.add_rmsnorm_unfused(x, res, w, eps),
        "compile, allocating": lambda: compiled(x, res, w, eps),
    }
    if gemm_n:
        proj_w = (torch.randn(hidden, gemm_n, generator=torch.Generator().manual_seed(1))
                  / math.sqrt(hidden)).to(dtype)
        proj = torch.empty(shape[0], gemm_n, dtype=dtype)
        fns.update({
            "GEMM alone": lambda: torch.matmul(out, proj_w, out=proj),
            "eager + GEMM": lambda: torch.matmul(_eager_into(x, res, w, eps, buf)[0], proj_w, out=proj),
            "compile + GEMM": lambda: (compiled_into(x, res, w, eps, out, new_res),
                                       torch.matmul(out, proj_w, out=proj)),
        })
    t = interleaved_medians(fns, repeats)
    copy_gbps = 2 * src.numel() * 4 / t["copy"] / 1e9
    rows = _cpu_rows(t, shape, dtype, copy_gbps)
    if gemm_n:
        rows += _gemm_rows(t, shape, dtype, gemm_n, copy_gbps)
    return copy_gbps, rows


def _cpu_inputs(gib: float, hidden: int, dtype: torch.dtype):
    """``(shape, x, residual, weight)``, seeded, with rows so the fused kernel moves ``gib`` GiB."""
    rows = max(1, round(gib * GiB / (4 * hidden * torch.empty((), dtype=dtype).element_size())))
    shape = (rows, hidden)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    return shape, x, res, w


def _eager_buffers(x, w, shape, dtype: torch.dtype) -> dict:
    """Every output and intermediate of ``_eager_into``, allocated once (fp32 where it normalises)."""
    rows = shape[0]
    f32 = torch.float32
    buf = {"h": torch.empty_like(x), "sq": torch.empty(shape, dtype=f32),
           "var": torch.empty(rows, 1, dtype=f32), "var_eps": torch.empty(rows, 1, dtype=f32),
           "rstd": torch.empty(rows, 1, dtype=f32), "normed": torch.empty(shape, dtype=f32),
           "out": torch.empty(shape, dtype=torch.promote_types(dtype, w.dtype))}
    if dtype != f32:
        buf.update(h32=torch.empty(shape, dtype=f32), y=torch.empty_like(x))
    return buf


def _check_cpu_variants(x, res, w, eps, buf, compiled, compiled_into, out, new_res) -> None:
    """Each variant against ``add_rmsnorm_unfused``: eager exactly, compiled within bf16 noise."""
    want = K.add_rmsnorm_unfused(x, res, w, eps)
    got = _eager_into(x, res, w, eps, buf)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for got in (compiled(x, res, w, eps),                            # compiles (once)
                (compiled_into(x, res, w, eps, out, new_res), out, new_res)[1:]):
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[1], want[1])


def _cpu_rows(t: dict, shape, dtype, copy_gbps: float) -> list[dict]:
    """The table's rows: eager then compiled, for reused buffers then allocating."""
    unfused = K.bytes_moved("add_rmsnorm", "unfused", shape, dtype)
    fused = K.bytes_moved("add_rmsnorm", "fused", shape, dtype)
    results = []
    for mode in ("reused buffers", "allocating"):
        base = t[f"eager, {mode}"]
        results.append(row("add_rmsnorm", f"eager, {mode}", shape, dtype, unfused, base,
                           copy_gbps, base))
        results.append(row("add_rmsnorm", f"compile, {mode}", shape, dtype, fused,
                           t[f"compile, {mode}"], copy_gbps, base))
    return results


def _gemm_rows(t: dict, shape, dtype, gemm_n: int, copy_gbps: float) -> list[dict]:
    """The GEMM after the norm: alone, then after each norm; bytes and FLOPs of what each moves and does."""
    rows_, hidden = shape
    size = torch.empty((), dtype=dtype).element_size()
    gemm_bytes = (rows_ * hidden + hidden * gemm_n + rows_ * gemm_n) * size
    flops = 2 * rows_ * hidden * gemm_n
    gemm_shape = (rows_, hidden, gemm_n)
    alone = row("gemm", "GEMM alone", gemm_shape, dtype, gemm_bytes, t["GEMM alone"], copy_gbps)
    eager = row("add_rmsnorm + gemm", "eager + GEMM", gemm_shape, dtype,
                K.bytes_moved("add_rmsnorm", "unfused", shape, dtype) + gemm_bytes,
                t["eager + GEMM"], copy_gbps, t["eager + GEMM"])
    fused = row("add_rmsnorm + gemm", "compile + GEMM", gemm_shape, dtype,
                K.bytes_moved("add_rmsnorm", "fused", shape, dtype) + gemm_bytes,
                t["compile + GEMM"], copy_gbps, t["eager + GEMM"])
    for r in (alone, eager, fused):
        r["flops"] = flops
    return [alone, eager, fused]


# ---- GPU: eager torch vs Triton ----------------------------------------------------------

def gpu_time(fn) -> float:
    """Median seconds of ``fn()`` by ``triton.testing.do_bench`` (which flushes L2)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def gpu_copy_bandwidth(nbytes: int = GiB, device: str = "cuda", timer=gpu_time) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / timer(lambda: dst.copy_(src)) / 1e9


def _check(got, want):
    if isinstance(got, tuple):
        for g, w in zip(got, want):
            _check(g, w)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def bench_gpu(dtype: torch.dtype = torch.float16, tokens: int = 32768, batch: int = 16,
              contexts=(2048, 8192, 32768), device: str = "cuda", timer=gpu_time,
              copy_bytes: int = GiB) -> tuple[float, list[dict]]:
    """Every op, eager torch vs fused Triton, at 7B/8B-model widths.

    ``tokens`` rows for add_rmsnorm and softmax ([tokens, 4096]: 256 MiB per
    fp16 tensor, several times an H200's L2) and half as many for silu_mul
    ([tokens / 2, 11008]); decode attention for ``batch`` requests at each
    context length in ``contexts``. Each fused result is checked against eager
    before it is timed. (``device`` and ``timer`` let the tests run this on CPU.)
    """
    gen = torch.Generator(device=device).manual_seed(0)
    copy_gbps = gpu_copy_bandwidth(copy_bytes, device, timer)
    bench = _GpuBench(dtype, device, timer, gen, copy_gbps)
    results = []
    results += bench.add_rmsnorm(tokens)
    results += bench.silu_mul(tokens)
    results += bench.softmax(tokens)
    for ctx in contexts:
        results += bench.paged_decode_attention(batch, ctx)
    return copy_gbps, results


class _GpuBench:
    """One ``bench_gpu`` run: its seeded generator, its timer, and the copy bandwidth
    every row is compared with. Each op method makes its inputs, checks and times
    eager against fused, and returns the two rows; its tensors are freed on return."""

    def __init__(self, dtype: torch.dtype, device: str, timer, gen: torch.Generator,
                 copy_gbps: float):
        self.dtype, self.device, self.timer, self.gen = dtype, device, timer, gen
        self.copy_gbps = copy_gbps

    def randn(self, *shape):
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def pair(self, op, shape, eager, fused, count, label="triton (fused)") -> list[dict]:
        """Check ``fused()`` against ``eager()``, time both, return their two rows."""
        dtype, copy_gbps = self.dtype, self.copy_gbps
        _check(fused(), eager())
        t_eager, t_fused = self.timer(eager), self.timer(fused)
        return [row(op, "eager torch", shape, dtype, K.bytes_moved(op, "unfused", **count),
                    t_eager, copy_gbps, t_eager),
                row(op, label, shape, dtype, K.bytes_moved(op, "fused", **count),
                    t_fused, copy_gbps, t_eager)]

    def add_rmsnorm(self, tokens: int) -> list[dict]:
        shape = (tokens, HIDDEN)
        x, res, w = self.randn(*shape), self.randn(*shape), self.randn(HIDDEN)
        return self.pair("add_rmsnorm", shape, lambda: K.add_rmsnorm_unfused(x, res, w, 1e-5),
                         lambda: K.add_rmsnorm_triton(x, res, w, 1e-5),
                         dict(shape=shape, dtype=self.dtype))

    def silu_mul(self, tokens: int) -> list[dict]:
        shape = (tokens // 2, INTERMEDIATE)
        gate, up = self.randn(*shape), self.randn(*shape)
        return self.pair("silu_mul", shape, lambda: K.silu_mul_unfused(gate, up),
                         lambda: K.silu_mul_triton(gate, up), dict(shape=shape, dtype=self.dtype))

    def softmax(self, tokens: int) -> list[dict]:
        shape = (tokens, HIDDEN)
        logits = self.randn(*shape)
        return self.pair("softmax", shape, lambda: K.softmax_unfused(logits),
                         lambda: K.softmax_triton(logits), dict(shape=shape, dtype=self.dtype))

    def paged_decode_attention(self, batch: int, ctx: int) -> list[dict]:
        """Decode attention for ``batch`` requests of ``ctx`` tokens, their KV blocks scattered."""
        # Llama-3-8B-like attention: 32 query heads share 8 KV heads of 128 dims.
        hq, hkv, d, block_size = 32, 8, 128, 16
        device, randn = self.device, self.randn
        blocks_per_seq = math.ceil(ctx / block_size)
        num_blocks = batch * blocks_per_seq
        k_cache = randn(num_blocks, block_size, hkv, d)
        v_cache = randn(num_blocks, block_size, hkv, d)
        tables = torch.randperm(num_blocks, device=device, generator=self.gen)
        tables = tables.view(batch, blocks_per_seq).to(torch.int32)     # blocks scattered
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = randn(batch, hq, d)
        args = (q, k_cache, v_cache, tables, lens, 1 / math.sqrt(d))
        splits = K.choose_num_splits(batch, hkv, blocks_per_seq * block_size)
        rows = self.pair("paged_decode_attention", (batch, hq, hkv, d, ctx),
                         lambda: K.paged_decode_attention_torch(*args),
                         lambda: K.paged_decode_attention_triton(*args),
                         dict(context_lens=[ctx] * batch, num_heads=hq, num_kv_heads=hkv,
                              head_dim=d, dtype=self.dtype, block_size=block_size,
                              num_splits=splits),
                         label=f"triton ({splits} split{'s' if splits > 1 else ''})")
        del k_cache, v_cache, args
        if device == "cuda":
            torch.cuda.empty_cache()
        return rows


# ---- command line ------------------------------------------------------------------------

def kernels_main(args) -> dict:
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        if not K.HAS_TRITON:
            raise SystemExit("bench kernels: the GPU benchmark needs Triton (pip install triton)")
        copy_gbps, results = bench_gpu()
        title = f"Fused Triton kernels vs eager torch on {torch.cuda.get_device_name(0)}"
        notes = "shapes: add_rmsnorm/softmax [tokens, hidden]; silu_mul [tokens, intermediate]; " \
                "paged_decode_attention [batch, Hq, Hkv, head_dim, context]"
    else:
        load = os.getloadavg()
        copy_gbps, results = bench_cpu(args.gib, args.repeats, dtype=DTYPES[args.dtype])
        title = (f"add + RMSNorm on CPU ({cpu_name()}, {torch.get_num_threads()} threads): "
                 f"eager unfused vs torch.compile (inductor)")
        by = {r["variant"]: r for r in results}
        kernels, alloc = by["compile, reused buffers"], by["compile, allocating"]
        notes = (f"torch.compile vs eager: {kernels['speedup_vs_eager']:.2f}x with reused buffers "
                 f"(fused at {100 * kernels['frac_of_copy']:.0f}% of copy bandwidth), "
                 f"{alloc['speedup_vs_eager']:.2f}x when every call allocates\n"
                 f"fused working set {args.gib:g} GiB; load average at start "
                 f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    print_table(title, copy_gbps, results)
    print(notes)
    report = {"benchmark": "kernels", "device": device, "machine": machine_info(device),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              **versions(), "copy_GBps": copy_gbps, "notes": notes, "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return report
