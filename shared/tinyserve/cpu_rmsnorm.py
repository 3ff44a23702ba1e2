"""The residual add and RMSNorm of every half-layer, fused, in C for CPUs
(``cpu_rmsnorm.c``): the chapter's kernel fusion where Triton does not run.

Eager torch runs it as a chain of 7 ops (``kernels.add_rmsnorm_unfused``). In a decode
step the tensors are a few rows, so each op costs its call, not its bytes: 19.4 µs for
the chain at one bf16 row of Qwen2.5-0.5B's 896, 6.0 µs for this kernel with its call,
on an AMD EPYC Zen 4 (2 cores, 32 MiB L3); a step runs it twice per layer.
``model.kernel_ops("torch")`` uses it on a CPU, the chain elsewhere.

``native`` compiles the C file at first use for this CPU and keeps it; where no compiler
builds it, ``available()`` is False and callers keep torch's chain.
``TINYSERVE_CPU_RMSNORM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve import native

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (``native.load``), None where it cannot be built."""
    lib = native.load("cpu_rmsnorm")
    if lib is not None:
        lib.add_rmsnorm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_long,
                                                             ctypes.c_long, ctypes.c_float]
        lib.add_rmsnorm.restype = None
    return lib


def available() -> bool:
    return library() is not None


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``add_rmsnorm`` takes these: CPU tensors of one dtype it knows, the kernel
    built, and not inside a graph being compiled (there Inductor fuses torch's chain)."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu"
            and x.dtype in DTYPES and weight.dtype == x.dtype and available())


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(x + residual), x + residual)`` as ``kernels.add_rmsnorm_unfused``
    returns them, for ``x`` and ``residual`` of one shape [..., n], ``weight [n]`` on the
    CPU, all of one dtype. Needs ``supports``."""
    n = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (n,):
        raise ValueError(f"x and residual must have one shape [..., {n}] and weight [{n}], got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)} and {tuple(weight.shape)}")
    if residual.dtype != x.dtype or residual.device.type != "cpu":
        raise ValueError(f"residual must be a CPU tensor of x's dtype {x.dtype}, got "
                         f"{residual.dtype} on {residual.device}")
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out, h = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        library().add_rmsnorm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                              out.data_ptr(), h.data_ptr(), x.dtype == torch.bfloat16,
                              x.numel() // n, n, eps)
    return out, h
