"""Decode attention over the paged KV cache in C, for CPUs (``cpu_attention.c``).

A decode row's attention is tiny arithmetic (one query against a few hundred cached
tokens), so on a CPU torch's path costs what its ops cost to launch: gather each
request's blocks into a dense copy, build a padding mask, upcast, attend, cast back
(about 0.1 ms a layer at B=1 on an AMD EPYC Zen 3, several times the arithmetic).
The kernel reads each key and value where it lies in the cache, through the block
table, in one pass: the paged attention of the chapter, on a CPU. Sums and softmax
in fp32 for fp32 and bf16 caches alike; bf16 results are rounded once.

Before it, every step writes its new tokens' keys and values into their cache slots,
keys and queries turned by their positions first (rotary embedding). torch does that in
about ten ops a layer (cat, negate, two products, a sum, a split, two index copies);
``rotate_and_store`` does it in one pass, for prefill chunks and decode rows alike.

``native`` compiles it at first use; where it cannot, ``available()`` is False and
``model.decode_attention`` keeps torch's path. ``TINYSERVE_CPU_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tinyserve import native

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (``native.load``), None where it cannot be built."""
    lib = native.load("cpu_attention")
    if lib is not None:
        lib.decode_attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int]
                                         + [ctypes.c_long] * 7 + [ctypes.c_float])
        lib.decode_attention.restype = ctypes.c_int
        lib.rotate_and_store.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
                                         + [ctypes.c_void_p] * 6 + [ctypes.c_int]
                                         + [ctypes.c_long] * 5)
        lib.rotate_and_store.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``decode`` and ``rotate_and_store`` take these: CPU tensors of one dtype they
    know, the kernel built."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and k_cache.dtype == q.dtype
            and available())


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, Hq, D]``: row b of ``q [B, Hq, D]`` attends over the first ``context_lens[b]``
    tokens of its blocks ``block_tables[b]`` in ``k_cache``/``v_cache
    [blocks, block_size, Hkv, D]`` (Hq a multiple of Hkv). Needs ``supports``."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [B, Hq, D] and both caches [blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    blocks, block_size, hkv, _ = k_cache.shape
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q's {hq} heads of {d} must be a multiple of the caches' {hkv} heads "
                         f"of {k_cache.shape[3]}")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables [{b}, W] and context_lens [{b}] expected, got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    lib = library()
    if lib is None:
        raise RuntimeError("the attention kernel is not built here (cpu_attention.available() is False)")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty_like(q)
    if not b:
        return out
    code = lib.decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                q.dtype == torch.bfloat16, b, hq, hkv, d, blocks, block_size,
                                tables.shape[1], scale)
    if code == -2:
        raise ValueError(f"context_lens must be 1..{tables.shape[1] * block_size} "
                         f"(the tables' width x block_size), got {lens.tolist()}")
    if code == -3:
        raise ValueError(f"block_tables must hold block ids 0..{blocks - 1} where the contexts reach")
    if code:
        raise MemoryError(f"cpu_attention: no memory for the scores of contexts {lens.tolist()}")
    return out


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> torch.Tensor:
    """``model.apply_rotary_qk`` then ``model.write_kv`` in one pass: returns q [T, Hq, D]
    turned by the positions of ``cos``, ``sin [T, D]``; k [T, Hkv, D] turned and v as it is
    are written to slot ``slot_mapping[t]`` of ``k_cache``, ``v_cache [blocks, block_size,
    Hkv, D]``. q, k and v may be slices of one GEMM's output (a token's heads contiguous).
    Needs ``supports(q, k_cache)`` and every tensor of q's dtype."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if (k.shape != (t, hkv, d) or v.shape != k.shape or k_cache.shape[3] != d or v_cache.shape != k_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"q [T, Hq, D], k and v [T, Hkv, D] and both caches [blocks, block_size, Hkv, D], "
                         f"contiguous, expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if d % 2 or cos.shape != (t, d) or sin.shape != (t, d) or slot_mapping.shape != (t,):
        raise ValueError(f"an even head size, cos and sin [{t}, {d}] and slot_mapping [{t}] expected, got "
                         f"D={d}, {tuple(cos.shape)}, {tuple(sin.shape)} and {tuple(slot_mapping.shape)}")
    if any(x.dtype != q.dtype for x in (k, v, cos, sin, v_cache)):
        raise ValueError(f"every tensor must be {q.dtype}, as q")
    lib = library()
    if lib is None:
        raise RuntimeError("the attention kernel is not built here (cpu_attention.available() is False)")
    # A token's heads must lie together; the tokens may be a GEMM row apart.
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (q, k, v))
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slot_mapping.to(torch.int64).contiguous()
    rotated = torch.empty(t, hq, d, dtype=q.dtype)
    code = lib.rotate_and_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0),
                                v.stride(0), cos.data_ptr(), sin.data_ptr(), rotated.data_ptr(),
                                k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                q.dtype == torch.bfloat16, t, hq, hkv, d,
                                k_cache.shape[0] * k_cache.shape[1])
    if code == -2:
        raise ValueError(f"slot_mapping must hold slots 0..{k_cache.shape[0] * k_cache.shape[1] - 1}, "
                         f"got {slots.tolist()}")
    return rotated
