"""Checks for lab 02 (fused add + RMSNorm in Triton).

Lab 02 asks for three pieces:

* ``fused_bytes(shape, dtype) -> int``: bytes the fused kernel reads and writes.
* ``add_rmsnorm_kernel[(n_rows,)](x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
  n_cols, eps, BLOCK_N=...)``: one program per row of contiguous [n_rows, n_cols]
  tensors; ``new_res = x + res``, ``out = w * rmsnorm(new_res)`` normalised in fp32.
  ``BLOCK_N`` is a tile width, a power of two that may be narrower than the row:
  the kernel walks the row tile by tile, twice (sum of squares, then normalise),
  so a row of any width fits in registers. Notebook 02's kernel holds the whole
  row in one tile; the checks launch with tiles narrower than the row.
* ``add_rmsnorm(x, residual, weight, eps) -> (out, new_residual)``: the launcher.

The kernel is launched by the check itself, on tensors followed by a guard
region, so a load or store past the end of a row shows up as a wrong value
or a changed guard instead of silently corrupting memory. Without a GPU it
runs in Triton's interpreter (about a millisecond per program): small shapes.
"""

from __future__ import annotations

from tinyserve.labs.hints import NOT_WRITTEN, call, fail

__all__ = ["check_fused_bytes", "check_add_rmsnorm_kernel", "check_add_rmsnorm"]

_GUARD = 256                  # elements after each tensor (> any BLOCK_N here)
_SENTINEL = -1234.0           # what out and new_residual hold where the kernel did not write
MAX_TILE = 1024               # the launcher's widest tile: 8 elements per thread at 4 warps


def _kernel_device() -> str:
    from tinyserve import kernels as K
    return "cpu" if K.interpreting() else "cuda"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_fused_bytes(fused_bytes):
    """Check ``fused_bytes(shape, dtype) -> int`` against ``kernels.bytes_moved(..., "fused", ...)``."""
    import math

    import torch

    from tinyserve import kernels as K

    cases = [((4, 8), torch.float32), ((37, 781), torch.float16), ((2, 5, 300), torch.float32),
             ((32, 4096), torch.float16), ((2048, 4096), torch.bfloat16)]
    for shape, dtype in cases:
        want = K.bytes_moved("add_rmsnorm", "fused", shape, dtype)
        got = fused_bytes(shape, dtype)
        if not isinstance(got, int) or isinstance(got, bool):
            try:
                got = int(got) if float(got) == int(got) else got
            except (TypeError, ValueError):
                pass
        if got == want:
            continue
        e = torch.empty((), dtype=dtype).element_size()
        m, n = math.prod(shape[:-1]), shape[-1]
        mn = m * n
        where = (f"shape={shape}, dtype={_dtype_name(dtype)}：", f"shape={shape}, dtype={_dtype_name(dtype)}: ")
        hints = [
            (4 * mn + n, "你数的是元素个数，不是字节：乘上每个元素的字节数 dtype 的 element_size()",
             "you counted elements, not bytes: multiply by the element size of dtype"),
            (2 * mn * e + n * e, "只数了读，没数写：融合 kernel 还要写出 out 和 new_residual 两个张量",
             "you counted the reads only: the fused kernel also writes out and new_residual"),
            (2 * mn * e, "只数了写，没数读：它要读 x、residual（各 m×n 个元素）和 weight（n 个元素）",
             "you counted the writes only: it also reads x and residual (m×n elements each) and weight (n)"),
            (4 * mn * e, "漏了 weight：每次调用都要读一次 weight（n 个元素，只算一次）",
             "weight is missing: each call reads weight once (n elements, counted once)"),
            (4 * mn * e + mn * e, "weight 按行重复算了：它只有 n 个元素，读一次（之后在缓存里）",
             "weight counted once per row: it has n elements and is read once (then cached)"),
            (3 * mn * e + n * e, "漏了一个写：融合 kernel 写出两个张量，out 和 new_residual = x + residual",
             "one write is missing: the fused kernel writes two tensors, out and new_residual = x + residual"),
            (4 * mn * 4 + n * 4, "按 fp32 数了字节：字节数取决于 dtype（fp16/bf16 每个元素 2 字节）",
             "you counted fp32 bytes: the size depends on dtype (2 bytes per element in fp16/bf16)"),
        ]
        for value, zh, en in hints:
            if got == value and value != want:
                fail(f"你的结果 {got}，应为 {want}。{zh}", f"got {got}, expected {want}. {en}", where)
        fail(f"你的结果 {got}，应为 {want}（读 x、residual 各 m×n 个元素和 weight 的 n 个，"
             "写 out、new_residual 各 m×n 个；乘以每个元素的字节数）",
             f"got {got}, expected {want} (read m×n elements of x and of residual plus n of weight; "
             "write m×n of out and of new_residual; times the bytes per element)", where)
    print("✓ fused_bytes 通过：与 kernels.bytes_moved('add_rmsnorm', 'fused', ...) 一致 "
          "/ fused_bytes matches kernels.bytes_moved('add_rmsnorm', 'fused', ...)")


