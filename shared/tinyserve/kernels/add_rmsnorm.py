"""Residual add followed by RMSNorm: ``h = x + residual; out = weight * rmsnorm(h)``.

Every decoder layer does this twice (before attention and before the MLP).
Eager PyTorch runs it as a chain of kernels, each writing a full-size tensor
that the next one reads back; the fused kernel reads ``x``, ``residual`` and
``weight`` once and writes ``out`` and the new residual once.

The normalisation is computed in fp32 and cast back, as Hugging Face's
``LlamaRMSNorm`` (and ``tinyserve.model.RMSNorm``) do.
"""

from __future__ import annotations

import torch

from tinyserve.kernels.triton_setup import HAS_TRITON, check_device, require_triton, tl, triton
# ``launch_config``: what the fused kernel launches with (``tinyserve.kernels.aot`` reads it here).
from tinyserve.kernels.triton_setup import row_launch_config as launch_config
from tinyserve.kernels.accounting import Step, check_variant, elem_size, split_rows


def add_rmsnorm_unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference, one kernel per line: returns ``(out, x + residual)``.

    The same operations, in the same order, as ``tinyserve.model.RMSNorm``
    applied to ``x + residual``, so the results match the model bit for bit.
    """
    h = x + residual                                   # add
    h32 = h.float()                                    # cast up (no-op for fp32)
    var = h32.pow(2).mean(-1, keepdim=True)            # square, mean
    normed = h32 * torch.rsqrt(var + eps)              # add eps, rsqrt, scale
    out = weight * normed.to(x.dtype)                  # cast down (no-op for fp32), weight
    return out, h


def add_rmsnorm_steps(variant: str, shape, dtype: torch.dtype = torch.float32,
                      weight_dtype: torch.dtype | None = None) -> list[Step]:
    """Bytes of each kernel for ``x`` of ``shape`` (any leading dims; the last is normalised)."""
    variant = check_variant(variant)
    m, n = split_rows(shape)
    e, f32 = elem_size(dtype), 4
    ew = elem_size(weight_dtype or dtype)
    e_out = elem_size(torch.promote_types(weight_dtype or dtype, dtype))
    mn = m * n
    if variant == "fused":
        return [Step("add_rmsnorm (fused)", read=2 * mn * e + n * ew, written=mn * e + mn * e_out)]
    steps = [Step("x + residual", 2 * mn * e, mn * e)]
    if dtype != torch.float32:
        steps.append(Step(".float()", mn * e, mn * f32))
    steps += [
        Step(".pow(2)", mn * f32, mn * f32),
        Step(".mean(-1)", mn * f32, m * f32),
        Step("+ eps", m * f32, m * f32),
        Step("rsqrt", m * f32, m * f32),
        Step("h * rstd", mn * f32 + m * f32, mn * f32),
    ]
    if dtype != torch.float32:
        steps.append(Step(".to(dtype)", mn * f32, mn * e))
    steps.append(Step("weight * y", n * ew + mn * e, mn * e_out))
    return steps


if HAS_TRITON:
    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
                            n_rows, n_cols, eps,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Each program normalises BLOCK_M whole rows; a row (padded to the power of
        # two BLOCK_N, the tail masked) sits in registers from load to store.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        offs = rows[:, None] * n_cols + cols[None, :]          # contiguous rows

        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        # Round the sum to the input dtype, like eager's `x + residual`.
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + offs, h, mask=mask)

        h32 = h.to(tl.float32)
        var = tl.sum(h32 * h32, axis=1) / n_cols                 # padding adds zeros
        rstd = 1.0 / tl.sqrt(var + eps)
        y = (h32 * rstd[:, None]).to(x.dtype)                    # cast back before the weight
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
        out = w[None, :].to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton kernel: ``(out, x + residual)`` in one pass over memory."""
    require_triton("add_rmsnorm_triton")
    if x.shape != residual.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)}, residual {tuple(residual.shape)} "
                         f"and weight {tuple(weight.shape)} do not fit")
    check_device("add_rmsnorm_triton", x, residual, weight)
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    r2 = residual.reshape(-1, n_cols).contiguous()
    n_rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_res = torch.empty_like(x2)
    if n_rows:
        meta = launch_config(n_rows, n_cols)
        grid = (triton.cdiv(n_rows, meta["BLOCK_M"]),)
        _add_rmsnorm_kernel[grid](x2, r2, weight.contiguous(), out, new_res, n_rows, n_cols, eps,
                                  **meta)
    return out.view(x.shape), new_res.view(x.shape)
