"""``cpu_attention``: decode attention read straight from the paged cache, in C, against
torch's gather-pad-mask path on the same cache (fp32 and bf16), and the model using it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tinyserve import cpu_attention
from tinyserve.model import decode_attention, gather_kv

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
