"""A bf16-weight GEMM for CPUs without bf16 instructions, fused: widen, multiply, add.

On such a CPU (AVX2 only: an AMD EPYC Zen 3, most desktop CPUs) torch has no fast
way to multiply activations by bf16 weights: its bf16 GEMM runs far below the
memory's speed, and the fp32 route first converts the weight into an fp32 copy and
then multiplies that: an extra pass over every weight, every step.
``bf16_gemm.c`` widens each 8 weights to fp32 in a register right before using
them, so a decode step reads its weights once, as bf16 (the chapter's kernel
fusion: fewer bytes moved). It is ours because torch ships no such kernel.
On CPUs with native bf16 it multiplies one weight more: a tied output projection of a
few rows, which stays the plain embedding table (``packed_gemm.TIED_KERNEL_ROWS``).

``native`` compiles the C file at first use for this CPU and keeps it; where no
compiler builds it, ``available()`` is False and callers keep torch's path.
``TINYSERVE_BF16_GEMM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve import native

# Up to this many rows the kernel beats torch: bf16 F.linear below 6 rows, oneDNN's fp32
# GEMM on fp32 copies of the weight above (packed_gemm.upcast_matmul). All the GEMMs of a
# decode step, AMD EPYC Zen 3 (2 threads, 32 MiB L3), the kernel's speed-up, median of 5
# interleaved pairs, Qwen2.5-0.5B's shape / cpu-bench: 1 row 1.33x / 1.29x, 2 rows 2.2x /
# 2.2x, 8 rows 2.5x / 2.2x, 32 rows 1.47x / 1.31x, 64 rows 1.19x / 1.14x, 128 rows 1.17x /
# 0.96x. At 1 row it read the weights at 25 / 23 GB/s (the machine: 22-33 GB/s).
MAX_ROWS = 64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (``native.load``), None where it cannot be built."""
    lib = native.load("bf16_gemm")
    if lib is not None:
        lib.bf16_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int] + [ctypes.c_long] * 3
        lib.bf16_gemm.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight.T + bias`` computed in fp32, returned as ``out_dtype`` (fp32, or bf16
    rounded once as ``.to(torch.bfloat16)`` would), for ``x [rows, in]`` of any float
    dtype and a contiguous bf16 CPU ``weight [out, in]``. Needs ``available()``.
    fp32 and bf16 ``x`` go in as they are: a bf16 model's GEMM is one call, no casts."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous 2-D bf16 tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}{'' if weight.is_contiguous() else ' (strided)'}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [rows, {weight.shape[1]}], got {tuple(x.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("bf16_gemm.matmul runs on CPU tensors only")
    lib = library()
    if lib is None:
        raise RuntimeError("the bf16 GEMM kernel is not built here (bf16_gemm.available() is False)")
    x_in = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    bias32 = None if bias is None else bias.to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    if x.shape[0] and weight.shape[0]:
        failed = lib.bf16_gemm(x_in.data_ptr(), x_in.dtype == torch.bfloat16, weight.data_ptr(),
                               None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
                               out_dtype == torch.bfloat16, x.shape[0], weight.shape[0], weight.shape[1])
        if failed:
            raise MemoryError(f"bf16_gemm: no memory for an fp32 copy of x {tuple(x.shape)}")
    return out
