"""The fused bf16-weight GEMM (``tinyserve.bf16_gemm``) against fp32 torch on the same
weights, its input checks, and its build: cached, and absent without a compiler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tinyserve import bf16_gemm, native, packed_gemm

needs_kernel = pytest.mark.skipif(not bf16_gemm.available(), reason="no C compiler with OpenMP here")


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 70), out=st.integers(0, 40), inner=st.integers(1, 70),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_kernel_computes_the_fp32_product_of_the_bf16_weights(rows, out, inner, bias, seed):
    # Any number of rows (each path of the kernel) and any remainder of 8, 16 or 32 inputs.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=g).bfloat16()
    weight = torch.randn(out, inner, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if bias else None
    got = bf16_gemm.matmul(x, weight, b)
    want = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A bf16 model's call (bf16 in, bf16 out) is the same sums, rounded once as torch
    # rounds (ties to even), bit for bit; an fp32 x with the same values gives the same.
    rounded = bf16_gemm.matmul(x, weight, b, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))
    assert torch.equal(bf16_gemm.matmul(x.float(), weight, b), got)


@needs_kernel
def test_rounding_to_bf16_is_torchs_ties_to_even_with_infinities_and_nan():
    # Sums that land exactly on and beside the halfway points between two bf16 numbers
    # (ties go to the even one), past the largest bf16 (rounds to inf), infinities and a
    # NaN (torch's own NaN bits differ between its paths: only NaN-ness is compared).
    # One weight of 1.0 passes x through.
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8),
                           3.3961e38, float("inf"), float("-inf"), 0.0, float("nan")])
    x, weight = values[:, None], torch.ones(1, 1, dtype=torch.bfloat16)
    got = bf16_gemm.matmul(x, weight, out_dtype=torch.bfloat16)[:, 0]
    want = values.to(torch.bfloat16)
    assert torch.equal(got[:-1].view(torch.int16), want[:-1].view(torch.int16))
    assert got[-1].isnan()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13])
@pytest.mark.parametrize("inner", [7, 40, 67])
def test_every_path_of_the_kernel_is_exact_to_fp32_rounding(rows, inner):
    # One weight row at a time for 1, 2, 3, 4 and 5-8 rows, 4x3 tiles beyond (with a
    # remainder of rows and of weight rows); inputs not a multiple of 8, 16 or 32.
    x, weight = torch.randn(rows, inner).bfloat16(), torch.randn(14, inner).bfloat16()
    torch.testing.assert_close(bf16_gemm.matmul(x, weight), x.float() @ weight.float().T,
                               rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_result_does_not_depend_on_the_number_of_threads():
    # Each output is summed by one thread in one order: bit-identical on 1 or 2 threads.
    x, weight = torch.randn(8, 200).bfloat16(), torch.randn(301, 200).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16_gemm.matmul(x, weight)
        torch.set_num_threads(2)
        two = bf16_gemm.matmul(x, weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("weight, x, message", [
    (torch.ones(4, 8), torch.ones(1, 8), "contiguous 2-D bf16"),
    (torch.ones(8, 4).bfloat16().t(), torch.ones(1, 8), "strided"),
    (torch.ones(2, 4, 8).bfloat16(), torch.ones(1, 8), "contiguous 2-D bf16"),
    (torch.ones(4, 8).bfloat16(), torch.ones(1, 7), r"x must be \[rows, 8\]"),
    (torch.ones(4, 8).bfloat16(), torch.ones(8), r"x must be \[rows, 8\]"),
])
def test_bad_operands_are_refused_with_a_value_error(weight, x, message):
    with pytest.raises(ValueError, match=message):
        bf16_gemm.matmul(x, weight)


@needs_kernel
def test_a_bad_bias_or_output_dtype_is_refused_with_a_value_error():
    x, weight = torch.ones(1, 8), torch.ones(4, 8).bfloat16()
    with pytest.raises(ValueError, match=r"bias must be \[4\], got \(3,\)"):
        bf16_gemm.matmul(x, weight, torch.ones(3))
    with pytest.raises(ValueError, match="out_dtype must be torch.float32 or torch.bfloat16"):
        bf16_gemm.matmul(x, weight, out_dtype=torch.float16)


@needs_kernel
def test_upcast_gemms_of_up_to_max_rows_run_in_the_kernel_and_larger_ones_in_chunks(monkeypatch):
    calls = []
    kernel = bf16_gemm.matmul
    monkeypatch.setattr(bf16_gemm, "matmul", lambda *args, **kw: calls.append(args[0].shape[0]) or kernel(*args, **kw))
    weight, scratch = torch.randn(48, 64).bfloat16(), packed_gemm.upcast_scratch(64)
    for rows in (1, bf16_gemm.MAX_ROWS, bf16_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        got = packed_gemm.upcast_matmul(x, weight, None, scratch)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), x.float() @ weight.float().T, rtol=1.6e-2, atol=1e-2)
    assert calls == [1, bf16_gemm.MAX_ROWS]


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """``bf16_gemm.library`` built anew into an empty cache (and forgotten afterwards)."""
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    bf16_gemm.library.cache_clear()
    yield tmp_path / "kernels"
    bf16_gemm.library.cache_clear()


@needs_kernel
def test_the_build_is_kept_and_loaded_again_without_compiling(fresh_build, monkeypatch):
    assert bf16_gemm.available()
    built = list(fresh_build.glob("bf16_gemm-*.so"))
    assert len(built) == 1 and not list(fresh_build.glob("tmp*"))   # no half-written leftovers
    bf16_gemm.library.cache_clear()                     # a new process, as it were: same key
    monkeypatch.setattr(native, "build", lambda *a: pytest.fail("compiled again"))
    assert bf16_gemm.available()


def test_without_a_compiler_the_kernel_is_absent_and_bf16_gemms_use_torch(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not bf16_gemm.available()
    with pytest.raises(RuntimeError, match="not built"):
        bf16_gemm.matmul(torch.ones(1, 8), torch.ones(4, 8).bfloat16())
    scratch = packed_gemm.upcast_scratch(64)
    for rows in (1, 8, 80):                              # direct bf16, and fp32 chunks
        x, weight = torch.randn(rows, 64).bfloat16(), torch.randn(48, 64).bfloat16()
        got = packed_gemm.upcast_matmul(x, weight, None, scratch)
        torch.testing.assert_close(got.float(), x.float() @ weight.float().T, rtol=1.6e-2, atol=1e-2)


def test_turned_off_by_the_environment(fresh_build, monkeypatch):
    monkeypatch.setenv("TINYSERVE_BF16_GEMM", "0")
    assert not bf16_gemm.available() and not fresh_build.exists()
