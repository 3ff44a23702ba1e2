"""``cpu_attention``: decode attention read straight from the paged cache, in C, against
torch's gather-pad-mask path on the same cache (fp32 and bf16), and the model using it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from tinyserve import cpu_attention
from tinyserve import model as model_module
from tinyserve.model import (Attention, AttentionMetadata, ModelConfig, apply_rotary_qk, decode_attention,
                             gather_kv, rotary_cos_sin, write_kv)

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler builds the kernel here")


def torch_decode(q, k_cache, v_cache, tables, lens, dtype=torch.float32):
    """torch's path, one request at a time over exactly its context, in ``dtype``."""
    rows = []
    for b, ctx in enumerate(lens.tolist()):
        keys = gather_kv(k_cache, tables[b:b + 1])[:, :ctx].transpose(1, 2).to(dtype)
        values = gather_kv(v_cache, tables[b:b + 1])[:, :ctx].transpose(1, 2).to(dtype)
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1, :, None, :].to(dtype), keys, values, enable_gqa=True)[:, :, 0, :])
    return torch.cat(rows)


def paged(batch, kv_heads, group, head_dim, block_size, lens, dtype, seed):
    """Random caches; each request's blocks distinct and shuffled, its table padded with 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    blocks = batch * width + 2
    shape = (blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    ids = torch.randperm(blocks, generator=g)
    tables = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        tables[b, :used] = ids[b * width:b * width + used]
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=5), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 7]), head_dim=st.sampled_from([8, 12, 64, 80, 128]),
       block_size=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16), sharp=st.booleans())
def test_the_kernel_attends_as_torch_does_over_each_requests_own_blocks(
        lens, kv_heads, group, head_dim, block_size, dtype, seed, sharp):
    # Any context lengths (one token, a block's worth, a partial last block, 8 keys at a time
    # and the rest), grouped-query heads, head sizes not a multiple of 8 or of 64, fp32 and
    # bf16 caches; sharp: scores hundreds apart, so most weights underflow to nothing.
    q, k_cache, v_cache, tables, ctx = paged(len(lens), kv_heads, group, head_dim, block_size, lens, dtype, seed)
    if sharp:
        q = q * 40
    got = cpu_attention.decode(q, k_cache, v_cache, tables, ctx, head_dim ** -0.5)
    want = torch_decode(q, k_cache, v_cache, tables, ctx)
    assert got.dtype == dtype and got.shape == q.shape
    if sharp:           # scores of hundreds: fp32 torch is itself ~1e-5 off, so against fp64.
        # A score s is rounded to ~s * 2^-24 at every step of its sum, so at s ~ 400 each
        # weight e^s carries ~1e-4 of relative error, and an output of O(1) values ~1e-4 of
        # absolute error (head_dim 128, 65 tokens: 1.9e-5 here, 5.7e-6 by torch in fp32).
        want = torch_decode(q, k_cache, v_cache, tables, ctx, torch.float64).float()
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-4,
                                   atol=1e-4)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:               # fp32 sums, rounded once: at most one bf16 step from torch's rounding
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-6)


@needs_kernel
def test_the_model_uses_it_on_a_cpu_and_only_reads_each_requests_context():
    # A request's padding blocks hold garbage (NaN): neither path may read past its context.
    q, k_cache, v_cache, tables, ctx = paged(3, 2, 4, 16, 4, [9, 1, 16], torch.float32, 0)
    tables[1, 1:] = tables[0, 0]                        # the short request's table: others' blocks
    spare = k_cache.shape[0] - 1
    k_cache[spare], v_cache[spare] = float("nan"), float("nan")
    tables[0, 3] = spare                                # past row 0's 9 tokens (3 blocks)
    out = decode_attention(q, k_cache, v_cache, tables, ctx, 16)
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch_decode(q, k_cache, v_cache, tables, ctx), rtol=1e-5, atol=1e-6)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(decodes=st.lists(st.integers(1, 40), max_size=3),
       chunks=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 60)), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
@example(decodes=[7], chunks=[(5, 0), (80, 20), (16, 3)], dtype=torch.float32, seed=0)
def test_short_prefill_chunks_attend_in_the_decodes_call_as_torch_attends_them(decodes, chunks, dtype, seed):
    # A step of decode rows, then prefill chunks of n new tokens after `cached` ones: the
    # decodes and every chunk of at most KERNEL_PREFILL_SCORES new x context tokens go to
    # the kernel in one call (each token a row over its causal prefix), the rest to torch;
    # every row must come out as torch's path computes it, here in fp64.
    attn = Attention(ModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 0)
    lens = decodes + [n + cached for n, cached in chunks]
    _, k_cache, v_cache, tables, _ = paged(len(lens), 2, 2, 16, 4, lens, dtype, seed)
    query_lens = [1] * len(decodes) + [n for n, _ in chunks]
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)

    def meta():
        return AttentionMetadata(slot_mapping=None, query_lens=query_lens, context_lens=lens,
                                 block_tables=tables, num_decodes=len(decodes),
                                 decode_context_lens=torch.tensor(decodes, dtype=torch.long))
    step = meta()
    got = attn.attend(q, step, k_cache, v_cache, {"decode_attention": None})
    left = [r for r, (n, ctx) in enumerate(zip(query_lens, lens))
            if r >= len(decodes) and n * ctx > model_module.KERNEL_PREFILL_SCORES]
    assert [r for r, _ in step.kernel_rows.torch_chunks] == left
    assert step.kernel_rows.count == sum(query_lens) - sum(query_lens[r] for r in left)
    assert got.dtype == dtype and got.shape == q.shape
    # The kernel's rows against fp64 (fp32 sums, bf16 rounded once at the end); torch's
    # chunks are torch's own path in the step's dtype, unchanged.
    starts = [sum(query_lens[:r]) for r in range(len(lens))]
    mine = torch.ones(len(q), dtype=torch.bool)
    for r in left:
        mine[starts[r]:starts[r] + query_lens[r]] = False
        torch.testing.assert_close(got[starts[r]:starts[r] + query_lens[r]], attn._prefill(
            q[starts[r]:starts[r] + query_lens[r]], k_cache, v_cache, tables[r], lens[r]), rtol=0, atol=0)
    want = attn.attend(q.double(), meta(), k_cache.double(), v_cache.double(), {"decode_attention": None})
    torch.testing.assert_close(got[mine].double(), want[mine], atol=1e-5,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -7)


@needs_kernel
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(context_lens=torch.tensor([0])), r"context_lens must be 1\.\.8"),
    (lambda a: a.update(context_lens=torch.tensor([9])), r"context_lens must be 1\.\.8"),
    (lambda a: a.update(block_tables=torch.tensor([[0, 7]])), r"block ids 0\.\.3"),
    (lambda a: a.update(block_tables=torch.tensor([[-1, 0]])), r"block ids 0\.\.3"),
    (lambda a: a.update(q=torch.ones(1, 3, 4)), "multiple of the caches' 2 heads"),
    (lambda a: a.update(q=torch.ones(1, 4)), r"q must be \[B, Hq, D\]"),
    (lambda a: a.update(v_cache=torch.ones(4, 4, 2, 8)), "both caches"),
    (lambda a: a.update(context_lens=torch.tensor([3, 3])), r"context_lens \[1\]"),
])
def test_bad_inputs_are_refused_with_a_value_error(change, message):
    args = dict(q=torch.ones(1, 4, 4), k_cache=torch.ones(4, 4, 2, 4), v_cache=torch.ones(4, 4, 2, 4),
                block_tables=torch.tensor([[0, 1]]), context_lens=torch.tensor([5]), scale=0.5)
    change(args)
    with pytest.raises(ValueError, match=message):
        cpu_attention.decode(**args)


def test_turned_off_or_unbuilt_the_model_keeps_torchs_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    q, k_cache, v_cache, tables, ctx = paged(2, 1, 2, 8, 4, [5, 3], torch.float32, 1)
    want = torch_decode(q, k_cache, v_cache, tables, ctx)
    try:
        for env, value in (("TINYSERVE_CPU_ATTENTION", "0"), ("CC", "/nonexistent/cc")):
            with monkeypatch.context() as m:
                m.setenv(env, value)
                cpu_attention.library.cache_clear()
                assert not cpu_attention.available() and not cpu_attention.supports(q, k_cache)
                m.setattr(cpu_attention, "decode", lambda *a: pytest.fail("the kernel ran"))
                torch.testing.assert_close(decode_attention(q, k_cache, v_cache, tables, ctx, 5), want,
                                           rtol=1e-5, atol=1e-6)
        assert not list(tmp_path.glob("kernels/cpu_attention-*.so"))
    finally:
        cpu_attention.library.cache_clear()         # later tests load the real build again


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 40), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 7]),
       head_dim=st.sampled_from([2, 12, 16, 64, 80, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_rotate_and_store_is_the_rotary_embedding_then_the_cache_write(tokens, kv_heads, group, head_dim,
                                                                       dtype, seed):
    # q, k, v as the model has them (slices of one GEMM's output), any positions, head sizes
    # whose halves are 8 lanes at a time, not, or a mix; enough tokens to split across threads.
    g = torch.Generator().manual_seed(seed)
    hq, block_size, blocks = kv_heads * group, 4, 16
    qkv = torch.randn(tokens, (hq + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (x.view(tokens, -1, head_dim) for x in
               qkv.split([hq * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1))
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    cos, sin = rotary_cos_sin(positions, head_dim, 1e6, dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(4)]
    k_cache, v_cache, k_want, v_want = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    got_q = cpu_attention.rotate_and_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    want_q, want_k = apply_rotary_qk(q, k, cos, sin)
    write_kv(k_want, v_want, slots, want_k, v)
    assert got_q.shape == q.shape and got_q.dtype == dtype
    assert torch.equal(v_cache, v_want)          # every other slot untouched, v copied as it is
    # each product and the sum rounded as torch does: bit for bit, fp32 and bf16
    assert torch.equal(got_q, want_q) and torch.equal(k_cache, k_want)


@needs_kernel
@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(slot_mapping=torch.tensor([0, 32])), r"slots 0\.\.31"),
    (lambda a: a.update(slot_mapping=torch.tensor([-1, 0])), r"slots 0\.\.31"),
    (lambda a: a.update(k=torch.ones(2, 2, 7)), r"k and v \[T, Hkv, D\]"),
    (lambda a: a.update(cos=torch.ones(2, 6)), r"cos and sin \[2, 8\]"),
    (lambda a: a.update(v=torch.ones(2, 2, 8).bfloat16()), "every tensor must be torch.float32"),
    (lambda a: a.update(k_cache=torch.ones(8, 2, 4, 8).transpose(1, 2)), "contiguous"),
])
def test_rotate_and_store_refuses_bad_inputs_with_a_value_error(change, message):
    args = dict(q=torch.ones(2, 4, 8), k=torch.ones(2, 2, 8), v=torch.ones(2, 2, 8), cos=torch.ones(2, 8),
                sin=torch.ones(2, 8), k_cache=torch.ones(8, 4, 2, 8), v_cache=torch.ones(8, 4, 2, 8),
                slot_mapping=torch.tensor([0, 5]))
    change(args)
    with pytest.raises(ValueError, match=message):
        cpu_attention.rotate_and_store(**args)


@needs_kernel
def test_the_model_rotates_and_stores_each_layers_new_tokens_in_one_pass_on_a_cpu(monkeypatch):
    # A 5-token prompt then two decode steps: one call per layer and step; the greedy tokens
    # are those of torch's path (rotary embedding, cache write and attention as torch ops).
    from tinyserve import LLM, SamplingParams
    llm = LLM("tiny", seed=0)
    layers = llm.engine.executor.model.config.num_hidden_layers
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    calls, real = [], cpu_attention.rotate_and_store
    monkeypatch.setattr(cpu_attention, "rotate_and_store", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    fused = llm.generate([[3, 1, 4, 1, 5]], params)[0].token_ids
    assert calls == [5] * layers + [1] * layers * 2
    monkeypatch.setattr(cpu_attention, "rotate_and_store", lambda *a: pytest.fail("the kernel ran"))
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    assert llm.generate([[3, 1, 4, 1, 5]], params)[0].token_ids == fused
