"""What naming a prefix-cache block costs: nanoseconds per block for Python's built-in
``hash`` (what ``kv_cache`` chained before, and a client can search for a collision
of) against sha256 and blake2b over (parent digest, token ids as little-endian
uint32), and ``kv_cache.chain_hash`` itself.

    python -m tinyserve.bench prefix-hash --block-size 16

A block is hashed once per ``block_size`` prompt tokens looked up or computed, so
the cost per token is the cost per block divided by the block size.
"""

from __future__ import annotations

import hashlib
import random
import struct
import timeit

from tinyserve.host import cpu_name, usable_cores
from tinyserve.kv_cache import chain_hash


def variants(block_size: int) -> dict:
    """name -> (hash of a block given its parent's, the first block's parent)."""
    pack = struct.Struct(f"<{block_size}I").pack
    return {
        "builtin hash (before)": (lambda parent, tokens: hash((parent, tokens)), None),
        "sha256": (lambda parent, tokens: hashlib.sha256(parent + pack(*tokens)).digest(), b""),
        "blake2b (64-byte digest)": (lambda parent, tokens: hashlib.blake2b(
            parent + pack(*tokens)).digest(), b""),
        "kv_cache.chain_hash (now)": (chain_hash, None),
    }


def ns_per_block(fn, root, blocks: list[tuple[int, ...]], repeats: int) -> float:
    """Best of ``repeats`` passes over one chain of ``blocks``, each on its parent's hash."""
    def chain():
        parent = root
        for tokens in blocks:
            parent = fn(parent, tokens)
    return min(timeit.repeat(chain, number=1, repeat=repeats)) / len(blocks) * 1e9


def add_arguments(parser) -> None:
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096, help="blocks in the chain")
    parser.add_argument("--repeats", type=int, default=7, help="passes; the fastest counts")


def main(args) -> dict[str, float]:
    rng = random.Random(0)
    blocks = [tuple(rng.randrange(152_000) for _ in range(args.block_size))
              for _ in range(args.num_blocks)]
    results = {name: ns_per_block(fn, root, blocks, args.repeats)
               for name, (fn, root) in variants(args.block_size).items()}
    print(f"prefix-cache block hash, block_size={args.block_size}, a chain of "
          f"{args.num_blocks} blocks, fastest of {args.repeats} passes; "
          f"{cpu_name()}, {usable_cores()} cores")
    print(f"{'':28}{'ns/block':>10}{'ns/token':>10}")
    for name, ns in results.items():
        print(f"{name:28}{ns:>10.0f}{ns / args.block_size:>10.1f}")
    return results