def _guarded(values, device, fill):
    """A contiguous tensor with ``values`` followed by ``_GUARD`` elements of ``fill``; (view, buffer)."""
    import torch
    buf = torch.full((values.numel() + _GUARD,), fill, dtype=values.dtype, device=device)
    view = buf[:values.numel()].view(values.shape)
    view.copy_(values)
    return view, buf


def _rms_f64(h, weight, eps, *, divisor=None, eps_mode="inside"):
    """out = weight * h / rms(h), in float64, with an optional mistake (to name the student's)."""
    import torch
    h = h.double()
    n = h.shape[-1] if divisor is None else divisor
    var = (h * h).sum(-1, keepdim=True) / n
    if eps_mode == "inside":
        normed = h * torch.rsqrt(var + eps)
    elif eps_mode == "outside":
        normed = h / (var.sqrt() + eps)
    else:
        normed = h * torch.rsqrt(var)
    return normed * (weight.double() if weight is not None else 1.0)


def _kernel_cases():
    import torch
    return [
        # name, rows, cols, BLOCK_N (the tile width), dtype, scale, eps
        ("one tile, power-of-two width", 4, 64, 64, torch.float32, 1.0, 1e-5),
        ("one padded tile, irregular width", 5, 100, 128, torch.float32, 1.0, 1e-5),
        ("irregular width, 7 tiles", 37, 781, 128, torch.float32, 1.0, 1e-5),
        ("tiny values (eps matters)", 6, 100, 32, torch.float32, 1e-3, 1e-5),
        ("fp16", 19, 300, 64, torch.float16, 1.0, 1e-5),
        ("fp16, large values", 8, 1000, 256, torch.float16, 16.0, 1e-6),
    ]


def _rms_per_tile_f64(h, weight, eps, block_n):
    """The mistake of normalising each tile by its own sum of squares (over the row's width)."""
    import torch
    tiles = [_rms_f64(t, None, eps, divisor=h.shape[-1]) for t in torch.split(h.double(), block_n, dim=-1)]
    return torch.cat(tiles, dim=-1) * weight.double()


_TOL = {"torch.float32": dict(atol=1e-5, rtol=1e-5), "torch.float16": dict(atol=1e-2, rtol=1e-2)}


def _close(a, b, dtype) -> bool:
    import torch
    tol = _TOL[str(dtype)]
    a, b = a.double().cpu(), b.double().cpu()
    return bool(torch.isfinite(a).all()) and bool(torch.allclose(a, b, **tol))


def _run_student_kernel(kernel, x, res, w, eps, device, block_n):
    import torch
    m, n = x.shape
    sentinel = _SENTINEL
    xv, _ = _guarded(x, device, float("nan"))
    rv, _ = _guarded(res, device, float("nan"))
    wv, _ = _guarded(w, device, float("nan"))
    out, out_buf = _guarded(torch.full_like(x, sentinel), device, sentinel)
    new_res, res_buf = _guarded(torch.full_like(x, sentinel), device, sentinel)
    # The interpreter wraps what the kernel raised: a stub shows up in the error's text.
    call(lambda: kernel[(m,)](xv, rv, wv, out, new_res, n, eps, BLOCK_N=block_n),
         "add_rmsnorm_kernel", let_through=(NotImplementedError,), explain=_launch_failed,
         stub="add_rmsnorm_kernel 还没有写 / add_rmsnorm_kernel is not written yet")
    if device == "cuda":
        torch.cuda.synchronize()
    guards_ok = bool((out_buf[m * n:] == sentinel).all()) and bool((res_buf[m * n:] == sentinel).all())
    return out.cpu(), new_res.cpu(), guards_ok


