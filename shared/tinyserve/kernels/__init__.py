"""Unfused torch references and fused Triton kernels, each with its byte count.

For every op there is an eager reference that runs the way PyTorch does
(one kernel per step, every intermediate written to memory and read back) and
a fused Triton kernel that keeps the intermediates in registers:

- ``add_rmsnorm_unfused(x, residual, weight, eps)`` / ``add_rmsnorm_triton(...)``
  -> ``(out, x + residual)``, ``out = weight * rmsnorm(x + residual)``
- ``silu_mul_unfused(gate, up)`` / ``silu_mul_triton(gate, up)`` -> ``silu(gate) * up``
- ``softmax_unfused(x)`` / ``softmax_triton(x)`` -> softmax over the last dim
- ``paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)``
  / ``paged_decode_attention_triton(...)`` -> ``[B, Hq, D]`` (layouts in
  :mod:`tinyserve.kernels.paged_attention`)

Byte accounting: ``steps(op, variant, ...)`` lists each kernel launch of a
variant (``"unfused"`` or ``"fused"``; ``"torch"``/``"triton"`` also accepted)
with the bytes it reads and writes; ``bytes_moved(op, variant, ...)`` is their
sum. The remaining arguments describe the tensors, not the tensors
themselves, so 7B-size shapes cost nothing to count:

- ``add_rmsnorm``: ``shape, dtype=float32, weight_dtype=None`` (shape of ``x``)
- ``silu_mul``:    ``shape, dtype=float32`` (shape of ``gate``)
- ``softmax``:     ``shape, dtype=float32``
- ``paged_decode_attention``: ``context_lens, num_heads, num_kv_heads, head_dim,
  dtype=float16, block_size=16, index_dtype=int32, num_splits=1``

Example: ``bytes_moved("add_rmsnorm", "unfused", (2, 4), torch.float16) == 392``.

Without a GPU the Triton kernels run in Triton's CPU interpreter (this package
sets ``TRITON_INTERPRET=1`` before defining them, unless it is already set).
Without Triton (macOS) everything imports; the ``*_triton`` functions raise
ImportError when called.
"""

from tinyserve.kernels.triton_setup import HAS_TRITON, interpreting  # first: sets TRITON_INTERPRET
from tinyserve.kernels.accounting import Step
from tinyserve.kernels.add_rmsnorm import add_rmsnorm_steps, add_rmsnorm_triton, add_rmsnorm_unfused
from tinyserve.kernels.paged_attention import (choose_num_splits, paged_decode_attention_steps,
                                               paged_decode_attention_torch,
                                               paged_decode_attention_triton)
from tinyserve.kernels.silu_mul import silu_mul_steps, silu_mul_triton, silu_mul_unfused
from tinyserve.kernels.softmax import softmax_steps, softmax_triton, softmax_unfused

OPS = {
    "add_rmsnorm": (add_rmsnorm_unfused, add_rmsnorm_triton, add_rmsnorm_steps),
    "silu_mul": (silu_mul_unfused, silu_mul_triton, silu_mul_steps),
    "softmax": (softmax_unfused, softmax_triton, softmax_steps),
    "paged_decode_attention": (paged_decode_attention_torch, paged_decode_attention_triton,
                               paged_decode_attention_steps),
}


def steps(op: str, variant: str, *args, **kwargs) -> list[Step]:
    """Each kernel launch of ``op``'s ``variant`` with the bytes it reads and writes."""
    if op not in OPS:
        raise ValueError(f"op: unknown {op!r}; choose one of {sorted(OPS)}")
    return OPS[op][2](variant, *args, **kwargs)


def bytes_moved(op: str, variant: str, *args, **kwargs) -> int:
    """Total bytes read plus written by ``op``'s ``variant`` (see :func:`steps`)."""
    return sum(s.total for s in steps(op, variant, *args, **kwargs))


__all__ = [
    "HAS_TRITON", "OPS", "Step", "bytes_moved", "choose_num_splits", "interpreting", "steps",
    "add_rmsnorm_unfused", "add_rmsnorm_triton", "add_rmsnorm_steps",
    "silu_mul_unfused", "silu_mul_triton", "silu_mul_steps",
    "softmax_unfused", "softmax_triton", "softmax_steps",
    "paged_decode_attention_torch", "paged_decode_attention_triton", "paged_decode_attention_steps",
]
