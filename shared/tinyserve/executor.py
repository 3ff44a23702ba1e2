"""Turns a scheduler plan into one forward pass of the real model, and samples.

The scheduler only decides *who* runs for *how many tokens*; this module packs
those tokens into flat tensors (ids, positions, cache slots), runs the model
once and picks one token for every request whose prompt is fully in the cache.
"""

from __future__ import annotations

import hashlib
import time

import torch

from tinyserve import packed_gemm
from tinyserve.compiled_step import CAPTURE_SIZES, compile_decode
from tinyserve.kv_cache import blocks_for
from tinyserve.model import AttentionMetadata, KVCache, LlamaForServing
from tinyserve.request import SEED_MODULUS, SamplingParams
from tinyserve.scheduler import ScheduledRequest, SchedulerOutput


class ModelExecutor:
    """``enforce_eager=False`` runs pure decode steps of up to ``max(capture_sizes)``
    requests faster: on a CPU (fp32) on weights packed once for oneDNN
    (``packed_gemm``), elsewhere through compiled graphs (``compiled_step``), in each
    bucket only where that measured faster at start. Everything else, and every step
    where neither is possible, runs eagerly."""

    def __init__(self, model: LlamaForServing, num_blocks: int, block_size: int, seed: int = 0,
                 vocab_size: int | None = None, enforce_eager: bool = True,
                 max_blocks_per_seq: int | None = None,
                 capture_sizes: tuple[int, ...] = CAPTURE_SIZES):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        # Compiled graphs pad their batches; the padding writes to one extra block that the
        # block manager never hands out.
        scratch_blocks = 0 if enforce_eager else 1
        self.kv_cache = KVCache(model.config, num_blocks + scratch_blocks, block_size, self.dtype,
                                self.device)
        self.seed = seed
        # Sample among the first vocab_size ids only (the tokenizer's; None: all rows).
        self.vocab_size = vocab_size
        self._generators: dict[str, torch.Generator] = {}
        self.last_prepare_time = 0.0
        self.graphs = None                  # compiled_step.CompiledDecode
        self.packed = None                  # packed_gemm.PackedDecode
        scratch_slot = num_blocks * block_size
        if not enforce_eager and packed_gemm.supported(model):
            self.packed = packed_gemm.PackedDecode(model, self.kv_cache, capture_sizes, scratch_slot)
            self.packed.warm_up()
        elif not enforce_eager:
            width = max_blocks_per_seq or blocks_for(model.config.max_position_embeddings,
                                                     block_size)
            self.graphs = compile_decode(model, self.kv_cache, width, capture_sizes, scratch_slot)

    @property
    def enforce_eager(self) -> bool:
        """False only while packed weights or compiled graphs are in use (a failed
        compile falls back)."""
        return self.graphs is None and self.packed is None

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
            packed = self.graphs.pack(ids, positions, slots, [i.block_table for i in items],
                                      [i.request.num_computed_tokens + 1 for i in items], bucket)
            self.last_prepare_time = time.perf_counter() - started
            return self._sample(self.graphs.replay(packed), sample_items)
        meta = self._metadata(items, slots)
        dev = self.device
        inputs = (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                  torch.tensor(sample_rows, dtype=torch.long, device=dev))
        # Host-side packing time: bookkeeping, not model work.
        self.last_prepare_time = time.perf_counter() - started
        packed = (self.packed.use_for(len(items))
                  if self.packed is not None and self._pure_decode(items) else None)
        logits = self.model(inputs[0], inputs[1], meta, self.kv_cache, inputs[2], packed=packed)
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

    # None (offline use): a request whose sampling raises fails the step. A dict (the
    # server sets one, serving.engine_loop): the exception is recorded under the
    # request's id, the request gets its greedy token as a placeholder so the step
    # completes for everyone, and the caller fails that request alone.
    sample_failures: dict[str, Exception] | None = None

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> dict[str, int]:
        logits = logits[:, :self.vocab_size]
        greedy = logits.argmax(dim=-1).tolist()
        result = {}
        for row, item in enumerate(items):
            request = item.request
            try:
                result[request.request_id] = self._sample_one(logits[row], request, greedy[row])
            except Exception as exc:
                if self.sample_failures is None:
                    raise
                self.sample_failures[request.request_id] = exc
                result[request.request_id] = greedy[row]
        return result

    def _sample_one(self, logits: torch.Tensor, request, greedy_token: int) -> int:
        params = request.sampling_params
        if params.greedy:
            token = greedy_token
        else:
            token = sample_token(logits, params, self._generator(request.request_id, params))
        if params.logprobs is not None:
            request.logprobs.append(token_logprobs(logits, token, params.logprobs))
        return token

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


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p (nucleus), then one multinomial draw."""
    logits = logits.float().cpu() / params.temperature
    if params.top_k != -1 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The most likely token is
        # always kept: a top_p below float32's range (1e-300) rounds to 0, and the
        # comparison alone would then drop every token.
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"sampling at temperature {params.temperature!r} gave non-finite "
                         "probabilities")
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` and the ``top`` most likely (id, log-probability)
    pairs, under the model's own distribution (before temperature, top-k, top-p)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token])
    if top == 0:
        return chosen, []
    values, ids = torch.topk(logp, min(top, logp.numel()))
    return chosen, list(zip(ids.tolist(), values.tolist()))


def stable_seed(engine_seed: int, request_id: str) -> int:
    """A per-request seed that is the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