def _launch_failed(name, error):
    text = f"{type(error).__name__}: {error}"
    return (f"启动 kernel 时出错（{text}）。kernel 的参数应为 (x_ptr, res_ptr, w_ptr, out_ptr, "
            f"new_res_ptr, n_cols, eps, BLOCK_N)，每个程序处理一行，BLOCK_N 是块宽",
            f"launching the kernel failed ({text}). Its parameters must be (x_ptr, res_ptr, "
            f"w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK_N), one program per row, BLOCK_N the tile width")


def _diagnose_out(got, x, res, w, eps, n, block_n, dtype, case):
    """Raise with the most likely mistake behind a wrong ``out``."""
    import torch
    h = x.double() + res.double()
    candidates = [
        (_rms_f64(x, w, eps), "只对 x 做了归一化，忘了先加 residual：应归一化 h = x + residual",
         "you normalised x alone: normalise h = x + residual"),
        (_rms_f64(h, None, eps), "忘了乘 weight：out = weight * h / rms(h)",
         "weight is missing: out = weight * h / rms(h)"),
        (_rms_f64(h, w, eps, eps_mode="outside"), "eps 放错了位置：应是 1 / sqrt(mean(h²) + eps)，"
         "而不是 1 / (sqrt(mean(h²)) + eps)", "eps is in the wrong place: use 1 / sqrt(mean(h²) + eps), "
         "not 1 / (sqrt(mean(h²)) + eps)"),
        (_rms_f64(h, w, eps, eps_mode="none"), "忘了 eps：应是 1 / sqrt(mean(h²) + eps)",
         "eps is missing: use 1 / sqrt(mean(h²) + eps)"),
        (_rms_f64(h, w, eps, divisor=1), "求的是平方和，不是平均：除以 n_cols",
         "you took the sum of squares, not the mean: divide by n_cols"),
    ]
    if block_n < n:
        candidates.append((_rms_per_tile_f64(h, w, eps, block_n),
                           "每一块各自算了 rstd：第一遍要把整行所有块的平方和加起来，第二遍每一块都用同一个 rstd",
                           "each tile got its own rstd: the first pass adds up the squares of every tile of "
                           "the row, and the second pass uses that one rstd for every tile"))
    if block_n != n:
        candidates.append((_rms_f64(h, w, eps, divisor=block_n),
                           f"平均值除以了 BLOCK_N={block_n}，应除以真实宽度 n_cols={n}（补齐的位置是 0，不算数）",
                           f"the mean divides by BLOCK_N={block_n}: divide by the real width n_cols={n} "
                           "(the padded lanes are zeros and do not count)"))
    for cand, zh, en in candidates:
        if _close(got, cand, dtype):
            fail(f"[{case}] out 不对：{zh}", f"[{case}] out is wrong: {en}")
    if dtype == torch.float16:                 # every fp32 case (irregular widths too) passed before
        fail(f"[{case}] fp32 的用例都通过了，fp16 的没有：平方和在 fp16 里溢出了（最大约 65504）或丢了精度。"
             "先用 .to(tl.float32) 把 h 转成 fp32，再平方、求和、开方；存回时再转回",
             f"[{case}] the fp32 cases pass but fp16 does not: the sum of squares overflowed fp16 (max about 65504) "
             "or lost precision. Convert h with .to(tl.float32) before squaring, summing and taking the root; "
             "cast back on store")
    if n % block_n and not bool(torch.isfinite(got.double()).all()):
        fail(f"[{case}] out 里出现了 nan：宽度 {n} 不是块宽 {block_n} 的整数倍，最后一块读到了行尾之外。"
             f"tl.load 要带 mask=cols < n_cols 和 other=0.0",
             f"[{case}] out has nan: width {n} is not a multiple of the tile width {block_n} and the last "
             "tile read past the row. Give tl.load mask=cols < n_cols and other=0.0")
    want = _rms_f64(h, w, eps)
    err = (got.double() - want).abs().max().item()
    fail(f"[{case}] out 与 float64 参考值最大相差 {err:.3g}（容差 {_TOL[str(dtype)]}）。"
         "检查：h = x + residual 转成 fp32，var = sum(h*h) / n_cols，rstd = 1/sqrt(var + eps)，"
         "out = weight * h * rstd，带 mask 存回",
         f"[{case}] out differs from the float64 reference by up to {err:.3g} (tolerance {_TOL[str(dtype)]}). "
         "Check: h = x + residual in fp32, var = sum(h*h) / n_cols, rstd = 1/sqrt(var + eps), "
         "out = weight * h * rstd, stored with the mask")


