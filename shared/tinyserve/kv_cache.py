"""Paged KV-cache bookkeeping: which physical block holds which request's tokens.

The cache itself is one big tensor of ``num_blocks`` blocks of ``block_size``
token slots (see ``model.KVCache``). This module never touches it: it only hands
out block ids, keeps each request's block table (logical block i of the request
lives in physical block ``table[i]``) and counts how many requests use each
block. A block goes back to the free pool when its count reaches zero, which is
what lets a shared prefix block be used by several requests and released only
when the last one leaves.

Prefix caching: once a block is full and computed, it gets a hash of its tokens
chained with the previous block's hash, so the hash names the whole prefix up
to that block. A new request whose prompt starts with the same tokens takes the
same blocks (refcount + 1) instead of computing them again. A hashed block whose
refcount drops to zero stays in the free pool with its contents: it can still be
found and reused until it is handed out for something else. The pool hands out
the block that became free longest ago (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block holds a full, computed, cached prefix block.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with refcount 0, oldest-freed first (the front is evicted first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.cached: dict[int, int] = {}            # prefix hash -> block id
        self._num_hashed: dict[str, int] = {}       # request -> leading blocks already hashed
        self.num_queried_tokens = 0                 # prefix-cache statistics
        self.num_hit_tokens = 0

    # ---- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (including cached ones that can still be reused)."""
        return len(self.free_blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_blocks if self.blocks[b].block_hash is not None)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    # ---- prefix caching --------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids``.

        At most ``len - 1`` tokens are matched: the last token must be computed
        to produce logits, even when the whole prompt is cached and block-aligned.
        """
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:   # hash collision
                break
            hits.append(block_id)
            parent = h
        return hits

    def num_blocks_to_claim(self, hits: list[int]) -> int:
        """How many free-pool blocks taking ``hits`` uses up (hits nobody holds right now)."""
        return sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def claim_cached_prefix(self, request_id: str, hits: list[int], num_prompt_tokens: int) -> int:
        """Give a request with no blocks yet the cached blocks ``hits``; return cached tokens."""
        if self.block_tables.get(request_id):
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        self.block_tables[request_id] = list(hits)
        self._num_hashed[request_id] = len(hits)
        cached_tokens = len(hits) * self.block_size
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += cached_tokens
        return cached_tokens

    def has_unhashed_full_blocks(self, request_id: str, num_computed: int) -> bool:
        """Would ``cache_full_blocks`` hash anything? (Cheap; saves building the token list.)"""
        return (self.enable_prefix_caching
                and num_computed // self.block_size > self._num_hashed.get(request_id, 0))

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Hash the request's blocks that are now full and computed, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        table, bs = self.block_tables.get(request_id, []), self.block_size
        start = self._num_hashed.get(request_id, 0)
        full = min(num_computed // bs, len(table))
        parent = self.blocks[table[start - 1]].block_hash if start else None
        for i in range(start, full):
            block = self.blocks[table[i]]
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            # If another request computed the same prefix in the same step, the
            # first copy stays in the cache and this block stays private.
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.parent_hash, block.token_ids = h, parent, tokens
                self.cached[h] = block.block_id
            parent = h
        self._num_hashed[request_id] = max(start, full)

    # ---- allocation ----------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` tokens; return the new block ids."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: request {request_id!r} needs {need}, "
                               f"{self.num_free_blocks} free (the scheduler should have preempted)")
        table = self.block_tables.setdefault(request_id, [])
        new = []
        for _ in range(need):
            block_id, _ = self.free_blocks.popitem(last=False)    # least recently freed
            block = self.blocks[block_id]
            assert block.ref_count == 0
            if block.block_hash is not None:                      # evict its cached prefix
                del self.cached[block.block_hash]
                block.block_hash, block.parent_hash, block.token_ids = None, None, ()
            block.ref_count = 1
            new.append(block_id)
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Drop the request's claim on its blocks; a block is free once nobody holds it."""
        self._num_hashed.pop(request_id, None)
        # Release the tail first: the end of a sequence is the least likely part
        # to be shared, so it should be the first to be evicted.
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} refcount went negative")
            if block.ref_count == 0:
                self.free_blocks[block_id] = None

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is accounted for exactly once."""
        holders: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for block in self.blocks:
            expected = holders.get(block.block_id, 0)
            if block.ref_count != expected:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but {expected} block tables hold it")
            if (block.block_id in self.free_blocks) != (expected == 0):
                raise AssertionError(f"block {block.block_id}: free-pool membership disagrees "
                                     f"with ref_count {block.ref_count}")
            if block.block_hash is not None and self.cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id} is hashed but not in the cache map")
        for h, block_id in self.cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"cache map entry for block {block_id} is stale")
        if len(self.free_blocks) + len(holders) != self.num_blocks:
            raise AssertionError(f"{len(self.free_blocks)} free + {len(holders)} used "
                                 f"!= {self.num_blocks} blocks")
