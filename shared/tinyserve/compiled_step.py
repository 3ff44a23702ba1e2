"""Compiled decode steps, one graph per batch-size bucket (vLLM's ``enforce_eager=False``).

A decode step should cost one read of the weights. Eager PyTorch on a CPU
misses that floor for two reasons: the BLAS's small-batch GEMM re-packs every
weight matrix on each call (so a batch of 4 already costs about twice a batch
of 1), and the norms, rotary embedding and SiLU are a dozen small kernels per
layer. ``torch.compile`` with Inductor's *freezing* treats the weights as
constants: it packs each one once, for the exact batch of the graph (MKL's
packed GEMM on x86), and fuses the pointwise ops. On a GPU the graph of each
bucket is captured as a CUDA graph (``mode="reduce-overhead"``), so a step's
hundreds of kernel launches become one replay.

Both need fixed shapes. As vLLM does with ``cudagraph_capture_sizes``, a
decode batch is padded up to the next bucket (1, 2, 4, 8, ...), and the block
tables to the widest a request can have. Attention runs eagerly inside the
graph as one opaque op (``model.padded_decode_attention``), since its cost
depends on contexts that grow every step. Every bucket is compiled at start
(``warm_up``), so no request waits for a compile. Prefill and mixed steps stay
eager.

A compiled graph is not faster everywhere: MKL's packed GEMM, which freezing
uses for fp32 on x86, is fast on an Intel Xeon and slow at small batches on an
AMD EPYC, where plain eager can win. So after compiling, ``warm_up`` times each
bucket's graph against the eager forward on the same inputs (interleaved pairs,
``host.paired_ratio``) and keeps the one that measured faster (``choices``,
printed by ``describe``). That is a sample taken at start, on whatever else the
machine was doing then: a bucket near a tie can choose differently from one
start to the next.
"""

from __future__ import annotations

import time
import warnings

import torch

from tinyserve.host import paired_ratio
from tinyserve.model import AttentionMetadata, KVCache, LlamaForServing, scratch_decode

# vLLM's default capture sizes start 1, 2, 4, 8, then go in steps of 8; powers of two
# keep the number of graphs (each one a compile and, with freezing, a packed copy of
# the weights) small.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)

# Dynamo keeps its graphs per code object: every engine and every bucket is one more
# entry of LlamaForServing.forward. The default limit (8) would silently send the
# second engine of a notebook back to eager.
MIN_RECOMPILE_LIMIT = 256

# After compiling, keep a bucket's graph only where it beats the eager forward
# (tests of the compiled path itself turn this off).
CHOOSE_FASTER = True
CHOICE_PAIRS = 7     # interleaved eager/graph pairs per bucket: about 14 steps each