def check_add_rmsnorm_kernel(kernel):
    """Launch the student's ``add_rmsnorm_kernel[(n_rows,)](...)`` on irregular shapes, fp32 and
    fp16, with tiles as wide as the row and narrower than it."""
    import torch

    device = _kernel_device()
    gen = torch.Generator().manual_seed(2)
    passed = []
    for case, m, n, block_n, dtype, scale, eps in _kernel_cases():
        x = (torch.randn(m, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
        res = (torch.randn(m, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
        w = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
        out, new_res, guards_ok = _run_student_kernel(kernel, x, res, w, eps, device, block_n)
        h = x.double() + res.double()
        _check_written(case, n, block_n, out, new_res, guards_ok)
        if not _close(new_res, h, dtype):
            _diagnose_new_res(case, n, block_n, new_res, x, out, dtype)
        if not _close(out, _rms_f64(h, w, eps), dtype):
            _diagnose_out(out, x, res, w, eps, n, block_n, dtype, case)
        passed.append((case, m, n, dtype))
    shapes = ", ".join(f"{m}×{n} {_dtype_name(d)}" for _, m, n, d in passed)
    print(f"✓ add_rmsnorm_kernel 通过：{len(passed)} 组形状（{shapes}），整行一块和一行多块都与 float64 参考值一致，"
          f"没有越界读写 / add_rmsnorm_kernel matches float64 on every shape, with one tile per row and "
          f"with several, and no access past the rows")
    _report_bytes()


def _check_written(case, n, block_n, out, new_res, guards_ok):
    """Raise when the kernel wrote past the tensors, or left part of a row unwritten."""
    if not guards_ok:
        fail(f"[{case}] kernel 写到了张量末尾之外：宽度 {n} 的最后一块超出了行尾，tl.store 要带 mask=cols < n_cols",
             f"[{case}] the kernel wrote past the end of the tensor: the last tile of a row of width {n} "
             "runs past it; give tl.store mask=cols < n_cols")
    unwritten = (out == _SENTINEL) | (new_res == _SENTINEL)
    if block_n < n and bool(unwritten[:, block_n:].all()) and not bool(unwritten[:, :block_n].any()):
        fail(f"[{case}] 只写了每行的前 {block_n} 个元素：这一行有 {n} 个，比块宽 BLOCK_N={block_n} 宽。"
             "用循环 for start in range(0, n_cols, BLOCK_N) 一块一块地处理整行（笔记本 02 的 kernel 假设一块装得下整行）",
             f"[{case}] only the first {block_n} elements of each row were written: the row has {n}, more than "
             f"the tile width BLOCK_N={block_n}. Loop for start in range(0, n_cols, BLOCK_N) over the tiles of "
             "the row (notebook 02's kernel assumes one tile holds the whole row)")
    if bool((new_res == _SENTINEL).all()):
        fail(f"[{case}] new_residual 没有被写：用 tl.store(new_res_ptr + offs, h, mask=mask) 存下 x + residual",
             f"[{case}] new_residual was never written: tl.store(new_res_ptr + offs, h, mask=mask) the sum x + residual")
    if bool((out == _SENTINEL).any()):
        rows = sorted({int(r) for r in (out == _SENTINEL).nonzero()[:, 0]})
        fail(f"[{case}] out 有没写到的位置（第 {rows[:5]} 行）：每个程序处理一行 row = tl.program_id(0)，"
             "这一行的每一块都要存",
             f"[{case}] some of out was never written (rows {rows[:5]}): each program handles row = "
             "tl.program_id(0) and stores every tile of it")


def _diagnose_new_res(case, n, block_n, new_res, x, out, dtype):
    import torch
    if _close(new_res, x, dtype):
        hint = ("new_residual 存成了 x，应是 x + residual", "new_residual holds x; it must be x + residual")
    elif _close(new_res, out, dtype):
        hint = ("new_residual 存成了归一化后的结果，应是归一化之前的和 x + residual",
                "new_residual holds the normalised output; it must be the sum x + residual, before normalising")
    elif n % block_n and not bool(torch.isfinite(new_res.double()).all()):
        hint = (f"宽度 {n} 不是块宽 {block_n} 的整数倍，最后一块读到了行尾之外：tl.load 要带 mask=cols < n_cols 和 other=0.0",
                f"width {n} is not a multiple of the tile width {block_n} and the last tile read past the row: "
                "give tl.load mask=cols < n_cols and other=0.0")
    else:
        hint = ("new_residual 应是 x + residual（每行的每个有效位置都要存）",
                "new_residual must be x + residual (stored at every valid position of every row)")
    fail(f"[{case}] {hint[0]}", f"[{case}] {hint[1]}")


def _report_bytes():
    import torch

    from tinyserve import kernels as K
    print("省下的字节 / bytes saved (7B model, hidden 4096, fp16):")
    for label, shape in (("decode batch 32", (32, 4096)), ("prefill chunk 2048", (2048, 4096))):
        unfused = K.bytes_moved("add_rmsnorm", "unfused", shape, torch.float16)
        fused = K.bytes_moved("add_rmsnorm", "fused", shape, torch.float16)
        print(f"  {label:<19} unfused {unfused / 2**20:7.2f} MiB -> fused {fused / 2**20:6.2f} MiB: "
              f"{(unfused - fused) / 2**20:7.2f} MiB saved per call, {unfused / fused:.2f}x fewer bytes")


def check_add_rmsnorm(add_rmsnorm):
    """Check the launcher ``add_rmsnorm(x, residual, weight, eps) -> (out, new_residual)``
    on leading dims and irregular widths against ``tinyserve.kernels.add_rmsnorm_triton``."""
    import torch

    from tinyserve import kernels as K

    device = _kernel_device()
    gen = torch.Generator().manual_seed(3)
    cases = [((3, 5, 50), torch.float32), ((2, 129), torch.float16), ((1, 1, 1000), torch.float32),
             ((3, 2500), torch.float32)]   # wider than MAX_TILE: several tiles per row
    for shape, dtype in cases:
        x = torch.randn(shape, generator=gen).to(dtype).to(device)
        res = torch.randn(shape, generator=gen).to(dtype).to(device)
        w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
        got = call(add_rmsnorm, "add_rmsnorm", x, res, w, 1e-5, where=(f"shape={shape}: ",) * 2,
                   let_through=(NotImplementedError,), stub=NOT_WRITTEN)
        where = f"shape={shape}, {_dtype_name(dtype)}"
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(f"{where}：add_rmsnorm 应返回 (out, new_residual) 两个张量", f"{where}: add_rmsnorm must return (out, new_residual)")
        out, new_res = got
        want_out, want_res = K.add_rmsnorm_triton(x, res, w, 1e-5)
        for name, t in (("out", out), ("new_residual", new_res)):
            if tuple(t.shape) != tuple(shape):
                fail(f"{where}：{name} 的形状是 {tuple(t.shape)}，应与 x 相同：算完后 .view(x.shape) 变回去",
                     f"{where}: {name} has shape {tuple(t.shape)}; it must have x's shape: .view(x.shape) at the end")
        tol = _TOL[str(dtype)]
        if _close(out, want_res, dtype) and _close(new_res, want_out, dtype):
            fail(f"{where}：返回顺序反了，应为 (out, new_residual)", f"{where}: swapped results; return (out, new_residual)")
        if not (torch.allclose(new_res.double().cpu(), want_res.double().cpu(), **tol)
                and torch.allclose(out.double().cpu(), want_out.double().cpu(), **tol)):
            fail(f"{where}：结果与 tinyserve.kernels.add_rmsnorm_triton 不同。网格应为 (n_rows,)，"
                 f"n_rows 是去掉最后一维后所有维的乘积；BLOCK_N = min(triton.next_power_of_2(n_cols), {MAX_TILE})；"
                 "先 reshape(-1, n_cols).contiguous()",
                 f"{where}: differs from tinyserve.kernels.add_rmsnorm_triton. The grid must be (n_rows,), "
                 f"n_rows the product of all but the last dim; BLOCK_N = min(triton.next_power_of_2(n_cols), {MAX_TILE}); "
                 "reshape(-1, n_cols).contiguous() first")
    print("✓ add_rmsnorm 通过：任意前导维度、非 2 的幂宽度，与 tinyserve.kernels.add_rmsnorm_triton 一致 "
          "/ add_rmsnorm matches tinyserve.kernels.add_rmsnorm_triton on leading dims and irregular widths")
