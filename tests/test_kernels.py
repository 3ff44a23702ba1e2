"""tinyserve.kernels: fused Triton kernels and eager references against float64,
and their byte counts against hand-computed ones.

Without a GPU the Triton kernels run in Triton's CPU interpreter (about a
millisecond per program instance), so the shapes are small but irregular:
non-power-of-two widths and head dims, ragged contexts, shuffled block tables.
"""

import math
import subprocess
import sys

import pytest
import torch

from tinyserve import cpu_attention, kernels as K
from tinyserve.model import RMSNorm, decode_attention

needs_triton = pytest.mark.skipif(not K.HAS_TRITON, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is only right on a GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Max error allowed against the float64 result, per dtype: a few units in the
# last place of the output, after a reduction over hundreds of elements.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}
DTYPES = [torch.float32, torch.float16]


def randn(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **TOL[dtype])


def test_interpreter_is_chosen_without_a_gpu():
    if not torch.cuda.is_available():
        assert K.interpreting()


def test_imports_and_references_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from tinyserve import kernels as K\n"
        "assert not K.HAS_TRITON\n"
        "x = torch.ones(2, 3)\n"
        "K.add_rmsnorm_unfused(x, x, torch.ones(3), 1e-5); K.softmax_unfused(x)\n"
        "try:\n"
        "    K.silu_mul_triton(x, x)\n"
        "except ImportError as e:\n"
        "    assert 'needs Triton' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---- add + RMSNorm -----------------------------------------------------------------------

def add_rmsnorm_f64(x, residual, weight, eps):
    h = x.double() + residual.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), h


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 781), (2, 3, 80), (1, 24)])
def test_add_rmsnorm(shape, dtype):
    x, res = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    w = randn(shape[-1], dtype=dtype, seed=3)
    want_out, want_h = add_rmsnorm_f64(x, res, w, 1e-5)
    out, h = K.add_rmsnorm_triton(x, res, w, 1e-5)
    ref_out, ref_h = K.add_rmsnorm_unfused(x, res, w, 1e-5)
    assert out.shape == shape and out.dtype == dtype and h.dtype == dtype
    close(out, want_out, dtype)
    close(ref_out, want_out, dtype)
    close(out, ref_out, dtype)
    assert torch.equal(h, ref_h)            # the sum is rounded once, the same way
    close(h, want_h, dtype)


