"""Decode attention over a paged KV cache.

One new query token per request attends over that request's cached tokens,
which sit in fixed-size blocks scattered through the cache; the block table
says which. Layouts are the model's (``tinyserve.model.KVCache``, one layer):

- ``q``            [B, Hq, D]
- ``k_cache``      [num_blocks, block_size, Hkv, D] (same for ``v_cache``)
- ``block_tables`` [B, max_blocks] int32 (int64 works too), padded with any valid id
- ``context_lens`` [B] int32 (int64 works too): tokens to attend over, >= 1
- query head ``h`` reads KV head ``h // (Hq // Hkv)`` (grouped-query attention)

The torch version is what an eager model does: copy the blocks into a dense
tensor, materialise the scores, softmax them, multiply by V. The Triton
version walks the block table inside the kernel and keeps a running
("online") softmax, so K and V are read once, straight from their blocks, and
no score ever reaches memory (FlashAttention's idea). For long contexts it
splits each request's tokens over several programs, as flash-decoding does,
so that a small batch still fills the GPU; a second small kernel merges the
partial results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyserve.kernels.triton_setup import (HAS_TRITON, cdiv, check_device, interpreting,
                                             next_power_of_2, require_triton, tl, triton)
from tinyserve.kernels.accounting import Step, check_variant, elem_size


def _check_shapes(q, k_cache, v_cache, block_tables, context_lens):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention: need q [B, Hq, D] and caches [blocks, block_size, Hkv, D]; "
                         f"got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"paged attention: head_dim {d} vs {k_cache.shape[3]}, "
                         f"{hq} query heads not a multiple of {hkv} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or tuple(context_lens.shape) != (b,):
        raise ValueError(f"paged attention: block_tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must have {b} rows")


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Eager reference: gather K and V into dense tensors, then attend (scores in memory).

    Every copy is explicit, so each is one of the steps that
    :func:`paged_decode_attention_steps` counts (none hides inside a matmul).
    """
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens)
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    max_ctx = int(context_lens.max())
    nb = cdiv(max_ctx, block_size)
    # Gather: copy each request's blocks into a dense [B, nb * bs, Hkv, D] tensor,
    # then copy again to put heads before tokens, [B, Hkv, S, D], as matmul needs.
    # (tinyserve.model.gather_kv does the first copy; it is not imported, so that
    # the model can import this module.)
    tables = block_tables[:, :nb]
    keys = k_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2).contiguous()
    values = v_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2).contiguous()
    # The G query heads that share a KV head side by side: [B, Hkv, G, D].
    qg = (q * scale).view(b, hkv, g, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2))             # [B, Hkv, G, S]
    positions = torch.arange(max_ctx, device=q.device)
    padding = positions[None, :] >= context_lens[:, None]         # [B, S]
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)                             # [B, Hkv, G, D]
    return out.view(b, hq, d)


def paged_decode_attention_steps(variant: str, context_lens: Sequence[int], num_heads: int,
                                 num_kv_heads: int, head_dim: int,
                                 dtype: torch.dtype = torch.float16, block_size: int = 16,
                                 index_dtype: torch.dtype = torch.int32,
                                 num_splits: int = 1) -> list[Step]:
    """Bytes of each kernel for one decode step of ``len(context_lens)`` requests.

    ``index_dtype``: dtype of ``block_tables`` and ``context_lens``.
    ``num_splits`` (fused only): programs per (request, KV head); more than one
    adds the partial results written by the first kernel and read by the merge.
    """
    variant = check_variant(variant)
    ctx = [int(c) for c in context_lens]
    b, hq, hkv, d = len(ctx), num_heads, num_kv_heads, head_dim
    e, ei, f32, i64 = elem_size(dtype), elem_size(index_dtype), 4, 8
    q_bytes = b * hq * d * e
    if variant == "fused":
        used_blocks = sum(cdiv(c, block_size) for c in ctx)
        kv = 2 * sum(ctx) * hkv * d * e                     # every cached token, K and V, once
        if num_splits == 1:
            return [Step("paged attention (fused)", q_bytes + used_blocks * ei + b * ei + kv, q_bytes)]
        partial = b * hq * num_splits * (d + 2) * f32         # acc, running max, running sum
        return [Step("paged attention, split (fused)",
                     q_bytes + used_blocks * ei + b * ei + kv, partial),
                Step("merge splits", partial, q_bytes)]
    s = max(ctx)
    nb = cdiv(s, block_size)
    gathered = b * nb * block_size * hkv * d * e              # whole blocks are copied
    dense = b * s * hkv * d * e                               # what the matmuls read
    scores = b * hq * s
    steps = [
        Step("context_lens.max()", b * ei, ei),
        Step("gather K", b * nb * ei + gathered, gathered),
        Step("gather V", b * nb * ei + gathered, gathered),
        Step("K heads first", dense, dense),
        Step("V heads first", dense, dense),
        Step("q * scale", q_bytes, q_bytes),
        Step("q @ K^T", q_bytes + dense, scores * e),
        Step("arange", 0, s * i64),
        Step("padding mask", s * i64 + b * ei, b * s),
        Step("masked_fill", scores * e + b * s, scores * e),
    ]
    if dtype != torch.float32:
        steps.append(Step(".float()", scores * e, scores * f32))
    steps.append(Step("softmax", scores * f32, scores * f32))
    if dtype != torch.float32:
        steps.append(Step(".to(dtype)", scores * f32, scores * e))
    steps.append(Step("probs @ V", scores * e + dense, q_bytes))
    return steps


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int,
                      device: torch.device | str | None = None, min_tokens: int = 256,
                      sm_count: int | None = None) -> int:
    """Programs per (request, KV head): enough for about four per streaming
    multiprocessor (so many loads are in flight at once), each with at least
    ``min_tokens`` tokens. One in the interpreter, where fewer program
    instances is what makes it fast. ``sm_count`` stands in for the device's
    (``tinyserve.kernels.aot`` plans launches for GPUs it does not have)."""
    if sm_count is None:
        if interpreting() or not torch.cuda.is_available():
            return 1
        sms = torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count
    else:
        sms = sm_count
    want = cdiv(4 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, cdiv(max_context_len, min_tokens), 64))


