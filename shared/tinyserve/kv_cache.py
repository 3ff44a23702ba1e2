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
to that block. The hash is sha256 (``chain_hash``), not Python's ``hash``: a
client who found two prompts with one 64-bit hash would be handed the other
prompt's KV, and with ``hash`` such a pair can be searched for. A new request whose prompt starts with the same tokens takes the
same blocks (refcount + 1) instead of computing them again. A hashed block whose
refcount drops to zero stays in the free pool with its contents: it can still be
found and reused until it is handed out for something else. The pool hands out
the block that became free longest ago (LRU eviction).

Invariants (``check_integrity`` checks every one):

* every block is either in the free pool (refcount 0) or held, refcount =
  the number of block tables holding it, so free + held = total;
* a request's hashed blocks form one chain: its first block's parent is
  ``None`` and block i's parent is block i-1's hash. The chain hash is kept per
  request, so a block's hash never depends on whether its parent block was the
  cached copy or a private one;
* every cached block's parent prefix is itself cached (or it is a first block):
  whatever a lookup can reach was computed at the positions its hash names.

Two requests that compute the same prefix in the same step produce two copies
of the same block; both are cached under the one hash, and a lookup takes the
first. Evicting one copy leaves the other reachable.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block holds a full, computed, cached prefix block.
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent block's digest (none for a first block) and the block's
    token ids as little-endian uint32: a digest is always 32 bytes and a block always
    ``block_size`` tokens, so no two (parent, tokens) pairs give the same bytes.
    What it costs a block on this machine, against Python's ``hash``, is printed by
    ``python -m tinyserve.bench prefix-hash``."""
    data = (parent_hash or b"") + _uint32_packer(len(token_ids))(*token_ids)
    return hashlib.sha256(data).digest()


@functools.cache
def _uint32_packer(n: int):
    # A compiled Struct per length: building the format string every call doubled the cost.
    return struct.Struct(f"<{n}I").pack


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
        self.cached: dict[bytes, list[int]] = {}    # prefix hash -> block ids holding it
        # request -> (leading blocks already hashed, hash of the last of them)
        self._chain: dict[str, tuple[int, bytes | None]] = {}
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

    def cached_block_ids(self) -> list[int]:
        """Every block that holds a cached prefix block, held or free, in id order."""
        return sorted(b for ids in self.cached.values() for b in ids)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    # ---- prefix caching --------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int],
                           hashes: list[bytes] | None = None) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids``.

        At most ``len - 1`` tokens are matched: the last token must be computed
        to produce logits, even when the whole prompt is cached and block-aligned.

        ``hashes``: the chain hashes of the first blocks of ``token_ids`` that an
        earlier lookup computed, extended here in place as far as this lookup reads.
        A request that waits step after step (the head of the queue while the cache
        is full) passes its own list, so each of its blocks is hashed once.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = [] if hashes is None else hashes
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            if i == len(hashes):
                hashes.append(chain_hash(parent, tokens))
            h = hashes[i]
            block_id = next((b for b in self.cached.get(h, ())
                             if self.blocks[b].token_ids == tokens       # not a hash collision
                             and self.blocks[b].parent_hash == parent), None)
            if block_id is None:
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
        self._chain[request_id] = (len(hits), self.blocks[hits[-1]].block_hash if hits else None)
        cached_tokens = len(hits) * self.block_size
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += cached_tokens
        return cached_tokens

    def cache_full_blocks(self, request_id: str, num_computed: int,
                          token_ids_between: Callable[[int, int], Sequence[int]]) -> None:
        """Hash the request's blocks that are now full and computed, so others can reuse them.

        ``token_ids_between(start, end)`` returns the request's tokens at positions
        [start, end); only newly full blocks are read, so a step costs O(new tokens).
        """
        if not self.enable_prefix_caching:
            return
        table, bs = self.block_tables.get(request_id, []), self.block_size
        start, parent = self._chain.get(request_id, (0, None))
        full = min(num_computed // bs, len(table))
        for i in range(start, full):
            block = self.blocks[table[i]]
            if block.block_hash is not None:
                raise AssertionError(f"block {block.block_id} of request {request_id!r} "
                                     f"is hashed twice")
            tokens = tuple(token_ids_between(i * bs, (i + 1) * bs))
            h = chain_hash(parent, tokens)
            block.block_hash, block.parent_hash, block.token_ids = h, parent, tokens
            self.cached.setdefault(h, []).append(block.block_id)
            parent = h
        if full > start:
            self._chain[request_id] = (full, parent)

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
                self._uncache(block)
            block.ref_count = 1
            new.append(block_id)
        table.extend(new)
        return new

    def _uncache(self, block: Block) -> None:
        copies = self.cached[block.block_hash]
        copies.remove(block.block_id)
        if not copies:
            del self.cached[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def free(self, request_id: str) -> None:
        """Drop the request's claim on its blocks; a block is free once nobody holds it."""
        self._chain.pop(request_id, None)
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
            if block.block_hash is not None:
                if block.block_id not in self.cached.get(block.block_hash, ()):
                    raise AssertionError(f"block {block.block_id} is hashed but not in the cache map")
                if block.block_hash != chain_hash(block.parent_hash, block.token_ids):
                    raise AssertionError(f"block {block.block_id}: its hash is not the hash of "
                                         f"its parent and tokens")
                if block.parent_hash is not None and block.parent_hash not in self.cached:
                    raise AssertionError(f"block {block.block_id} is cached but its parent prefix "
                                         f"is not: a lookup would reach KV of other positions")
        for h, ids in self.cached.items():
            if not ids or any(self.blocks[b].block_hash != h for b in ids):
                raise AssertionError(f"cache map entry {h.hex()} is stale: blocks {ids}")
        for request_id, (num_hashed, last_hash) in self._chain.items():
            self._check_chain(request_id, num_hashed, last_hash)
        if len(self.free_blocks) + len(holders) != self.num_blocks:
            raise AssertionError(f"{len(self.free_blocks)} free + {len(holders)} used "
                                 f"!= {self.num_blocks} blocks")

    def _check_chain(self, request_id: str, num_hashed: int, last_hash: bytes | None) -> None:
        """The request's first ``num_hashed`` blocks are cached, each chained to the one before."""
        table, parent = self.block_tables.get(request_id, []), None
        if num_hashed > len(table):
            raise AssertionError(f"request {request_id!r}: {num_hashed} hashed blocks "
                                 f"but only {len(table)} in its table")
        for i, block_id in enumerate(table[:num_hashed]):
            block = self.blocks[block_id]
            if block.block_hash is None or block.parent_hash != parent:
                raise AssertionError(f"request {request_id!r}: block {i} (id {block_id}) is not "
                                     f"chained to block {i - 1}'s hash")
            parent = block.block_hash
        if parent != last_hash:
            raise AssertionError(f"request {request_id!r}: chain hash disagrees with its blocks")
