"""Turns a scheduler plan into one forward pass of the real model, and samples.

The scheduler only decides *who* runs for *how many tokens*; this module packs
those tokens into flat tensors (ids, positions, cache slots), runs the model
once and picks one token for every request whose prompt is fully in the cache.
"""

from __future__ import annotations

import hashlib
import time

import torch

from tinyserve.model import AttentionMetadata, KVCache, LlamaForServing
from tinyserve.request import SamplingParams
from tinyserve.scheduler import ScheduledRequest, SchedulerOutput


class ModelExecutor:
    def __init__(self, model: LlamaForServing, num_blocks: int, block_size: int, seed: int = 0,
                 vocab_size: int | None = None):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.kv_cache = KVCache(model.config, num_blocks, block_size, self.dtype, self.device)
        self.seed = seed
        # Sample among the first vocab_size ids only (the tokenizer's; None: all rows).
        self.vocab_size = vocab_size
        self._generators: dict[str, torch.Generator] = {}
        self.last_prepare_time = 0.0

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

        meta = self._metadata(items, slots)
        dev = self.device
        inputs = (torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                  torch.tensor(sample_rows, dtype=torch.long, device=dev))
        # Host-side packing time: bookkeeping, not model work.
        self.last_prepare_time = time.perf_counter() - started
        logits = self.model(inputs[0], inputs[1], meta, self.kv_cache, inputs[2])
        return self._sample(logits, sample_items)

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

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest]) -> dict[str, int]:
        logits = logits[:, :self.vocab_size]
        greedy = logits.argmax(dim=-1).tolist()
        result = {}
        for row, item in enumerate(items):
            request = item.request
            params = request.sampling_params
            if params.greedy:
                result[request.request_id] = greedy[row]
            else:
                gen = self._generator(request.request_id, params)
                result[request.request_id] = sample_token(logits[row], params, gen)
        return result

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        # One generator per request, so a request's random draws do not depend on
        # which other requests share its batches.
        if request_id not in self._generators:
            seed = params.seed if params.seed is not None else stable_seed(self.seed, request_id)
            self._generators[request_id] = torch.Generator(device="cpu").manual_seed(seed)
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
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def stable_seed(engine_seed: int, request_id: str) -> int:
    """A per-request seed that is the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
