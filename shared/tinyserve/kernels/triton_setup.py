"""Import Triton once, in the right mode, for every kernel module.

With no CUDA device, Triton's interpreter runs each program instance in numpy
on the CPU: slow (about a millisecond per program) but exact enough to test
the kernels anywhere. The interpreter is chosen when a kernel is *defined*
(``@triton.jit``), so ``TRITON_INTERPRET=1`` must be in the environment before
the kernel modules run; this module sets it, unless the user already chose.

Where Triton is not installed at all (macOS), ``HAS_TRITON`` is False, the
kernel modules skip their ``@triton.jit`` definitions, and calling a fused
kernel raises :func:`require_triton`'s ImportError. The torch references work.
A notebook in which the reader writes a kernel (lab 02) imports
:data:`missing_triton` as ``triton`` and ``tl`` there, so that ``@triton.jit``
still defines the kernel and only launching it says that Triton is missing.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as exc:          # no wheel for this platform, or a broken install
    triton = tl = None
    HAS_TRITON = False
    _IMPORT_ERROR: ImportError | None = exc
else:
    HAS_TRITON = True
    _IMPORT_ERROR = None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(name: str) -> None:
    """Raise a clear ImportError when a fused kernel is called without Triton."""
    if not HAS_TRITON:
        raise ImportError(
            f"tinyserve.kernels.{name} needs Triton, which did not import here "
            f"({_IMPORT_ERROR}). Triton ships wheels for Linux only: on Linux run "
            "`pip install triton`; elsewhere use the torch references "
            "(*_unfused / paged_decode_attention_torch)."
        ) from _IMPORT_ERROR


class MissingTriton:
    """Stands in for ``triton`` and ``triton.language`` where Triton did not import.

    Any attribute is a stand-in too, so ``@triton.jit`` and ``BLOCK_N: tl.constexpr``
    evaluate and a cell that defines a kernel runs; launching the kernel
    (``kernel[grid](...)``) or calling anything else (``triton.next_power_of_2(n)``)
    raises ImportError saying that this machine has no Triton.
    """

    def __init__(self, name: str = "triton"):
        self._name = name

    def __getattr__(self, attr: str) -> "MissingTriton":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingTriton(f"{self._name}.{attr}")

    def jit(self, fn=None, **options):
        if fn is None:                                  # @triton.jit(...) with options
            return lambda f: self.jit(f)
        return MissingTriton(getattr(fn, "__name__", "kernel"))

    def __getitem__(self, grid) -> "MissingTriton":
        return self

    def __call__(self, *args, **kwargs):
        raise ImportError(
            f"本机没有 Triton，{self._name} 无法运行（不是代码的问题）：Triton 只有 Linux 的安装包，"
            f"请在 Linux 或 WSL 上运行 / {self._name} needs Triton, which did not import here "
            f"({_IMPORT_ERROR}). Triton ships wheels for Linux only: run this on Linux or WSL."
        ) from _IMPORT_ERROR

    def __repr__(self) -> str:
        return f"<{self._name}: Triton is not installed>"


missing_triton = MissingTriton()


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter needs CPU ones."""
    want = "cpu" if interpreting() else "cuda"
    for t in tensors:
        if t.device.type != want:
            mode = "the Triton interpreter (TRITON_INTERPRET=1)" if want == "cpu" else "compiled Triton"
            raise ValueError(f"{name}: tensors must be on {want} under {mode}, got one on {t.device}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_per_program(n_rows: int, block_n: int, interpret: bool | None = None) -> int:
    """Rows one program of a row-wise kernel handles: one on a GPU for wide
    rows; many in the interpreter, where each program instance costs about a
    millisecond of Python whatever its size. ``interpret=None``: this process's mode
    (``False`` asks for the CUDA choice, as ``tinyserve.kernels.aot`` does)."""
    interpret = interpreting() if interpret is None else interpret
    target = 1 << 16 if interpret else 4096
    return max(1, min(next_power_of_2(n_rows), target // block_n))


def num_warps_for(block_elems: int) -> int:
    return 4 if block_elems <= 2048 else 8 if block_elems <= 8192 else 16


def row_launch_config(n_rows: int, n_cols: int, interpret: bool | None = None) -> dict:
    """Constexprs and ``num_warps`` a row-wise kernel (``BLOCK_M`` rows of ``BLOCK_N``
    columns per program: add_rmsnorm, softmax) launches with. ``interpret=False``: what
    it picks on a CUDA device, as ``tinyserve.kernels.aot`` checks."""
    block_n = next_power_of_2(n_cols)
    block_m = rows_per_program(n_rows, block_n, interpret)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps_for(block_m * block_n))
