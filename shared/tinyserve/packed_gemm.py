"""Every GEMM of the model on one copy of its weights, packed once for oneDNN (CPU).

A decode step should cost one read of the weights. Eager ``F.linear`` on a CPU
misses that floor at small batches: the BLAS lays each weight matrix out again
for its micro-kernel on every call, and on some CPUs (an AMD EPYC with MKL) its
small-M path is slow as well. oneDNN can lay a weight out once
(``mkldnn._reorder_linear_weight``) and multiply any number of rows against that
copy (``mkldnn._linear_pointwise``), so one packed copy of the model serves
every batch size, prefill chunks included: packing takes about a second, where
compiling one graph per batch size with ``torch.compile`` took a minute or more
(``compiled_step.py``, still used on GPUs). As vLLM does with
``QKVParallelLinear`` and ``MergedColumnParallelLinear``, q, k and v become one
GEMM and gate and up another: fewer and larger calls, each reading its input once.

The packed copy *replaces* the model's linear weights: once packed, the
``nn.Linear`` parameters are left on the meta device (shape and dtype, no
memory), every forward runs on ``PackedWeights``, and ``PackedWeights.unpacked``
puts dense weights back for as long as a caller needs them (saving a
checkpoint). A tied output projection is the embedding table itself and is not
packed (that would copy the table); oneDNN multiplies the plain table instead (a bf16
table of a few rows: our kernel, ``tinyserve.bf16_gemm``, which reads it faster).

On a CPU without native bf16 (no AVX512-BF16, AMX or AVX-NE-CONVERT: an AMD EPYC
Zen 3, most desktop CPUs), oneDNN will not pack bf16, and a bf16 GEMM of many rows
runs far below an fp32 one. There the same ``PackedWeights`` keep the bf16
weights as they are (``UpcastLinear``, form "upcast"), and compute in fp32 on that
bf16 storage: a GEMM of up to ``bf16_gemm.MAX_ROWS`` rows in our fused kernel
(``tinyserve.bf16_gemm``: each weight widened in a register, so a decode step reads
the bf16 bytes once), one of more rows on fp32 copies of the weight made chunk by
chunk in one small scratch buffer (oneDNN's fp32 GEMM: compute-bound there, it
outruns the kernel). Where the kernel cannot be built (no C compiler), a GEMM of
few rows multiplies the bf16 weight directly in torch instead.

With ``enforce_eager=None`` (``PackedDecode(..., choose=True)``) the engine first
times a few layers of a decode step of 1, 2, 4 and 8 rows (``CHOICE_SIZES``, whatever
the engine's own buckets) both ways: the first layers packed in place against as
many of the next layers, dense and of the same shapes (each side's weights twice the
last-level cache: streamed from memory as a step streams the model), at a realistic
context (``CHOICE_CONTEXT``), in interleaved pairs (``host.paired_ratio``): a batch
size chooses packed when all of its pairs but one found it faster. There is one copy
of the weights, so the choice is one for the whole model, the same for every engine
on it: the weights are packed if any size chose it, and stay dense if every size
chose eager. ``choices`` and
``timings`` record what was measured (``describe`` prints them; the engine logs
them). The timing is a start-up sample on whatever else the machine was doing
then, not a guarantee for every later step. Packing releases each dense weight as
soon as it is merged for its GEMM, so start-up never holds more than one GEMM's
weight beside the model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from typing import Callable

import torch

from tinyserve import bf16_gemm
from tinyserve.host import PairedRatio, l3_cache_bytes, paired_ratio, return_freed_memory
from tinyserve.model import KVCache, LlamaForServing, scratch_layers

log = logging.getLogger(__name__)

# False: enforce_eager=False compiles graphs on a CPU too (tests of compiled_step).
ENABLED = True

# oneDNN picks its packed layout for a typical row count; one layout serves every M
# (``bench crossover`` compares it with a layout packed for each batch).
PACK_HINT = 8
# enforce_eager=None: time packed against eager per batch size and keep the weights
# packed only if a size chose them (tests of the packed path itself turn this off).
CHOOSE_FASTER = True
# Interleaved eager/packed pairs timed per batch size at start, each a decode step whose
# rows attend over CHOICE_CONTEXT tokens (capped at the model's context). The sizes timed
# are CHOICE_SIZES whatever the engine's own buckets: the weights are one copy for every
# step, so the choice belongs to the model, its dtype and the CPU, not to max_num_seqs (a
# one-seat engine that timed bucket 1 alone ran `small` eagerly where 4 and 16 seats
# packed it: on an AMD EPYC Zen 5, 32 MiB L3, B=1's pairs straddle 1 and B=4's read
# 1.16-1.40). Small batches are where eager and packed GEMMs differ most, and large eager
# steps would make start-up slow.
CHOICE_PAIRS, CHOICE_CONTEXT, CHOICE_SIZES = 9, 256, (1, 2, 4, 8)
# On some CPUs oneDNN's kernels for 1 or 2 rows read a packed weight more slowly than
# its 4-row kernel does (every GEMM of cpu-bench on an AMD EPYC Zen 4: 1.04-1.37x slower,
# fp32 and bf16, 1 and 2 threads), and the few rows that pad a call to 4 cost nothing at
# a weight-read-bound batch; on others the 1-row kernel is the faster (an AMD EPYC Zen 3,
# AVX2: cpu-bench's GEMMs at 1 row 13.9 ms a step, padded 19.4). ``PackedDecode`` times
# both at start (``PackedWeights.choose_padding``, PAD_PAIRS interleaved pairs).
MIN_ROWS, PAD_PAIRS = 4, 7
# Bf16 weights on a CPU without native bf16 ("upcast"): above bf16_gemm.MAX_ROWS rows (or
# from UPCAST_MIN_ROWS on where that kernel is not built) a GEMM multiplies fp32 copies of
# its weight, UPCAST_SCRATCH_BYTES at a time. Qwen2.5-0.5B's GEMMs on an AMD EPYC Zen 3
# (2 threads), bf16 F.linear against this: about equal at 4 rows, 1.6-2.0x slower at 8,
# 3.6-4.7x at 32, 5.6-6.8x at 128 and 512; at 1 and 2 rows the direct bf16 product is
# 1.3-2.3x faster. A 4 MiB buffer beat 1 and 16 MiB.
UPCAST_MIN_ROWS = 6
UPCAST_SCRATCH_BYTES = 4 * 2**20
# A tied bf16 output projection stays the embedding table, plain: oneDNN multiplies a plain
# weight by re-laying it out on the fly, which halves its read speed at a few rows, so up
# to this many rows it goes through our kernel (it reads the table as it lies). Qwen2.5-
# 0.5B's 151936 x 896 table on an AMD EPYC Zen 4 (AVX512-BF16, 2 threads), oneDNN / ours,
# 9 interleaved pairs: 1 row 16.4 / 8.9 ms (1.83x), 4 rows 1.53x, 6 rows 1.16x, 7 rows 0.94x.
TIED_KERNEL_ROWS = 4

Linear = Callable[[torch.Tensor], torch.Tensor]


def onednn_available() -> bool:
    dnn = getattr(torch.ops, "mkldnn", None)
    return torch.backends.mkldnn.is_available() and hasattr(dnn, "_linear_pointwise")


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: fp32 wherever oneDNN is
    built in; bf16 only on CPUs with native bf16 support (AVX512-BF16, AMX, or
    AVX-NE-CONVERT), where torch's bf16 reorder accepts the weight."""
    if not onednn_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_HINT)
    except RuntimeError:                    # "bf16 path needs the cpu support ..."
        return False
    return True