# Largest GROUP_PAD * TILE * D_PAD product the broadcast (no tl.dot) path takes:
# one [GROUP_PAD, TILE, D_PAD] fp32 product over 128 threads is 64 values each.
_NO_DOT_ELEMS = 64 * 128


def decode_launch_config(group: int, head_dim: int, dtype: torch.dtype, max_context_len: int,
                         num_splits: int, tile: int | None = None) -> dict:
    """Everything :func:`paged_decode_attention_triton` launches with, for
    ``group`` query heads per KV head and a block table ``max_context_len``
    tokens wide, split ``num_splits`` ways (before rounding to whole tiles).

    Returns ``meta`` (constexprs and ``num_warps`` of ``_paged_decode_kernel``),
    ``splits``, ``tokens_per_split`` and ``merge_meta`` (those of
    ``_merge_splits_kernel``, None without splits). ``tinyserve.kernels.aot``
    compiles exactly these for sm_80-sm_90 and fails on any register spill.

    Why these (ptxas, 4 warps): padding one query row (MHA) to the 16 rows
    ``tl.dot`` needs cost 255 registers and ~600 spilled bytes at head_dim 128,
    TILE 64. MHA now multiplies and reduces without ``tl.dot``
    (``USE_DOT=False``; 130-170 registers at head_dim 128, TILE 64); GQA keeps
    ``tl.dot`` with TILE 32 at head_dim 128 (80-100 registers). Measured
    spills to avoid: the broadcast path at TILE 32 (8 B on sm_90) and for
    groups of 2-4 (4-24 B on sm_86/89, capped at 128 registers).
    """
    d_pad = max(16, next_power_of_2(head_dim))
    g_pad = next_power_of_2(group)
    use_dot = group > 1 or 16 * d_pad > _NO_DOT_ELEMS
    if use_dot:
        g_pad = max(16, g_pad)               # tl.dot needs >= 16 rows
        auto_tile = 64 if d_pad <= 64 else 32
    else:
        auto_tile = max(16, min(64, _NO_DOT_ELEMS // (g_pad * d_pad)))
    tile = tile or auto_tile
    tokens_per_split = cdiv(cdiv(max_context_len, max(1, num_splits)), tile) * tile
    splits = cdiv(max_context_len, tokens_per_split)     # no split starts past the table
    meta = dict(GROUP=group, GROUP_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, TILE=tile,
                SPLIT=splits > 1, IEEE=dtype == torch.float32, USE_DOT=use_dot, num_warps=4)
    merge_meta = None
    if splits > 1:
        merge_meta = dict(HEAD_DIM=head_dim, D_PAD=next_power_of_2(head_dim),
                          S_PAD=max(2, next_power_of_2(splits)), num_warps=4)
    return dict(meta=meta, splits=splits, tokens_per_split=tokens_per_split, merge_meta=merge_meta)


if HAS_TRITON:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        # fp32 inputs: full-precision products (the default would round them to tf32).
        if IEEE:
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _paged_decode_kernel(
            q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, scale,
            stride_qb, stride_qh,
            stride_kb, stride_kt, stride_kh,
            stride_vb, stride_vt, stride_vh,
            stride_tb, stride_ob, stride_oh,
            tokens_per_split, block_size,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
            D_PAD: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
            IEEE: tl.constexpr, USE_DOT: tl.constexpr):
        # One program: request b, KV head kvh, split s; it serves the GROUP query
        # heads that share kvh, so each K/V row is loaded once for all of them.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(lens_ptr + b).to(tl.int32)
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, ctx)

        g = tl.arange(0, GROUP_PAD)               # padded to >= 16 rows for tl.dot (USE_DOT)
        d = tl.arange(0, D_PAD)                   # head_dim padded to a power of two
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(k_ptr.dtype.element_ty)

        m_i = tl.full([GROUP_PAD], -float("inf"), tl.float32)   # running max
        l_i = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)          # running sum of p * v
        for start in range(lo, hi, TILE):
            tok = start + tl.arange(0, TILE)
            t_ok = tok < hi
            # Which physical block holds each token, and where in it.
            phys = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + tok // block_size,
                           mask=t_ok, other=0).to(tl.int64)
            row = phys * stride_kb + (tok % block_size) * stride_kt + kvh * stride_kh
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if USE_DOT:
                s = _dot(q, tl.trans(k), IEEE) * scale   # [G, TILE]
            else:                                        # few rows: multiply, reduce over D
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
            s = tl.where(t_ok[None, :], s, -float("inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)              # rescale what was summed so far
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            row_v = phys * stride_vb + (tok % block_size) * stride_vt + kvh * stride_vh
            v = tl.load(v_ptr + row_v[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if USE_DOT:
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            else:
                pv = p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :]
                acc = acc * alpha[:, None] + tl.sum(pv, axis=1)
            m_i = m_new

        out_mask = g_ok[:, None] & d_ok[None, :]
        if SPLIT:
            # Unnormalised partials [B, Hq, splits, ...] in fp32 for the merge kernel.
            part = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
            tl.store(m_ptr + part, m_i, mask=g_ok)
            tl.store(l_ptr + part, l_i, mask=g_ok)
            tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        else:
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            o = acc / l_safe[:, None]
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _merge_splits_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                             HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
        # One program per (request, query head): combine the splits' partial softmaxes.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_ok = s < num_splits
        base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
        m = tl.load(m_ptr + base + s, mask=s_ok, other=-float("inf"))
        l = tl.load(l_ptr + base + s, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                      mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m > -float("inf"), tl.exp(m - m_max), 0.0)   # empty splits weigh nothing
        total = tl.sum(w * l, axis=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
                 o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, num_splits: int | None = None,
                                  tile: int | None = None) -> torch.Tensor:
    """Fused Triton kernel: one pass over each request's K and V blocks, online softmax.

    ``num_splits=None`` picks :func:`choose_num_splits` from the table width
    (an upper bound on the context, so the host never waits for the GPU);
    ``tile=None`` and the rest of the launch come from :func:`decode_launch_config`.
    """
    require_triton("paged_decode_attention_triton")
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens)
    check_device("paged_decode_attention_triton", q, k_cache, v_cache, block_tables, context_lens)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged attention: the caches' head_dim must be contiguous")
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    q = q if q.stride(2) == 1 else q.contiguous()
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if b == 0:
        return out
    max_ctx = block_tables.shape[1] * block_size
    cfg = decode_launch_config(group, d, k_cache.dtype, max_ctx,
                               num_splits or choose_num_splits(b, hkv, max_ctx, q.device), tile)
    meta, splits, tokens_per_split = cfg["meta"], cfg["splits"], cfg["tokens_per_split"]
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
               block_tables.stride(0))
    if splits == 1:
        _paged_decode_kernel[(b, hkv, 1)](q, k_cache, v_cache, block_tables, context_lens,
                                          out, out, out, scale, *strides,
                                          out.stride(0), out.stride(1), tokens_per_split, block_size,
                                          **meta)
        return out
    acc = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _paged_decode_kernel[(b, hkv, splits)](q, k_cache, v_cache, block_tables, context_lens,
                                           acc, m, l, scale, *strides,
                                           out.stride(0), out.stride(1), tokens_per_split, block_size,
                                           **meta)
    _merge_splits_kernel[(b, hq)](acc, m, l, out, splits, out.stride(0), out.stride(1),
                                  **cfg["merge_meta"])
    return out