@needs_triton
def test_add_rmsnorm_fp32_weight_promotes_like_torch():
    x, res = randn(3, 40, dtype=torch.float16, seed=1), randn(3, 40, dtype=torch.float16, seed=2)
    w = randn(40, dtype=torch.float32, seed=3)
    out, h = K.add_rmsnorm_triton(x, res, w, 1e-6)
    ref, _ = K.add_rmsnorm_unfused(x, res, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32 and h.dtype == torch.float16
    close(out, ref, torch.float16)


def test_add_rmsnorm_unfused_is_the_models_rmsnorm():
    x, res = randn(5, 64, dtype=torch.float32, seed=4), randn(5, 64, dtype=torch.float32, seed=5)
    norm = RMSNorm(64, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(64, dtype=torch.float32, seed=6))
        out, h = K.add_rmsnorm_unfused(x, res, norm.weight, norm.eps)
        assert torch.equal(h, res + x)
        assert torch.equal(out, norm(res + x))


# ---- silu * up ---------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 781), (3, 5, 176)])
def test_silu_mul(shape, dtype):
    gate, up = randn(*shape, dtype=dtype, scale=3, seed=7), randn(*shape, dtype=dtype, seed=8)
    g = gate.double()
    want = g * torch.sigmoid(g) * up.double()
    out = K.silu_mul_triton(gate, up)
    assert out.shape == shape and out.dtype == dtype
    close(out, want, dtype)
    close(K.silu_mul_unfused(gate, up), want, dtype)
    close(out, K.silu_mul_unfused(gate, up), dtype)


# ---- softmax -----------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 781), (2, 3, 130), (4, 1)])
def test_softmax(shape, dtype):
    x = randn(*shape, dtype=dtype, scale=8, seed=9)     # large logits: needs the max shift
    want = torch.softmax(x.double(), dim=-1)
    out = K.softmax_triton(x)
    assert out.shape == shape and out.dtype == dtype
    close(out, want, dtype)
    close(K.softmax_unfused(x), want, dtype)
    close(out, K.softmax_unfused(x), dtype)


# ---- paged decode attention --------------------------------------------------------------

def paged_attention_f64(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Token by token from the block table, one request and one head at a time."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for r in range(b):
        pos = torch.arange(int(context_lens[r]))
        blocks = block_tables[r].cpu().long()[pos // block_size]
        keys = k_cache.cpu()[blocks, pos % block_size].double()      # [n, Hkv, D]
        values = v_cache.cpu()[blocks, pos % block_size].double()
        for h in range(hq):
            kv = h // (hq // hkv)
            p = torch.softmax(keys[:, kv] @ q[r, h].cpu().double() * scale, dim=0)
            out[r, h] = p @ values[:, kv]
    return out


def paged_case(dtype, batch, num_heads, num_kv_heads, head_dim, block_size, context_lens,
               num_blocks=40, index_dtype=torch.int32, seed=0):
    """Caches full of random data; each request gets distinct blocks in shuffled order,
    its table padded past its context with unrelated block ids."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(context_lens) // block_size)
    assert batch * max_blocks <= num_blocks
    tables = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].view(batch, max_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (randn(batch, num_heads, head_dim, dtype=dtype, seed=seed + 1),
            randn(*shape, dtype=dtype, seed=seed + 2), randn(*shape, dtype=dtype, seed=seed + 3),
            tables.to(index_dtype).to(DEVICE),
            torch.tensor(context_lens, dtype=index_dtype, device=DEVICE), 1 / math.sqrt(head_dim))


PAGED_CASES = {
    # B, Hq, Hkv, D, block_size, context_lens, options
    "gqa2-d80-ragged": (3, 4, 2, 80, 16, [37, 5, 100], {}),
    "gqa3-d24-bs7-split3": (2, 6, 2, 24, 7, [50, 13], dict(num_splits=3)),
    "mha-d64-split2-ctx1": (2, 2, 2, 64, 16, [130, 1], dict(num_splits=2)),
    "gqa8-d128-split4-tile16": (2, 16, 2, 128, 16, [300, 129], dict(num_splits=4, tile=16)),
}


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_decode_attention(case, dtype):
    *shape, options = PAGED_CASES[case]
    args = paged_case(dtype, *shape)
    want = paged_attention_f64(*args)
    out = K.paged_decode_attention_triton(*args, **options)
    ref = K.paged_decode_attention_torch(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    close(out, want, dtype)
    close(ref, want, dtype)
    close(out, ref, dtype)


@needs_triton
def test_paged_decode_attention_int64_tables_match_the_models_decode():
    # The model keeps int64 block tables and context lengths; its torch decode_attention
    # is the path the fused kernel replaces.
    q, k_cache, v_cache, tables, lens, scale = paged_case(
        torch.float32, 3, 4, 2, 24, 16, [33, 7, 64], index_dtype=torch.int64)
    model_out = decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()))
    out = K.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale)
    close(out, model_out, torch.float32)
    close(K.paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, scale), model_out,
          torch.float32)


def test_the_models_half_precision_decode_attends_in_fp32_on_a_cpu():
    # torch's attention for one query row is several times slower in bf16 than in fp32 on a
    # CPU, so the model upcasts there: its bf16 decode is the fp32 computation of the same
    # bf16 inputs, rounded once at the end.
    q, k_cache, v_cache, tables, lens, _ = paged_case(
        torch.bfloat16, 3, 4, 2, 24, 16, [33, 7, 64], index_dtype=torch.int64)
    q, k_cache, v_cache, tables, lens = (t.cpu() for t in (q, k_cache, v_cache, tables, lens))
    out = decode_attention(q, k_cache, v_cache, tables, lens, int(lens.max()))
    want = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, int(lens.max()))
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_one_length_attend_without_a_mask_bit_for_bit(dtype, monkeypatch):
    # torch's path (where the C kernel is not used): rows whose contexts all have the longest
    # length (every B=1 step) skip the mask: the same numbers, bit for bit, as attention with
    # an all-true mask; shorter rows are masked.
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    q, k_cache, v_cache, tables, lens, _ = paged_case(
        dtype, 3, 4, 2, 24, 16, [40, 40, 40], index_dtype=torch.int64)
    q, k_cache, v_cache, tables, lens = (t.cpu() for t in (q, k_cache, v_cache, tables, lens))
    keys = k_cache[tables].flatten(1, 2)[:, :40].transpose(1, 2).float()
    values = v_cache[tables].flatten(1, 2)[:, :40].transpose(1, 2).float()
    masked = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None, :], keys, values, attn_mask=torch.ones(3, 1, 1, 40, dtype=torch.bool),
        enable_gqa=True)[:, :, 0, :].to(dtype)
    assert torch.equal(decode_attention(q, k_cache, v_cache, tables, lens, 40), masked)
    short = lens.clone()
    short[1] = 9                        # now row 1 must not see the 31 tokens past its own
    out = decode_attention(q, k_cache, v_cache, tables, short, 40)
    alone = decode_attention(q[1:2], k_cache, v_cache, tables[1:2], short[1:2], 9)
    torch.testing.assert_close(out[1], alone[0])
    assert not torch.allclose(out[1], masked[1])


@needs_triton
@needs_cuda
def test_bf16_on_gpu():
    x, res, w = (randn(37, 781, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    close(K.add_rmsnorm_triton(x, res, w, 1e-5)[0], add_rmsnorm_f64(x, res, w, 1e-5)[0],
          torch.bfloat16)
    close(K.silu_mul_triton(x, res), K.silu_mul_unfused(x.double(), res.double()), torch.bfloat16)
    close(K.softmax_triton(x), torch.softmax(x.double(), -1), torch.bfloat16)
    args = paged_case(torch.bfloat16, 3, 8, 2, 128, 16, [300, 17, 1000], num_blocks=200)
    close(K.paged_decode_attention_triton(*args), paged_attention_f64(*args), torch.bfloat16)


# ---- bytes moved -------------------------------------------------------------------------

def test_bytes_moved_add_rmsnorm_by_hand():
    # x, residual: 2 rows x 4 fp16 (8 elements, 16 bytes); weight 4 fp16 (8 bytes).
    # fp32 copies are 32 bytes; per-row statistics 2 x fp32 = 8 bytes.
    unfused = [16 + 16 + 16,   # x + residual: read x, residual; write h
               16 + 32,        # h.float()
               32 + 32,        # .pow(2)
               32 + 8,         # .mean(-1)
               8 + 8,          # + eps
               8 + 8,          # rsqrt
               32 + 8 + 32,    # h32 * rstd
               32 + 16,        # .to(fp16)
               8 + 16 + 16]    # weight * y
    assert [s.total for s in K.steps("add_rmsnorm", "unfused", (2, 4), torch.float16)] == unfused
    assert K.bytes_moved("add_rmsnorm", "unfused", (2, 4), torch.float16) == 392
    # Fused: read x, residual, weight; write out and the new residual.
    assert K.bytes_moved("add_rmsnorm", "fused", (2, 4), torch.float16) == 16 + 16 + 8 + 16 + 16
    # fp32 has no casts: 96 + 64 + 40 + 16 + 16 + 72 + 80.
    assert K.bytes_moved("add_rmsnorm", "unfused", (2, 4), torch.float32) == 384
    assert K.bytes_moved("add_rmsnorm", "fused", (2, 4), torch.float32) == 144
    # Leading dims are rows.
    assert K.bytes_moved("add_rmsnorm", "torch", (1, 2, 4)) == 384


def test_bytes_moved_silu_mul_and_softmax_by_hand():
    # silu_mul on 6 fp16 (12 bytes): silu reads 12, writes 12; * up reads 24, writes 12.
    assert K.bytes_moved("silu_mul", "unfused", (2, 3), torch.float16) == 24 + 36
    assert K.bytes_moved("silu_mul", "fused", (2, 3), torch.float16) == 36
    # softmax on 2 x 3 fp32 (24 bytes, row stats 8 bytes):
    # amax 24+8, sub 24+8+24, exp 24+24, sum 24+8, div 24+8+24.
    assert K.bytes_moved("softmax", "unfused", (2, 3)) == 32 + 56 + 48 + 32 + 56 == 224
    assert K.bytes_moved("softmax", "triton", (2, 3)) == 48


def test_bytes_moved_paged_attention_by_hand():
    # 2 requests with 5 and 3 cached tokens, block size 4; Hq=4, Hkv=2, D=8, fp16, int32 ids.
    args = dict(context_lens=[5, 3], num_heads=4, num_kv_heads=2, head_dim=8,
                dtype=torch.float16, block_size=4)
    q = 2 * 4 * 8 * 2                         # 128 bytes, as is the output
    kv = 2 * (5 + 3) * 2 * 8 * 2              # K and V of every cached token: 512
    fused = q + (2 + 1) * 4 + 2 * 4 + kv + q  # q, 3 used table entries, 2 lengths, K, V; out
    assert K.bytes_moved("paged_decode_attention", "fused", **args) == fused == 788
    # Unfused: both requests padded to 5 tokens = 2 whole blocks when gathered.
    gathered = 2 * 2 * 4 * 2 * 8 * 2          # 512
    dense, scores = 2 * 5 * 2 * 8 * 2, 2 * 4 * 5  # 320 bytes; 40 scores
    unfused = [2 * 4 + 4,                             # context_lens.max()
               2 * (2 * 2 * 4 + 2 * gathered),        # gather K and V (int32 ids)
               2 * 2 * dense,                         # K and V made heads-first
               2 * q,                                 # q * scale
               q + dense + 2 * scores,                # q @ K^T
               5 * 8,                                 # arange
               5 * 8 + 2 * 4 + 2 * 5,                 # padding mask
               2 * scores + 10 + 2 * scores,          # masked_fill
               2 * scores + 4 * scores,               # .float()
               8 * scores,                            # softmax
               4 * scores + 2 * scores,               # .to(fp16)
               2 * scores + dense + q]                # probs @ V
    assert K.bytes_moved("paged_decode_attention", "unfused", **args) == sum(unfused) == 5752
    # Splitting adds fp32 partials (acc D + max + sum per head and split), written and read once.
    partial = 2 * 4 * 3 * (8 + 2) * 4
    assert K.bytes_moved("paged_decode_attention", "fused", **args, num_splits=3) == fused + 2 * partial


def test_bytes_moved_rejects_unknown_names():
    with pytest.raises(ValueError, match="op"):
        K.bytes_moved("gelu", "fused", (2, 3))
    with pytest.raises(ValueError, match="variant"):
        K.bytes_moved("softmax", "compiled", (2, 3))


def test_gpu_benchmark_code_runs_on_cpu_at_tiny_sizes():
    # The GPU path of `python -m tinyserve.bench kernels` cannot be timed here,
    # but its plumbing (shapes, checks, byte counts, table) can run in the
    # interpreter with a fake timer.
    if not K.HAS_TRITON:
        pytest.skip("Triton is not installed")
    from tinyserve.bench import kernels as bench
    copy_gbps, rows = bench.bench_gpu(torch.float16, tokens=64, batch=2, contexts=(40,),
                                      device=DEVICE, timer=lambda fn: (fn(), 1e-3)[1],
                                      copy_bytes=1 << 20)
    assert [r["op"] for r in rows[::2]] == ["add_rmsnorm", "silu_mul", "softmax",
                                            "paged_decode_attention"]
    assert all(r["bytes"] > 0 and r["GBps"] > 0 for r in rows)
    assert all(a["bytes"] > b["bytes"] for a, b in zip(rows[::2], rows[1::2]))   # fused moves less
    bench.print_table("smoke", copy_gbps, rows)
