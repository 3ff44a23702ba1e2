"""``cpu_rmsnorm``: the residual add and RMSNorm in one C pass, against torch's chain of ops
(``kernels.add_rmsnorm_unfused``) in fp32 and bf16, and the model using it on a CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from tinyserve import cpu_rmsnorm, kernels as K
from tinyserve.model import RMSNorm, kernel_ops

needs_kernel = pytest.mark.skipif(not cpu_rmsnorm.available(), reason="no C compiler builds the kernel here")


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(rows=st.integers(0, 40), n=st.sampled_from([1, 7, 8, 13, 64, 100, 896]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
# Found by a fresh clone's make test: one element 0.0078 off at 0.91 (0.86%, over 2^-7).
@example(rows=23, n=896, dtype=torch.bfloat16, scale=300.0, eps=0.1, seed=2610)
def test_the_kernel_gives_torchs_chain_but_for_the_order_of_one_sum(rows, n, dtype, scale, eps, seed):
    # Any row count (none, one, enough to split across threads), rows not a multiple of 8
    # lanes, small and large values; the weight has the model's dtype.
    g = torch.Generator().manual_seed(seed)
    x, residual = ((torch.randn(rows, n, generator=g) * scale).to(dtype) for _ in range(2))
    weight = torch.randn(n, generator=g).to(dtype)
    out, h = cpu_rmsnorm.add_rmsnorm(x, residual, weight, eps)
    want_out, want_h = K.add_rmsnorm_unfused(x, residual, weight, eps)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == x.shape
    assert torch.equal(h, want_h)                    # the add: one rounding, the same one
    if dtype == torch.float32:   # a few ulps, from the sum's order: 4.5e-7 seen, 896 wide
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-30)
    else:
        # Rarely, where the sum's order moved rstd: the normalized value rounds to bf16 one step
        # away (up to 2^-7 of it), and the product with the weight is rounded on each side (up
        # to 2^-8 each): within 2^-6 of torch's result.
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2 ** -6, atol=1e-30)
        if out.numel() >= 100:
            assert (out == want_out).float().mean() > 0.98


@needs_kernel
def test_any_leading_dims_and_strided_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 24, generator=g).bfloat16()
    residual = torch.randn(24, 3, 2, generator=g).bfloat16().permute(1, 2, 0)     # not contiguous
    weight = torch.randn(24, generator=g).bfloat16()
    out, h = cpu_rmsnorm.add_rmsnorm(x, residual, weight, 1e-6)
    want_out, want_h = K.add_rmsnorm_unfused(x, residual, weight, 1e-6)
    assert out.shape == h.shape == (3, 2, 24)
    assert torch.equal(h, want_h) and torch.equal(out, want_out)


@needs_kernel
@pytest.mark.parametrize("x, residual, weight, message", [
    (torch.ones(2, 8), torch.ones(2, 7), torch.ones(8), r"one shape \[\.\.\., 8\] and weight \[8\]"),
    (torch.ones(2, 8), torch.ones(2, 8), torch.ones(7), r"weight \[8\]"),
    (torch.ones(2, 8), torch.ones(2, 8).bfloat16(), torch.ones(8), "residual must be a CPU tensor of x's dtype"),
])
def test_bad_inputs_are_refused_with_a_value_error(x, residual, weight, message):
    with pytest.raises(ValueError, match=message):
        cpu_rmsnorm.add_rmsnorm(x, residual, weight, 1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_norm_runs_it_on_a_cpu(dtype, monkeypatch):
    norm = RMSNorm(64, 1e-6).to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    calls = []
    kernel = cpu_rmsnorm.add_rmsnorm
    monkeypatch.setattr(cpu_rmsnorm, "add_rmsnorm", lambda *a: calls.append(a) or kernel(*a))
    with torch.no_grad():
        out, h = norm(x, residual, kernel_ops("torch"))
    assert len(calls) == 1 and torch.equal(h, x + residual)
    want, _ = K.add_rmsnorm_unfused(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-30)


def test_turned_off_or_unbuilt_the_model_keeps_torchs_chain(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    norm = RMSNorm(16, 1e-6)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        want = K.add_rmsnorm_unfused(x, residual, norm.weight, norm.eps)
    try:
        for env, value in (("TINYSERVE_CPU_RMSNORM", "0"), ("CC", "/nonexistent/cc")):
            with monkeypatch.context() as m:
                m.setenv(env, value)
                cpu_rmsnorm.library.cache_clear()
                assert not cpu_rmsnorm.available() and not cpu_rmsnorm.supports(x, norm.weight)
                m.setattr(cpu_rmsnorm, "add_rmsnorm", lambda *a: pytest.fail("the kernel ran"))
                with torch.no_grad():
                    got = norm(x, residual, kernel_ops("torch"))
                assert all(torch.equal(a, b) for a, b in zip(got, want))    # the chain, bit for bit
        assert not list(tmp_path.glob("kernels/cpu_rmsnorm-*.so"))
    finally:
        cpu_rmsnorm.library.cache_clear()           # later tests load the real build again
