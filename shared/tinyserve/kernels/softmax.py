"""Softmax over the last dimension.

The unfused reference spells the five steps out as separate eager kernels
(max, subtract, exp, sum, divide), each writing its result to memory; the fused
kernel keeps a whole row in registers and reads and writes it once. (PyTorch's
own ``torch.softmax`` is already one fused kernel; the unfused chain shows what
it saves.)
"""

from __future__ import annotations

import torch

from tinyserve.kernels.triton_setup import HAS_TRITON, check_device, require_triton, tl, triton
# ``launch_config``: what the fused kernel launches with (``tinyserve.kernels.aot`` reads it here).
from tinyserve.kernels.triton_setup import row_launch_config as launch_config
from tinyserve.kernels.accounting import Step, check_variant, elem_size, split_rows

# A row must fit in one program's registers (the fused kernel does not loop).
MAX_SOFTMAX_COLS = 1 << 16


def softmax_unfused(x: torch.Tensor) -> torch.Tensor:
    """Eager reference: five kernels, five full-size tensors written out."""
    row_max = x.amax(dim=-1, keepdim=True)
    shifted = x - row_max
    exps = torch.exp(shifted)
    total = exps.sum(dim=-1, keepdim=True)
    return exps / total


def softmax_steps(variant: str, shape, dtype: torch.dtype = torch.float32) -> list[Step]:
    """Bytes of each kernel for ``x`` of ``shape`` (softmax over the last dim)."""
    variant = check_variant(variant)
    m, n = split_rows(shape)
    e, mn = elem_size(dtype), m * n
    if variant == "fused":
        return [Step("softmax (fused)", mn * e, mn * e)]
    return [
        Step("amax", mn * e, m * e),
        Step("x - max", mn * e + m * e, mn * e),
        Step("exp", mn * e, mn * e),
        Step("sum", mn * e, m * e),
        Step("/ sum", mn * e + m * e, mn * e),
    ]


if HAS_TRITON:
    @triton.jit
    def _softmax_kernel(x_ptr, out_ptr, n_rows, n_cols,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offs = rows[:, None] * n_cols + cols[None, :]
        # Padding loads -inf, so it neither wins the max nor adds to the sum.
        x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        x = tl.where(rows[:, None] < n_rows, x, 0.0)      # padding rows: harmless zeros
        x = x - tl.max(x, axis=1)[:, None]
        num = tl.exp(x)
        out = num / tl.sum(num, axis=1)[:, None]
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def softmax_triton(x: torch.Tensor) -> torch.Tensor:
    """Fused Triton kernel: softmax over the last dim, one read and one write."""
    require_triton("softmax_triton")
    check_device("softmax_triton", x)
    n_cols = x.shape[-1]
    if n_cols > MAX_SOFTMAX_COLS:
        raise ValueError(f"softmax_triton: rows of {n_cols} > {MAX_SOFTMAX_COLS} columns "
                         "do not fit in one program")
    x2 = x.reshape(-1, n_cols).contiguous()
    n_rows = x2.shape[0]
    out = torch.empty_like(x2)
    if n_rows and n_cols:
        meta = launch_config(n_rows, n_cols)
        _softmax_kernel[(triton.cdiv(n_rows, meta["BLOCK_M"]),)](x2, out, n_rows, n_cols, **meta)
    return out.view(x.shape)
