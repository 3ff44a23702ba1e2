"""The SwiGLU activation of the MLP: ``silu(gate) * up``.

Eager PyTorch runs two kernels (``F.silu``, then ``*``) and writes ``silu(gate)``
out in between; the fused kernel reads ``gate`` and ``up`` once and writes the
product once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels.triton_setup import (HAS_TRITON, check_device, interpreting,
                                             require_triton, tl, triton)
from tinyserve.kernels.accounting import Step, check_variant, elem_size


def silu_mul_unfused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Eager reference: two kernels, as ``tinyserve.model.MLP`` runs it."""
    return F.silu(gate) * up


def silu_mul_steps(variant: str, shape, dtype: torch.dtype = torch.float32) -> list[Step]:
    """Bytes of each kernel for ``gate`` and ``up`` of ``shape``."""
    variant = check_variant(variant)
    t = 1
    for s in shape:
        t *= int(s)
    e = elem_size(dtype)
    if variant == "fused":
        return [Step("silu_mul (fused)", 2 * t * e, t * e)]
    return [Step("silu(gate)", t * e, t * e), Step("* up", 2 * t * e, t * e)]


if HAS_TRITON:
    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        silu = g / (1.0 + tl.exp(-g))            # g * sigmoid(g), kept in registers
        tl.store(out_ptr + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(n: int, interpret: bool | None = None) -> dict:
    """Constexprs and ``num_warps`` :func:`silu_mul_triton` launches with
    (``interpret=False``: what it picks on a CUDA device; checked by ``tinyserve.kernels.aot``)."""
    interpret = interpreting() if interpret is None else interpret
    return dict(BLOCK=1 << 16 if interpret else 2048, num_warps=8)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused Triton kernel: ``silu(gate) * up`` in one pass (computed in fp32)."""
    require_triton("silu_mul_triton")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} must match")
    check_device("silu_mul_triton", gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        meta = launch_config(n)
        _silu_mul_kernel[(triton.cdiv(n, meta["BLOCK"]),)](gate, up, out, n, **meta)
    return out