def capture_sizes_for(max_num_seqs: int, sizes=CAPTURE_SIZES) -> tuple[int, ...]:
    """The buckets a scheduler running at most ``max_num_seqs`` requests can fill."""
    sizes = tuple(sorted(sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"capture_sizes: need positive batch sizes, got {sizes}")
    needed = tuple(s for s in sizes if s < max_num_seqs)
    return needed + tuple(s for s in sizes if s >= max_num_seqs)[:1]


class CompiledDecode:
    """The model's forward compiled for pure decode batches of each bucket size."""

    def __init__(self, model: LlamaForServing, kv_cache: KVCache, max_blocks_per_seq: int,
                 sizes: tuple[int, ...], scratch_slot: int, mode: str | None = "default"):
        # Imported here, not at the top: the compiler stack costs ~1 s and ~150 MB, and it
        # imports Triton, which must come after tinyserve.kernels chooses its interpreter.
        import torch._dynamo
        import torch._inductor.config

        self.model, self.kv_cache = model, kv_cache
        self.sizes, self.width = tuple(sorted(sizes)), max_blocks_per_seq
        # Padding rows write their K and V here: a slot no request ever owns.
        self.scratch_slot = scratch_slot
        self.device = next(model.parameters()).device
        self.on_cpu = self.device.type == "cpu"
        for option in ("recompile_limit", "cache_size_limit"):   # renamed in torch 2.6
            if hasattr(torch._dynamo.config, option):
                setattr(torch._dynamo.config, option,
                        max(getattr(torch._dynamo.config, option), MIN_RECOMPILE_LIMIT))
        if mode == "default":
            mode = None if self.on_cpu else "reduce-overhead"     # a CUDA graph per bucket
        self.forward = torch.compile(model.forward, dynamic=False, mode=mode)
        # Freezing (CPU): weights become constants, packed once per bucket. One thread in
        # Inductor's own C++ kernels: they are small elementwise loops, and their OpenMP
        # threads, spinning after each loop, would take the cores from the GEMMs'.
        self.inductor_options = {"freezing": True, "cpp.threads": 1} if self.on_cpu else {}
        self.compile_seconds: dict[int, float] = {}
        # bucket -> eager time / graph time measured at start (> 1: the graph is faster)
        self.speedups: dict[int, float] = {}
        self.choices: dict[int, str] = {s: "compiled" for s in self.sizes}
        self.steps_run = 0              # decode steps that ran on a graph
        self.warm_up_seconds = 0.0      # compiling and choosing, at start

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds ``batch`` rows, if its graph is the faster
        path (None: run eagerly)."""
        size = next((s for s in self.sizes if s >= batch), None)
        return size if size is not None and self.choices[size] == "compiled" else None

    def warm_up(self) -> float:
        """Compile every bucket now (padding rows only), then choose per bucket between
        its graph and the eager forward; total compile seconds."""
        started_all = time.perf_counter()
        for size in self.sizes:
            started = time.perf_counter()
            self.run([], [], [], [], [], size)
            self.compile_seconds[size] = time.perf_counter() - started
        if CHOOSE_FASTER:
            for size in self.sizes:
                self.speedups[size] = self.time_against_eager(size)
                self.choices[size] = "compiled" if self.speedups[size] >= 1.0 else "eager"
        self.steps_run = 0
        self.warm_up_seconds = time.perf_counter() - started_all
        return sum(self.compile_seconds.values())

    def time_against_eager(self, size: int, pairs: int = CHOICE_PAIRS) -> float:
        """Eager seconds / graph seconds of one decode step of ``size`` rows, the two
        interleaved (the median of ``pairs`` paired ratios). The eager side is the
        engine's own eager decode path (unpadded metadata, every row sampled), on rows
        that all write to the scratch slot, as the graph's padding rows do."""
        graph_inputs = self.inputs_for([], [], [], [], [], size)
        eager = scratch_decode(self.model, self.kv_cache, size, self.scratch_slot)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        return paired_ratio(eager, lambda: self.replay(graph_inputs), pairs=pairs, sync=sync).median

    def describe(self) -> str:
        """One line: which path each bucket runs, and the speed-up measured at start."""
        parts = [f"B={s}: {self.choices[s]}" + (f" ({self.speedups[s]:.2f}x)" if s in self.speedups else "")
                 for s in self.sizes]
        return "decode step per bucket (eager time / graph time): " + ", ".join(parts)

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], context_lens: list[int], bucket: int) -> torch.Tensor:
        """Logits of the ``len(ids)`` decode rows, computed as a batch of ``bucket``."""
        return self.replay(self.inputs_for(ids, positions, slots, tables, context_lens, bucket))

    def inputs_for(self, ids: list[int], positions: list[int], slots: list[int],
             tables: list[list[int]], context_lens: list[int], bucket: int):
        """The graph's inputs: the rows padded to ``bucket``, the tables to the widest."""
        n, pad = len(ids), bucket - len(ids)
        dev = self.device
        table = torch.zeros(bucket, self.width, dtype=torch.long)
        for row, blocks in enumerate(tables):
            table[row, :len(blocks)] = torch.tensor(blocks)
        lens = torch.tensor(context_lens + [1] * pad, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [self.scratch_slot] * pad, device=dev), query_lens=[],
            context_lens=[], block_tables=table.to(dev), num_decodes=bucket,
            decode_context_lens=lens, padded=True)
        inputs = (torch.tensor(ids + [0] * pad, device=dev),
                  torch.tensor(positions + [0] * pad, device=dev))
        return n, inputs, meta

    def replay(self, graph_inputs) -> torch.Tensor:
        """Run the bucket's graph on ``inputs_for``'s output; the logits of the real rows."""
        n, inputs, meta = graph_inputs
        # Freezing is read when a graph is compiled, and only applies with autograd off
        # where the call is made; patching each call keeps a recompile from silently
        # compiling without it.
        with torch.inference_mode(), torch._inductor.config.patch(self.inductor_options):
            logits = self.forward(*inputs, meta, self.kv_cache, None)
        self.steps_run += 1
        return logits[:n]


def compile_decode(model: LlamaForServing, kv_cache: KVCache, max_blocks_per_seq: int,
                   sizes: tuple[int, ...], scratch_slot: int) -> CompiledDecode | None:
    """A warmed-up ``CompiledDecode``, or None (with one warning) where compiling fails:
    no C++ compiler, a platform or a torch that Inductor does not support."""
    try:
        graphs = CompiledDecode(model, kv_cache, max_blocks_per_seq, sizes, scratch_slot)
        graphs.warm_up()
    except Exception as error:      # any failure of the compiler stack means: run eagerly
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"enforce_eager=False: torch.compile is not available here "
                      f"({type(error).__name__}: {first_line}); running eagerly",
                      RuntimeWarning, stacklevel=3)
        return None
    return graphs