def form(model: LlamaForServing) -> str | None:
    """How ``PackedWeights`` hold this model's weights here: "packed" where oneDNN packs
    their dtype (``packs``; a torch built with oneDNN, as x86 and ARM wheels are),
    "upcast" for bf16 weights where it does not (no native bf16: ``UpcastLinear``),
    None elsewhere (GPU weights, fp16)."""
    weight = model.lm_head.weight
    if not ENABLED or weight.device.type != "cpu" or not onednn_available():
        return None
    if packs(weight.dtype):
        return "packed"
    return "upcast" if weight.dtype == torch.bfloat16 else None


def supported(model: LlamaForServing) -> bool:
    """Whether ``PackedWeights`` serve this model here (``form``)."""
    return form(model) is not None


def weights_read(model: LlamaForServing) -> list[torch.nn.Parameter]:
    """What a decode step reads: every weight but the embedding table, of which it reads a
    few rows (unless the output projection is that same table, tied: then it reads it all,
    once). Packed weights count as the dense ones they replaced (same shapes)."""
    read = {id(p): p for name, p in model.named_parameters() if "embed_tokens" not in name}
    read[id(model.lm_head.weight)] = model.lm_head.weight
    return list(read.values())


def weight_bytes(model: LlamaForServing) -> int:
    """The bytes a decode step reads (``weights_read``)."""
    return sum(p.numel() * p.element_size() for p in weights_read(model))


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in oneDNN, ``weight`` packed (``_reorder_linear_weight``) or plain."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  hint: int = PACK_HINT) -> Linear:
    """``x -> x @ weight.T + bias`` on a copy of ``weight [out, in]`` packed once for
    oneDNN (laid out for about ``hint`` rows; any number of rows works)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), hint)
    bias = None if bias is None else bias.detach().contiguous()
    return lambda x: onednn_matmul(x, packed, bias)


def upcast_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scratch: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 ``x [rows, in]`` and ``weight`` on a CPU without
    native bf16, in fp32, rounded to bf16 once: up to ``bf16_gemm.MAX_ROWS`` rows in the
    fused kernel; more rows on the weight copied to fp32 ``scratch`` one chunk of output
    rows at a time (the copy stays in the cache). Without the kernel, fewer than
    ``UPCAST_MIN_ROWS`` rows multiply in bf16 directly."""
    if x.shape[0] <= bf16_gemm.MAX_ROWS and bf16_gemm.available():
        return bf16_gemm.matmul(x, weight, bias, out_dtype=x.dtype)
    if x.shape[0] < UPCAST_MIN_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    x32, rows = x.float(), max(1, scratch.numel() // weight.shape[1])
    parts = []
    for start in range(0, weight.shape[0], rows):
        chunk = weight[start:start + rows]
        parts.append(onednn_matmul(x32, scratch[:chunk.numel()].view(chunk.shape).copy_(chunk), None))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def upcast_scratch(widest: int) -> torch.Tensor:
    """The fp32 buffer ``upcast_matmul`` copies weight chunks into, shared by every GEMM of
    a model (steps run one at a time): ``UPCAST_SCRATCH_BYTES``, or one row of the widest
    weight (``widest`` inputs) if that is more."""
    with torch.inference_mode(False):       # a normal tensor: writable in and out of it
        return torch.empty(max(UPCAST_SCRATCH_BYTES // 4, widest))


class Projections:
    """Several projections of the same input (q, k, v; or gate, up) as one GEMM, whose
    output is split back into the projections'; subclasses hold the weight in a form."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears
        self.widths = [l.out_features for l in linears]
        self.has_bias = any(l.bias is not None for l in linears)
        self.bias: torch.Tensor | None = None

    def merge_weights(self, release: bool) -> torch.Tensor:
        """The projections' weights as one (sets ``bias``: theirs as one, zeros where one
        has none); ``release``: the dense parameters go as soon as they are merged, so
        forming this GEMM never holds more than its merged weight beside the model."""
        weight = torch.cat([l.weight.detach() for l in self.linears])
        if self.has_bias:
            self.bias = torch.cat([l.bias.detach() if l.bias is not None
                                   else torch.zeros(l.out_features, dtype=weight.dtype)
                                   for l in self.linears])
        if release:
            self.release()
            return_freed_memory()
        return weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.matmul(x)
        return (out,) if len(self.widths) == 1 else out.split(self.widths, dim=-1)

    def release(self) -> None:
        """Leave the dense parameters on the meta device: this object holds the weight."""
        for linear in self.linears:
            for name in ("weight", "bias"):
                p = getattr(linear, name)
                if p is not None and not p.is_meta:
                    setattr(linear, name, torch.nn.Parameter(p.to("meta"), requires_grad=False))

    def restore(self) -> None:
        """Dense parameters again, from the form held here."""
        weights = self.dense_weight().split(self.widths)
        biases = self.bias.split(self.widths) if self.has_bias else [None] * len(self.linears)
        for linear, w, b in zip(self.linears, weights, biases):
            linear.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(b.clone(), requires_grad=False)


class UpcastLinear(Projections):
    """The projections on their bf16 weights, merged, through ``upcast_matmul``."""

    def __init__(self, linears: list[torch.nn.Linear], scratch: torch.Tensor, release: bool = False):
        super().__init__(linears)
        self.weight = self.merge_weights(release)
        self.scratch = scratch

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return upcast_matmul(x, self.weight, self.bias, self.scratch)

    def dense_weight(self) -> torch.Tensor:
        return self.weight


class MergedLinear(Projections):
    """The projections as one GEMM on a copy of their weights packed for oneDNN."""

    def __init__(self, linears: list[torch.nn.Linear], hint: int = PACK_HINT, release: bool = False):
        super().__init__(linears)
        weight = self.merge_weights(release)
        self.in_features = weight.shape[1]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
        self.pad_to = MIN_ROWS                       # fewer input rows are padded to this many
        self.padded: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.pad_to:
            # One buffer per GEMM: its other rows hold zeros or an earlier call's rows (finite
            # values, never denormal garbage), and their outputs are dropped.
            if self.padded is None or self.padded.shape[0] != self.pad_to:
                with torch.inference_mode(False):   # a normal tensor: writable in and out of it
                    self.padded = x.new_zeros(self.pad_to, x.shape[1])
            self.padded[:rows] = x
            x = self.padded
        return onednn_matmul(x, self.packed, self.bias)[:rows]

    def dense_weight(self) -> torch.Tensor:
        return self.packed.to_dense()


class PackedLayer:
    """One decoder layer's GEMMs on packed weights (what ``Attention`` and ``MLP``
    call when given one); ``merge`` makes each merged GEMM (default: ``MergedLinear``)."""

    def __init__(self, layer, merge: Callable[[list], Projections] = MergedLinear):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = merge([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = merge([mlp.gate_proj, mlp.up_proj])
        self.o = merge([attn.o_proj])
        self.down = merge([mlp.down_proj])
        self.merged = (self.qkv, self.gate_up, self.o, self.down)

    def project_qkv(self, x: torch.Tensor):
        return self.qkv(x)

    def project_gate_up(self, x: torch.Tensor):
        return self.gate_up(x)

    def o_proj(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(x)[0]

    def down_proj(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(x)[0]


class PackedWeights:
    """Every GEMM of the model on one packed copy of its weights (``form`` "packed"), or
    on its bf16 weights computed in fp32 (``form`` "upcast", CPUs without native bf16).
    ``release=True`` drops each dense weight as soon as it is merged for packing (one copy
    at every moment, beside one GEMM's weight in flight); otherwise both copies live until
    ``release()`` or until this object is dropped. ``done``: the first layers, packed
    already (``PackedDecode``'s start-up timing packs them in place)."""

    def __init__(self, model: LlamaForServing, hint: int = PACK_HINT, release: bool = False,
                 done: list[PackedLayer] = ()):
        self.model = model
        self.form = form(model) or "packed"
        widest = max(p.shape[-1] for p in model.parameters() if p.dim() == 2)
        self.scratch = upcast_scratch(widest) if self.form == "upcast" else None
        merge = (functools.partial(UpcastLinear, scratch=self.scratch, release=release)
                 if self.form == "upcast" else functools.partial(MergedLinear, hint=hint, release=release))
        self.layers = list(done)
        self.layers += [PackedLayer(layer, merge) for layer in model.model.layers[len(done):]]
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        # A tied projection stays the embedding table (packing would copy the table).
        self.head = None if tied else merge([model.lm_head])
        self.pad_to = MIN_ROWS          # packed: what every MergedLinear pads to (choose_padding)

    def _all(self) -> list[Projections]:
        return [m for layer in self.layers for m in layer.merged] + (
            [self.head] if self.head is not None else [])

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(x)[0]
        # The tied table, unpacked: oneDNN multiplies a plain weight too, about twice as fast
        # as F.linear in fp32 (Qwen2.5-0.5B's 151936 x 896 table, AMD EPYC Zen 4: 21.6 ms
        # against 38.1 at one row, 60.3 against 122.5 at 32), as fast in bf16; a bf16 table
        # of a few rows goes faster still through our kernel (TIED_KERNEL_ROWS).
        table = self.model.lm_head.weight
        if self.form == "upcast":
            return upcast_matmul(x, table, None, self.scratch)
        if (table.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
                and x.shape[0] <= TIED_KERNEL_ROWS and bf16_gemm.available()):
            return bf16_gemm.matmul(x, table, None, out_dtype=torch.bfloat16)
        return onednn_matmul(x, table, None)

    def choose_padding(self, pairs: int = PAD_PAIRS):
        """Pad GEMMs of fewer than ``MIN_ROWS`` rows to that many, or not, as measured here:
        every packed GEMM of the model at one row, in a decode step's order (from memory
        where the weights outgrow the last-level cache, as a step reads them), unpadded
        against padded, in interleaved pairs (``host.PairedRatio`` of unpadded time / padded
        time); padding is kept (``pad_to``) when most pairs found it faster."""
        gemms = [m for m in self._all() if isinstance(m, MergedLinear)]
        rows = {w: torch.randn(1, w, dtype=self.model.lm_head.weight.dtype)
                for w in {m.in_features for m in gemms}}

        def step(pad_to: int):
            def run():
                for m in gemms:
                    m.pad_to = pad_to
                    m.matmul(rows[m.in_features])
            return run

        ratio = paired_ratio(step(1), step(MIN_ROWS), pairs=pairs)
        self.pad_to = MIN_ROWS if ratio.low > 1.0 else 1
        for m in gemms:
            m.pad_to = self.pad_to
        return ratio

    def release(self) -> None:
        """From now on the packed copy is the only one."""
        for merged in self._all():
            merged.release()

    @contextlib.contextmanager
    def unpacked(self):
        """Dense weights back in the model for the block (e.g. to save a checkpoint),
        released again after it."""
        for merged in self._all():
            merged.restore()
        try:
            yield self.model
        finally:
            self.release()
            return_freed_memory()


class PackedDecode:
    """The model on ``PackedWeights`` where that measured faster (or always, pinned).

    ``choose=True``: time each of ``CHOICE_SIZES`` at start and keep packing if any chose it;
    ``choose=False``: pack, with no timing (``enforce_eager=False``). Bf16 weights on a
    CPU without native bf16 (``form`` "upcast") are not timed: each GEMM already takes
    the faster of its two ways by its row count (``upcast_matmul``), and the steps it
    speeds up most (prefill chunks, large batches) are not the decode steps timed here."""

    def __init__(self, model: LlamaForServing, kv_cache: KVCache, scratch_slot: int,
                 choose: bool = True):
        self.model, self.kv_cache = model, kv_cache
        self.scratch_slot = scratch_slot        # where timing rows write their K and V
        self.form = form(model)
        self.choose = choose and CHOOSE_FASTER and self.form == "packed"
        self.weights: PackedWeights | None = None
        self.pack_seconds = 0.0
        self.warm_up_seconds = 0.0      # packing and choosing, at start
        # batch size -> eager time / packed time measured at start, all its pairs (> 1:
        # packed is faster; a size whose pairs straddle 1 chooses eager)
        self.timings: dict[int, PairedRatio] = {}
        self.choices: dict[int, str] = {}     # batch size -> "packed" or "eager", as timed
        self.steps_run = 0              # decode steps that ran on the packed weights
        self.layers_timed = 0           # choosing: the decoder layers timed per size and side
        self.eager_from = 0             # choosing: the first layer of the dense side
        self.padding = None             # packed: PairedRatio of 1-row GEMMs unpadded / padded

    @property
    def speedups(self) -> dict[int, float]:
        """batch size -> the median of its pairs, eager time / packed time (> 1: packed is faster)."""
        return {size: ratio.median for size, ratio in self.timings.items()}

    def weights_for(self, decode: bool) -> PackedWeights | None:
        """The packed weights every step runs on while they are kept (None: the dense
        ones); ``steps_run`` counts the pure decode steps among them."""
        if self.weights is not None and decode:
            self.steps_run += 1
        return self.weights

    def warm_up(self) -> float:
        """Pack every weight (choosing: if a batch size timed faster packed); seconds."""
        started = time.perf_counter()
        probe = self.choose_by_timing() if self.choose else []
        if not self.choose or "packed" in self.choices.values():
            packing = time.perf_counter()
            self.weights = PackedWeights(self.model, release=True, done=probe)
            self.pack_seconds = time.perf_counter() - packing
            if self.form == "packed":
                self.padding = self.weights.choose_padding()
        return_freed_memory()
        self.warm_up_seconds = time.perf_counter() - started
        log.info("%s", self.describe())
        return self.warm_up_seconds

    def choose_by_timing(self) -> list[PackedLayer]:
        """Time each of ``CHOICE_SIZES`` eager against packed and record the choices;
        returns the layers left packed for ``PackedWeights`` to go on from.

        The first few layers are packed in place (their dense weights released) and timed
        against as many of the next layers, still dense and of the same shapes, so the
        model is never held in both forms. If every size chooses eager, those layers
        get their dense weights back. A model too shallow for that (one layer) times a
        packed copy of its layer against the layer itself."""
        layers = self.model.model.layers
        n = self.probe_layers()
        in_place = 2 * n <= len(layers)
        probe = [PackedLayer(layer, functools.partial(MergedLinear, release=in_place))
                 for layer in layers[:n]]
        self.layers_timed, self.eager_from = n, n if in_place else 0
        for size in CHOICE_SIZES:
            ratio = self.time_against_eager(size, probe, eager_from=self.eager_from)
            self.timings[size] = ratio
            # All pairs but one must agree (host.PairedRatio.low is the second-smallest): a
            # tie does not flip into packing from run to run.
            self.choices[size] = "packed" if ratio.low >= 1.0 else "eager"
        if "packed" in self.choices.values() and in_place:
            return probe
        if not in_place:
            return []
        while probe:            # dense again, one layer at a time, its packed form dropped first
            restored = probe.pop(0)
            for merged in restored.merged:
                merged.restore()
            del restored, merged
            return_freed_memory()
        return []

    def probe_layers(self) -> int:
        """Layers timed at start: enough that their weights are twice the last-level cache
        (streamed from memory, as a step streams the model), at most half the model (the
        other side of the timing runs on the next as many), at least one."""
        per_layer = sum(p.numel() * p.element_size() for p in self.model.model.layers[0].parameters())
        cache = l3_cache_bytes() or 32 * 2**20
        half = self.model.config.num_hidden_layers // 2
        return max(1, min(half, math.ceil(2 * cache / per_layer)))

    def time_against_eager(self, size: int, probe: list[PackedLayer], eager_from: int,
                           pairs: int = CHOICE_PAIRS):
        """Eager seconds / packed seconds of ``len(probe)`` layers of a decode step of
        ``size`` rows over a ``CHOICE_CONTEXT``-token context (``host.PairedRatio``: median
        and spread of interleaved pairs), on rows that write to the scratch slot: the first
        layers on ``probe``, and as many dense layers from ``eager_from`` on."""
        context = min(CHOICE_CONTEXT, self.model.config.max_position_embeddings)
        eager = scratch_layers(self.model, self.kv_cache, size, self.scratch_slot, context,
                               [None] * len(probe), first=eager_from)
        packed = scratch_layers(self.model, self.kv_cache, size, self.scratch_slot, context, probe)
        return paired_ratio(eager, packed, pairs=pairs)

    def describe(self) -> str:
        """One line: the weights every step runs on, and what each batch size measured."""
        if self.form == "upcast":
            few = (f"up to {bf16_gemm.MAX_ROWS} rows in the fused bf16 kernel, more"
                   if bf16_gemm.available() else
                   f"fewer than {UPCAST_MIN_ROWS} rows in bf16 (no C compiler for the fused "
                   f"kernel), {UPCAST_MIN_ROWS} or more")
            return (f"bf16 weights on a CPU without native bf16 (oneDNN packs no bf16 here): "
                    f"GEMMs of {few} in fp32 on fp32 copies of weight chunks; "
                    "every step runs on them")
        padding = "" if self.padding is None else (
            f"; GEMMs of fewer than {MIN_ROWS} rows "
            + (f"padded to {MIN_ROWS}" if self.weights.pad_to > 1 else "not padded")
            + f" (1 row unpadded / padded: {self.padding})")
        if not self.choose:
            return (f"weights packed for oneDNN in {self.pack_seconds:.1f} s (pinned: "
                    f"enforce_eager=False); every step runs on them{padding}")
        parts = [f"B={s}: {self.choices[s]} ({self.timings[s]})" for s in self.choices]
        kept = ("packed weights kept, every step runs on them" if self.weights is not None
                else "every batch size chose eager: packing dropped")
        n, first = self.layers_timed, self.eager_from
        timed = (f"layers 1-{n} packed against {first + 1}-{first + n} dense" if first
                 else "a packed copy of layer 1 against itself")
        return (f"{kept}; {timed} (of {self.model.config.num_hidden_layers}), a decode step per "
                f"batch size (eager time / packed time at start; packed where all pairs but one say so): "
                + ", ".join(parts) + padding)


PACKED_PATHS = ("mkl", "onednn")


def prepacked_linear(weight: torch.Tensor, batch: int, path: str = "mkl"):
    """``x -> x @ weight.T`` for exactly ``batch`` rows through a packed GEMM, without
    compiling: ``path="mkl"`` is MKL's packed GEMM, the kernel Inductor's freezing puts
    in a compiled CPU graph; ``"onednn"`` is oneDNN's (``onednn_linear``), which is the
    faster of the two on some CPUs (AMD EPYC) at small batches.

    The weight ``[out, in]`` is packed once (a copy about its own size) for that
    batch; a plain ``F.linear`` re-packs it on every call, which is why eager small
    batches sit above the weight-read floor. Returns None where this torch lacks the
    path (ARM, some builds) or the weight is not on a CPU in a dtype the path packs
    (MKL: fp32; oneDNN: ``packs``): use ``F.linear``."""
    if path not in PACKED_PATHS:
        raise ValueError(f"path: {path!r} is not one of {PACKED_PATHS}")
    if weight.device.type != "cpu":
        return None
    weight = weight.contiguous()
    if path == "onednn":
        return onednn_linear(weight, None, batch) if packs(weight.dtype) else None
    if weight.dtype != torch.float32:
        return None
    mkl = getattr(torch.ops, "mkl", None)
    if not torch.backends.mkl.is_available() or not hasattr(mkl, "_mkl_linear"):
        return None
    packed = mkl._mkl_reorder_linear_weight(weight, batch)
    return lambda x: mkl._mkl_linear(x, packed, weight, None, batch)
