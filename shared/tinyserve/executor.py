"""Turns a scheduler plan into one forward pass of the real model, and samples.

The scheduler only decides *who* runs for *how many tokens*; this module lays
those tokens end to end in flat tensors (ids, positions, cache slots), runs the model
once and picks one token for every request whose prompt is fully in the cache.
"""

from __future__ import annotations

import contextlib
import time

import torch

from tinyserve import packed_gemm, sampler
from tinyserve.compiled_step import CAPTURE_SIZES, compile_decode
from tinyserve.host import keep_freed_memory
from tinyserve.kv_cache import blocks_for
from tinyserve.model import AttentionMetadata, KVCache, LlamaForServing
from tinyserve.request import SEED_MODULUS, SamplingParams
from tinyserve.sampler import stable_seed, token_logprobs
from tinyserve.scheduler import ScheduledRequest, SchedulerOutput


class ModelExecutor:
    """Runs the model on the scheduler's plans. ``enforce_eager=True``: plain eager
    PyTorch. Otherwise, on a CPU whose oneDNN packs the weights' dtype, every step
    runs on weights packed once for oneDNN (``packed_gemm``; one copy of the weights):
    ``enforce_eager=False`` pins that, ``None`` keeps it only if it measured faster
    than eager in some batch bucket at start. Elsewhere ``False`` compiles pure decode
    steps of up to ``max(capture_sizes)`` requests into graphs (``compiled_step``),
    each bucket kept where it measured faster, and ``None`` runs eagerly."""

    def __init__(self, model: LlamaForServing, num_blocks: int, block_size: int, seed: int = 0,
                 vocab_size: int | None = None, enforce_eager: bool | None = True,
                 max_blocks_per_seq: int | None = None,
                 capture_sizes: tuple[int, ...] = CAPTURE_SIZES):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        packs = enforce_eager is not True and packed_gemm.supported(model)
        compiles = enforce_eager is False and not packs
        # Compiled graphs pad their batches, and timed steps at start write somewhere: to
        # one extra block that the block manager never hands out.
        scratch_blocks = 1 if packs or compiles else 0
        self.kv_cache = KVCache(model.config, num_blocks + scratch_blocks, block_size, self.dtype,
                                self.device)
        self.seed = seed
        # Sample among the first vocab_size ids only (the tokenizer's; None: all rows).
        self.vocab_size = vocab_size
        self._generators: dict[str, torch.Generator] = {}
        # None: a sampling fault raises (offline); a dict: see isolate_sample_failures.
        self.sample_failures: dict[str, Exception] | None = None
        self.last_prepare_time = 0.0
        self.graphs = None                  # compiled_step.CompiledDecode
        self.packed = None                  # packed_gemm.PackedDecode
        scratch_slot = num_blocks * block_size
        if packs:
            self.packed = packed_gemm.PackedDecode(model, self.kv_cache, scratch_slot,
                                                   choose=enforce_eager is None)
            self.packed.warm_up()
        elif compiles:
            width = max_blocks_per_seq or blocks_for(model.config.max_position_embeddings,
                                                     block_size)
            self.graphs = compile_decode(model, self.kv_cache, width, capture_sizes, scratch_slot)
        if self.device.type == "cpu":
            keep_freed_memory()         # after start-up's trim: steps reuse what steps free

    @property
    def enforce_eager(self) -> bool:
        """False only while packed weights or compiled graphs are in use (a failed
        compile falls back; packing measured slower everywhere is dropped)."""
        return self.graphs is None and (self.packed is None or self.packed.weights is None)

    @property
    def decode_path(self):
        """What speeds up decode steps: ``PackedDecode``, ``CompiledDecode`` or None."""
        return self.packed or self.graphs

    def execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """Run one step; return the sampled token of each request that emits one."""
        self.last_prepare_time = 0.0
        if plan.is_empty:
            return {}
        started = time.perf_counter()
        # Decodes first: the model attends over all of them in one batched call.
        items = sorted(plan.scheduled, key=lambda s: not s.is_decode)
        ids, positions, slots, sample_rows, sample_items = [], [], [], [], []
        bs = self.block_size
        for item in items:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            ids.extend(item.request.token_ids_between(start, end))   # no prompt+output copy
            positions.extend(range(start, end))
            table = item.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                sample_rows.append(len(ids) - 1)
                sample_items.append(item)

        bucket = self._bucket(items)
        if bucket is not None:
            graph_inputs = self.graphs.inputs_for(ids, positions, slots,
                                                  [i.block_table for i in items],
                                                  [i.request.num_computed_tokens + 1 for i in items],
                                                  bucket)
            self.last_prepare_time = time.perf_counter() - started
            return self._sample(self.graphs.replay(graph_inputs), sample_items)
        meta = self._metadata(items, slots)
        dev = self.device
        token_ids = torch.tensor(ids, device=dev)
        token_positions = torch.tensor(positions, device=dev)
        logits_rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        # Host-side layout time: bookkeeping, not model work.
        self.last_prepare_time = time.perf_counter() - started
        weights = (self.packed.weights_for(decode=self._pure_decode(items))
                   if self.packed is not None else None)
        logits = self.model(token_ids, token_positions, meta, self.kv_cache, logits_rows,
                            packed=weights)
        return self._sample(logits, sample_items)

    @staticmethod
    def _pure_decode(items: list[ScheduledRequest]) -> bool:
        return all(i.is_decode and i.samples for i in items)

    def _bucket(self, items: list[ScheduledRequest]) -> int | None:
        """The compiled graph a step runs on: only pure decode steps that fit one."""
        if self.graphs is None or not self._pure_decode(items):
            return None
        return self.graphs.bucket(len(items))

    def _metadata(self, items: list[ScheduledRequest], slots: list[int]) -> AttentionMetadata:
        max_blocks = max(len(item.block_table) for item in items)
        tables = torch.zeros(len(items), max_blocks, dtype=torch.long)
        for row, item in enumerate(items):
            tables[row, :len(item.block_table)] = torch.tensor(item.block_table)
        context_lens = [i.request.num_computed_tokens + i.num_new_tokens for i in items]
        num_decodes = sum(1 for i in items if i.is_decode)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            query_lens=[i.num_new_tokens for i in items],
            context_lens=context_lens,
            block_tables=tables.to(self.device),
            num_decodes=num_decodes,
            decode_context_lens=torch.tensor(context_lens[:num_decodes], device=self.device),
        )

    # ---- sampling --------------------------------------------------------------

    def isolate_sample_failures(self) -> None:
        """From now on a request whose sampling raises does not fail the step: the
        exception is kept for ``take_sample_failures``, the request gets its greedy token
        as a placeholder so the step completes for everyone, and the caller (the server,
        ``serving.engine_loop``) fails that request alone. Offline, a fault raises."""
        if self.sample_failures is None:
            self.sample_failures = {}

    def take_sample_failures(self) -> dict[str, Exception]:
        """The requests whose sampling raised since the last call (request id -> error)."""
        failures = self.sample_failures or {}
        if self.sample_failures is not None:
            self.sample_failures = {}
        return failures

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> dict[str, int]:
        logits = logits[:, :self.vocab_size]
        tokens = sampler.greedy(logits)
        rows = [r for r, item in enumerate(items) if not item.request.sampling_params.greedy]
        if rows:
            for row, token in zip(rows, self._draw(logits, [items[r].request for r in rows], rows)):
                tokens[row] = token
        for row, item in enumerate(items):
            params = item.request.sampling_params
            if params.logprobs is not None:
                item.request.logprobs.append(token_logprobs(logits[row], tokens[row],
                                                            params.logprobs))
        return {item.request.request_id: token for item, token in zip(items, tokens)}

    def _draw(self, logits: torch.Tensor, requests: list, rows: list[int]) -> list[int]:
        """The sampled tokens of ``rows`` (non-greedy requests), in one batched call; if
        it raises while failures are isolated, row by row, so that only the faulty
        requests fail (each keeps its greedy token as a placeholder)."""
        params = [r.sampling_params for r in requests]
        generators = [self._generator(r.request_id, r.sampling_params) for r in requests]
        try:
            return sampler.sample(logits[rows], params, generators)
        except Exception:
            if self.sample_failures is None:
                raise
        tokens = []
        for row, request, p, generator in zip(rows, requests, params, generators):
            try:
                tokens.append(sampler.sample(logits[row:row + 1], [p], [generator])[0])
            except Exception as exc:
                self.sample_failures[request.request_id] = exc
                tokens.append(int(logits[row].argmax()))
        return tokens

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        # One generator per request, so a request's random draws do not depend on
        # which other requests share its batches.
        if request_id not in self._generators:
            seed = params.seed if params.seed is not None else stable_seed(self.seed, request_id)
            # torch takes 64 bits: any integer seed is reduced into range.
            self._generators[request_id] = torch.Generator(device="cpu").manual_seed(
                seed % SEED_MODULUS)
        return self._generators[request_id]

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def dense_weights(self):
        """A context in which the model holds dense weights (packed ones are unpacked
        for its duration): for saving a checkpoint."""
        if self.packed is not None and self.packed.weights is not None:
            return self.packed.weights.unpacked()
        return contextlib.nullcontext(self.model)

