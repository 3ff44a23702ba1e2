"""Decode steps on a CPU with every weight packed once for oneDNN's GEMM.

A decode step should cost one read of the weights. Eager ``F.linear`` on a CPU
misses that floor at small batches: the BLAS lays each weight matrix out again
for its micro-kernel on every call, and on some CPUs (an AMD EPYC with MKL) its
small-M path is slow as well. oneDNN can lay a weight out once
(``mkldnn._reorder_linear_weight``) and multiply any number of rows against that
copy (``mkldnn._linear_pointwise``), so one packed copy of the model serves
every batch size: packing takes about a second, where compiling one graph per
batch size with ``torch.compile`` took a minute or more (``compiled_step.py``,
still used on GPUs). As vLLM does with ``QKVParallelLinear`` and
``MergedColumnParallelLinear``, q, k and v become one GEMM and gate and up
another: fewer and larger calls, each reading its input once.

Packed is not faster everywhere, so ``PackedDecode.warm_up`` times a decode
step of each batch-size bucket both ways (interleaved pairs,
``measure.paired_ratio``) and keeps the faster one per bucket (``choices``,
printed by ``describe``): ``enforce_eager=False`` is never slower than eager.
Only pure decode steps use it; prefill chunks are large GEMMs where packing
buys nothing.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tinyserve.compiled_step import scratch_decode
from tinyserve.host import paired_ratio
from tinyserve.model import KVCache, LlamaForServing

# False: enforce_eager=False compiles graphs on a CPU too (tests of compiled_step).
ENABLED = True

# oneDNN picks its packed layout for a typical row count; one layout serves every M
# (on the AMD EPYC: within a few % of a layout packed for each batch, B = 1 ... 32).
PACK_HINT = 8
# After packing, keep packed weights only in the buckets where they beat eager (tests of
# the packed path itself turn this off).
CHOOSE_FASTER = True
# Interleaved eager/packed pairs timed per bucket at start: a few, and more only where
# those few do not agree on a side (every pair within CLEAR of 1 or on both sides).
QUICK_PAIRS, CHOICE_PAIRS, CLEAR = 2, 7, 0.05

Linear = Callable[[torch.Tensor], torch.Tensor]


def onednn_available() -> bool:
    dnn = getattr(torch.ops, "mkldnn", None)
    return torch.backends.mkldnn.is_available() and hasattr(dnn, "_linear_pointwise")


def supported(model: LlamaForServing) -> bool:
    """fp32 weights on a CPU, with a torch built with oneDNN (x86 and ARM wheels are)."""
    weight = model.lm_head.weight
    return ENABLED and weight.device.type == "cpu" and weight.dtype == torch.float32 \
        and onednn_available()


def weight_bytes(model: LlamaForServing) -> int:
    """The bytes a decode step reads: every weight but the embedding table, of which it
    reads a few rows (unless the output projection is that same table, tied)."""
    read = {id(p): p for name, p in model.named_parameters() if "embed_tokens" not in name}
    read[id(model.lm_head.weight)] = model.lm_head.weight
    return sum(p.numel() * p.element_size() for p in read.values())


def onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  hint: int = PACK_HINT) -> Linear:
    """``x -> x @ weight.T + bias`` on a copy of ``weight [out, in]`` packed once for
    oneDNN (laid out for about ``hint`` rows; any number of rows works)."""
    dnn = torch.ops.mkldnn
    packed = dnn._reorder_linear_weight(weight.detach().contiguous(), hint)
    bias = None if bias is None else bias.detach().contiguous()
    return lambda x: dnn._linear_pointwise(x, packed, bias, "none", [], "")


def merged_linear(linears: list[torch.nn.Linear], hint: int = PACK_HINT):
    """One packed GEMM for several projections of the same input, and the output
    widths to split its result into."""
    weight = torch.cat([l.weight.detach() for l in linears])
    biases = [l.bias for l in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else torch.zeros(l.out_features, dtype=weight.dtype)
         for b, l in zip(biases, linears)])
    return onednn_linear(weight, bias, hint), [l.out_features for l in linears]


class PackedLayer:
    """One decoder layer's four GEMMs on packed weights (what ``Attention`` and ``MLP``
    call when given one)."""

    def __init__(self, layer, hint: int = PACK_HINT):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv, self.qkv_widths = merged_linear([attn.q_proj, attn.k_proj, attn.v_proj], hint)
        self.gate_up, self.gate_up_widths = merged_linear([mlp.gate_proj, mlp.up_proj], hint)
        self.o_proj = onednn_linear(attn.o_proj.weight, attn.o_proj.bias, hint)
        self.down_proj = onednn_linear(mlp.down_proj.weight, mlp.down_proj.bias, hint)

    def project_qkv(self, x: torch.Tensor):
        return self.qkv(x).split(self.qkv_widths, dim=-1)

    def project_gate_up(self, x: torch.Tensor):
        return self.gate_up(x).split(self.gate_up_widths, dim=-1)


class PackedWeights:
    """Every GEMM of the model on one packed copy of its weights (the copy costs as
    much memory as the weights; the originals stay for prefill)."""

    def __init__(self, model: LlamaForServing, hint: int = PACK_HINT):
        self.layers = [PackedLayer(layer, hint) for layer in model.model.layers]
        self.lm_head = onednn_linear(model.lm_head.weight, model.lm_head.bias, hint)


class PackedDecode:
    """Pure decode steps on ``PackedWeights``, in the buckets where they beat eager."""

    def __init__(self, model: LlamaForServing, kv_cache: KVCache, sizes: tuple[int, ...],
                 scratch_slot: int):
        self.model, self.kv_cache = model, kv_cache
        self.sizes = tuple(sorted(sizes))
        self.scratch_slot = scratch_slot        # where timing rows write their K and V
        self.weights: PackedWeights | None = None
        self.pack_seconds = 0.0
        self.warm_up_seconds = 0.0      # packing and choosing, at start
        # bucket -> eager time / packed time measured at start (> 1: packed is faster)
        self.speedups: dict[int, float] = {}
        self.choices: dict[int, str] = {s: "packed" for s in self.sizes}
        self.steps_run = 0              # decode steps that ran on the packed weights

    def use_for(self, batch: int) -> PackedWeights | None:
        """The packed weights for a decode step of ``batch`` rows, if the smallest bucket
        holding it chose them (None: run eagerly)."""
        size = next((s for s in self.sizes if s >= batch), None)
        if size is None or self.choices[size] != "packed":
            return None
        self.steps_run += 1
        return self.weights

    def warm_up(self) -> float:
        """Pack every weight, then choose per bucket between packed and eager; seconds."""
        started = time.perf_counter()
        self.weights = PackedWeights(self.model)
        self.pack_seconds = time.perf_counter() - started
        if CHOOSE_FASTER:
            for size in self.sizes:
                self.speedups[size] = self.time_against_eager(size)
                self.choices[size] = "packed" if self.speedups[size] >= 1.0 else "eager"
        self.warm_up_seconds = time.perf_counter() - started
        return self.warm_up_seconds

    def time_against_eager(self, size: int, pairs: int = CHOICE_PAIRS) -> float:
        """Eager seconds / packed seconds of one decode step of ``size`` rows (the median
        of interleaved pairs), on rows that write to the scratch slot."""
        eager = scratch_decode(self.model, self.kv_cache, size, self.scratch_slot)
        packed = scratch_decode(self.model, self.kv_cache, size, self.scratch_slot,
                                packed=self.weights)
        quick = paired_ratio(eager, packed, pairs=min(QUICK_PAIRS, pairs))
        if min(quick.ratios) > 1 + CLEAR or max(quick.ratios) < 1 - CLEAR or pairs <= QUICK_PAIRS:
            return quick.median     # a clear case: a start-up second saved per bucket
        return paired_ratio(eager, packed, pairs=pairs, warmup=0).median

    def describe(self) -> str:
        """One line: which path each bucket runs, and the speed-up measured at start."""
        parts = [f"B={s}: {self.choices[s]}" + (f" ({self.speedups[s]:.2f}x)" if s in self.speedups else "")
                 for s in self.sizes]
        return (f"weights packed for oneDNN in {self.pack_seconds:.1f} s; decode GEMMs per bucket "
                "(eager time / packed time): " + ", ".join(parts))


PACKED_PATHS = ("mkl", "onednn")


def prepacked_linear(weight: torch.Tensor, batch: int, path: str = "mkl"):
    """``x -> x @ weight.T`` for exactly ``batch`` rows through a packed GEMM, without
    compiling: ``path="mkl"`` is MKL's packed GEMM, the kernel Inductor's freezing puts
    in a compiled CPU graph; ``"onednn"`` is oneDNN's (``onednn_linear``), which is the
    faster of the two on some CPUs (AMD EPYC) at small batches.

    The weight ``[out, in]`` is packed once (a copy about its own size) for that
    batch; a plain ``F.linear`` re-packs it on every call, which is why eager small
    batches sit above the weight-read floor. Returns None where this torch lacks the
    path (ARM, some builds) or the weight is not fp32 on a CPU: use ``F.linear``."""
    if path not in PACKED_PATHS:
        raise ValueError(f"path: {path!r} is not one of {PACKED_PATHS}")
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    weight = weight.contiguous()
    if path == "onednn":
        return onednn_linear(weight, None, batch) if onednn_available() else None
    mkl = getattr(torch.ops, "mkl", None)
    if not torch.backends.mkl.is_available() or not hasattr(mkl, "_mkl_linear"):
        return None
    packed = mkl._mkl_reorder_linear_weight(weight, batch)
    return lambda x: mkl._mkl_linear(x, packed, weight, None, batch)
