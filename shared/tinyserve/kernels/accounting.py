"""Counting the bytes a kernel chain moves through memory.

The model: every step (one kernel launch) reads each of its inputs once from
memory and writes its output once; nothing stays in cache between steps. That
is what an eager, unfused chain pays when its tensors are much larger than the
last-level cache, and what a fused kernel avoids: it reads the inputs, keeps
the intermediates in registers, and writes only the final outputs.

Small parameter vectors (an RMSNorm weight) are counted once per launch: every
program of a kernel reads them, but after the first they come from cache.
The counts follow the code line by line; index-sized work hidden inside a
torch kernel (int32 block ids widened to int64 by indexing) is left out, a few
bytes per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    """One kernel launch: what it reads and what it writes, in bytes."""
    name: str
    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


def elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def split_rows(shape) -> tuple[int, int]:
    """(rows, cols) of a tensor of ``shape`` whose last dim is the row."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape: need at least one dimension")
    return math.prod(shape[:-1]), shape[-1]


def check_variant(variant: str) -> str:
    """'unfused' (alias 'torch', 'eager') or 'fused' (alias 'triton')."""
    aliases = {"unfused": "unfused", "torch": "unfused", "eager": "unfused",
               "fused": "fused", "triton": "fused"}
    if variant not in aliases:
        raise ValueError(f"variant: expected 'unfused' or 'fused', got {variant!r}")
    return aliases[variant]
