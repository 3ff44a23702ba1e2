"""Paged KV-cache bookkeeping: which physical block holds which request's tokens.

The cache itself is one big tensor of ``num_blocks`` blocks of ``block_size``
token slots (see ``model.KVCache``). This module never touches it: it only hands
out block ids, keeps each request's block table (logical block i of the request
lives in physical block ``table[i]``) and counts how many requests use each
block. A block goes back to the free list when its count reaches zero, which is
what lets a shared prefix block be used by several requests and released only
when the last one leaves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of the tokens in this (full) block and all blocks before it; set by
    # prefix caching so that a later request with the same prefix can find it.
    block_hash: int | None = None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    # ---- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    # ---- changes ---------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` tokens; return the new block ids."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: request {request_id!r} needs {need}, "
                               f"{self.num_free_blocks} free (the scheduler should have preempted)")
        table = self.block_tables.setdefault(request_id, [])
        new = []
        for _ in range(need):
            block = self.blocks[self.free_block_ids.popleft()]
            assert block.ref_count == 0
            block.ref_count = 1
            new.append(block.block_id)
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Drop the request's claim on its blocks; a block is free once nobody holds it."""
        # Release the tail first: if these blocks were ever cached, the end of a
        # sequence is the least likely part to be shared, so it should be evicted first.
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} refcount went negative")
            if block.ref_count == 0:
                block.block_hash = None
                self.free_block_ids.append(block_id)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is accounted for exactly once."""
        holders: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        free = list(self.free_block_ids)
        free_set = set(free)
        if len(free) != len(free_set):
            raise AssertionError("a block appears twice in the free list")
        for block in self.blocks:
            expected = holders.get(block.block_id, 0)
            if block.ref_count != expected:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but {expected} block tables hold it")
            if (block.block_id in free_set) != (expected == 0):
                raise AssertionError(f"block {block.block_id}: free-list membership disagrees "
                                     f"with ref_count {block.ref_count}")
        if len(free) + len(holders) != self.num_blocks:
            raise AssertionError(f"{len(free)} free + {len(holders)} used != {self.num_blocks} blocks")
