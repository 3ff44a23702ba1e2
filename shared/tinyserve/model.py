"""A Llama-style decoder that reads and writes a paged KV cache.

The layers are the ones of Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary
position embeddings, SwiGLU MLP, grouped-query attention) and the parameters
carry the same names, so a model saved by ``checkpoint.py`` loads in
``transformers`` and a checkpoint downloaded from the Hub loads here, and the two
give the same greedy tokens. The file format sits on top of the model:
``checkpoint`` imports this module, never the other way round.

What differs from a training-style model is the attention: one forward runs a
*flat* (ragged) batch, the new tokens of every scheduled request laid end to end
(a 300-token prefill chunk of one request next to single decode tokens of
others). Each token's K and V are written into the cache slot chosen by the
block manager, and each request then attends over its own blocks.

The same module runs the Llama-like families, switched by a few config flags:

- Llama 2 (Touvron et al., 2023, arXiv:2307.09288): RMSNorm (Zhang & Sennrich,
  2019), RoPE (Su et al., 2021, arXiv:2104.09864), SwiGLU (Shazeer, 2020,
  arXiv:2002.05202), grouped-query attention (Ainslie et al., 2023, arXiv:2305.13245).
- Llama 3 / 3.1 (Grattafiori et al., 2024, arXiv:2407.21783): ``rope_scaling``
  with ``rope_type: "llama3"`` stretches the slow rotary frequencies for long
  context (``llama3_inv_freq``); Llama 3.2 1B/3B tie the embeddings.
- Mistral 7B (Jiang et al., 2023, arXiv:2310.06825): the Llama layers.
- Qwen2 / Qwen2.5 (Yang et al., 2024, arXiv:2407.10671): a bias on the q, k and v
  projections (``qkv_bias``), rope_theta 1e6.
- Qwen3 (Yang et al., 2025, arXiv:2505.09388): RMSNorm on each head's q and k
  before RoPE (``qk_norm``), and a ``head_dim`` that need not be hidden / heads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tinyserve import cpu_attention, cpu_rmsnorm


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's long-context RoPE (``"rope_type": "llama3"`` in config.json)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # A checkpoint's own special ids (config.json); the tokenizer is the authority when
    # a model is saved with one (``LLM.save_pretrained``). Llama 3 lists several eos ids.
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # The family the weights come from; save_pretrained writes it back.
    model_type: str = "llama"
    # config.json's head_dim when it is not hidden / heads (Qwen3, Mistral-Nemo).
    explicit_head_dim: int | None = None
    qkv_bias: bool = False              # Qwen2; Llama's attention_bias (with o_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False               # Qwen3
    tie_word_embeddings: bool = False   # lm_head shares embed_tokens' matrix
    rope_scaling: Llama3RopeScaling | None = None

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = 2 * h * q + 2 * h * kv + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        mlp = 3 * h * i + self.mlp_bias * (2 * i + h)
        per_layer = attention + mlp + 2 * h + self.qk_norm * 2 * d
        embeddings = (1 if self.tie_word_embeddings else 2) * v * h
        return embeddings + self.num_hidden_layers * per_layer + h

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """K and V of one token across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


# vocab 2048 matches the shipped tokenizer (its special ids are its last three).
MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~0.4M parameters: fast enough for hundreds of test generations.
    "tiny": ModelConfig(),
    # ~4M parameters: still quick on CPU, big enough to look like a model.
    "small": ModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024),
    # ~100M parameters (400 MB in fp32): far past a CPU's last-level cache, so a
    # decode step must stream every weight from DRAM and is bandwidth-bound,
    # like a real LLM on a GPU.
    "cpu-bench": ModelConfig(hidden_size=768, intermediate_size=2816, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=4,
                             max_position_embeddings=1024),
}


# Presets with trained weights shipped as package data (``python -m tinyserve.book.train``).
TRAINED_MODELS: dict[str, Path] = {"tiny-zh": Path(__file__).parent / "data" / "tiny-zh"}


def get_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; choose one of "
                         f"{sorted(MODEL_PRESETS) + sorted(TRAINED_MODELS)} "
                         "or give a directory saved with save_pretrained")
    return MODEL_PRESETS[name]


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and in the cache.

    Requests are ordered decode-first: the first ``num_decodes`` have exactly
    one new token, the rest are prefill chunks.
    """
    slot_mapping: torch.Tensor      # [T] cache slot (block * block_size + offset) of each new token
    query_lens: list[int]           # new tokens per request
    context_lens: list[int]         # tokens in the cache per request after this step
    block_tables: torch.Tensor      # [R, max_blocks] int64, padded with 0
    num_decodes: int
    decode_context_lens: torch.Tensor  # [num_decodes] int64, on the model's device
    # A decode batch padded to a fixed bucket for a compiled graph (compiled_step.py):
    # every row is a decode, padding rows sit at the end, and the Python lists above
    # are not read (their values would become graph constants).
    padded: bool = False

    @functools.cached_property
    def kernel_rows(self) -> "KernelRows":
        """The step's rows for the CPU attention kernel, worked out once for every layer."""
        return kernel_rows(self)


# A prefill chunk of few tokens attends as rows of the decode kernel (cpu_attention): each
# of its tokens is a row over its causal prefix, and every such chunk of a step goes in
# one call with the decode rows. torch's attention pays a gather, a mask and a call per
# chunk and layer (about 40 us); it multiplies in blocks, though, and wins on big chunks.
# One layer on an AMD EPYC Zen 5 (32 MiB L3, 2 threads), torch's time / the kernel's, over
# tiny-zh, cpu-bench and Qwen2.5-0.5B's shapes in fp32 and bf16 (15 interleaved rounds):
# 8 prompts of 32 tokens 2.4-3.8x, 16 of 64 1.3-2.5x, 4 of 128 0.85-2.2x, one of 16
# 2.4-3.3x, one of 64 0.90-1.8x, one of 256 0.48-1.05x (the slowest: tiny-zh's 32-wide heads).
KERNEL_PREFILL_SCORES = 64 * 64     # the most new tokens x context of a chunk the kernel takes


@dataclass
class KernelRows:
    """The rows of a step that attend in one call of the CPU kernel: every decode and each
    token of every chunk with at most ``KERNEL_PREFILL_SCORES`` new tokens x context."""
    index: torch.Tensor | None      # where they sit among the step's tokens (None: the first `count`)
    count: int
    tables: torch.Tensor            # [count, max_blocks] each row's block table
    lens: torch.Tensor              # [count] the tokens each row attends over
    torch_chunks: list[tuple[int, int]]     # (request, first token) of the chunks left to torch


def kernel_rows(meta: AttentionMetadata) -> KernelRows:
    if meta.num_decodes == len(meta.query_lens):        # a decode step: its own tables, as they are
        return KernelRows(None, meta.num_decodes, meta.block_tables, meta.decode_context_lens, [])
    requests, lens, index, left = [], [], [], []
    start = 0
    for r, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if r < meta.num_decodes or n * ctx <= KERNEL_PREFILL_SCORES:
            requests += [r] * n
            lens += range(ctx - n + 1, ctx + 1)     # token i of the chunk sees ctx - n + i + 1
            index += range(start, start + n)
        else:
            left.append((r, start))
        start += n
    dev = meta.block_tables.device
    tables = meta.block_tables.index_select(0, torch.tensor(requests, dtype=torch.long, device=dev))
    prefix = index == list(range(len(index)))
    return KernelRows(None if prefix else torch.tensor(index, dtype=torch.long, device=dev),
                      len(index), tables, torch.tensor(lens, dtype=torch.long, device=dev), left)


def _scratch_metadata(kv_cache: "KVCache", size: int, scratch_slot: int, context: int,
                      dev) -> "AttentionMetadata":
    """``size`` decode rows that each attend over ``context`` tokens and all write to
    ``scratch_slot`` (every block of their tables is the scratch block)."""
    scratch_block = scratch_slot // kv_cache.block_size
    width = -(-context // kv_cache.block_size)
    return AttentionMetadata(
        slot_mapping=torch.full((size,), scratch_slot, device=dev), query_lens=[1] * size,
        context_lens=[context] * size,
        block_tables=torch.full((size, width), scratch_block, device=dev),
        num_decodes=size, decode_context_lens=torch.full((size,), context, device=dev))


def scratch_decode(model: "LlamaForServing", kv_cache: "KVCache", size: int, scratch_slot: int,
                   context: int = 1, **forward_options):
    """A call running the engine's eager decode path (unpadded metadata, every row
    sampled) on ``size`` rows that each attend over ``context`` tokens and all write to
    ``scratch_slot``: a step to time a faster path against, at start, without touching
    any request's blocks."""
    dev = next(model.parameters()).device
    meta = _scratch_metadata(kv_cache, size, scratch_slot, context, dev)
    ids = torch.zeros(size, dtype=torch.long, device=dev)
    positions = torch.full((size,), context - 1, dtype=torch.long, device=dev)
    rows = torch.arange(size, device=dev)
    return lambda: model(ids, positions, meta, kv_cache, rows, **forward_options)


def scratch_layers(model: "LlamaForServing", kv_cache: "KVCache", size: int, scratch_slot: int,
                   context: int, packed_layers: list, first: int = 0):
    """A call running ``len(packed_layers)`` decoder layers from layer ``first`` on of a
    decode step as ``scratch_decode`` does, on random hidden states; each layer's GEMMs on
    its entry of ``packed_layers`` (``None``: the dense weights). A part of a step, to time
    two paths against each other without the whole model in both forms."""
    embed = model.model.embed_tokens.weight
    c = model.config
    meta = _scratch_metadata(kv_cache, size, scratch_slot, context, embed.device)
    x = torch.randn(size, c.hidden_size, device=embed.device).to(embed.dtype)
    positions = torch.full((size,), context - 1, dtype=torch.long, device=embed.device)
    cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    layers = list(zip(model.model.layers[first:first + len(packed_layers)], packed_layers))

    @torch.inference_mode()
    def run():
        h, residual = x, None
        for layer, packed in layers:
            h, residual = layer(h, residual, cos, sin, meta, kv_cache, model.ops, packed)
        return h
    return run


class KVCache:
    """K and V for every layer: [layers, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (config.num_hidden_layers, num_blocks, block_size,
                 config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def default_device() -> str:
    """Where tinyserve runs by default: the GPU when there is one (``tinyserve.device()``)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


KERNEL_CHOICES = ("torch", "triton")


def add_rmsnorm_on_cpu(chain, x, residual, weight, eps):
    """The residual add and RMSNorm as one C pass where it takes the tensors (a CPU, the
    kernel built: ``cpu_rmsnorm``), else ``chain``: eager torch's ops."""
    if cpu_rmsnorm.supports(x, weight):
        return cpu_rmsnorm.add_rmsnorm(x, residual, weight, eps)
    return chain(x, residual, weight, eps)


def kernel_ops(kernels: str) -> dict:
    """The model's memory-bound ops: eager torch ("torch"; on a CPU, our C kernels where
    they are built: ``cpu_rmsnorm``, and ``cpu_attention`` in ``decode_attention``) or fused
    Triton kernels ("triton")."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels: unknown choice {kernels!r}; choose one of {list(KERNEL_CHOICES)}")
    from tinyserve import kernels as K

    if kernels == "torch":
        return {"add_rmsnorm": functools.partial(add_rmsnorm_on_cpu, K.add_rmsnorm_unfused),
                "silu_mul": K.silu_mul_unfused, "decode_attention": None}
    return {"add_rmsnorm": K.add_rmsnorm_triton, "silu_mul": K.silu_mul_triton,
            "decode_attention": K.paged_decode_attention_triton}


class RMSNorm(nn.Module):
    """``norm(x)``, or with a residual ``norm(x, residual, ops) -> (norm(x + residual),
    x + residual)``: the add is fused with the norm (one kernel with kernels="triton")."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: dict | None = None):
        if residual is not None:
            return ops["add_rmsnorm"](x, residual, self.weight, self.eps)
        # Normalise in fp32 whatever the weight dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None,
                  device=None) -> torch.Tensor:
    """The rotation speed of each pair of dimensions, theta^(-2i/d), in fp32.

    Computed per forward rather than kept as a buffer: ``model.to(bfloat16)`` would
    round a buffer to bf16 and shift every angle."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=device) / head_dim))
    return inv_freq if scaling is None else llama3_inv_freq(inv_freq, scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's rescaling, as transformers' ``_compute_llama3_parameters``.

    Pairs that turn slowly (wavelength longer than the pre-training context /
    low_freq_factor) never completed a turn in pre-training: slow them by
    ``factor`` (interpolate positions). Fast pairs (wavelength under context /
    high_freq_factor) saw many turns and stay. Those in between blend the two.
    """
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                   scaling: Llama3RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; the "rotate half" layout of Llama checkpoints in HF format.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rotary`` of the query and key heads in one pass over both: a decode step's
    tensors are tiny, so its cost is the number of ops, not their size."""
    qk = apply_rotary(torch.cat([q, k], dim=1), cos, sin)
    return qk.split([q.shape[1], k.shape[1]], dim=1)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Copy each request's blocks into a dense [R, max_blocks * block_size, H, D] tensor.

    ``index_select`` on the flattened table, not ``cache[block_tables]``: the same copy,
    at about half the cost for the small gathers of a decode step."""
    r, nb = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))     # [R * max_blocks, bs, H, D]
    return blocks.view(r, nb * cache.shape[1], *cache.shape[2:])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        q = self.num_heads * self.head_dim        # may differ from h (Qwen3)
        self.q_proj = nn.Linear(h, q, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=config.o_bias)
        # Qwen3 normalises each head's q and k over head_dim, before RoPE, which keeps
        # the attention logits from growing with the weights (QK-norm).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: KVCache, ops: dict,
                packed=None):
        t = x.shape[0]
        if packed is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:                       # one GEMM on prepacked weights (packed_gemm.PackedLayer)
            q, k, v = packed.project_qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx]
        if meta.padded:
            # One opaque op for the cache write and the attention: a compiled graph
            # keeps fixed shapes while the contexts grow every step (compiled_step.py).
            q, k = apply_rotary_qk(q, k, cos, sin)
            out = torch.ops.tinyserve.padded_decode_attention(
                q, k, v, kv_cache.k, kv_cache.v, self.layer_idx, meta.slot_mapping,
                meta.block_tables, meta.decode_context_lens, ops["decode_attention"] is not None)
        else:
            if cpu_attention.supports(q, k_cache):      # on a CPU: both in one C pass
                q = cpu_attention.rotate_and_store(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
            else:
                q, k = apply_rotary_qk(q, k, cos, sin)
                write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
            out = self.attend(q, meta, k_cache, v_cache, ops)
        out = out.reshape(t, -1)
        return self.o_proj(out) if packed is None else packed.o_proj(out)

    def attend(self, q, meta: AttentionMetadata, k_cache, v_cache, ops: dict):
        """Attend, the new tokens' K and V already in this layer's cache: decodes in one
        batched call, each prefill chunk causally over its own cached context (on a CPU
        with our kernel, short chunks in the decodes' call: ``KernelRows``)."""
        if ops["decode_attention"] is None and cpu_attention.supports(q, k_cache):
            return self._attend_on_cpu(q, meta, k_cache, v_cache)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                        meta.decode_context_lens, max(meta.context_lens[:nd]),
                                        ops["decode_attention"])
        start = nd
        for r in range(nd, len(meta.query_lens)):
            n, ctx = meta.query_lens[r], meta.context_lens[r]
            out[start:start + n] = self._prefill(q[start:start + n], k_cache, v_cache,
                                                 meta.block_tables[r], ctx)
            start += n
        return out

    def _attend_on_cpu(self, q, meta: AttentionMetadata, k_cache, v_cache):
        rows = meta.kernel_rows
        scale = q.shape[-1] ** -0.5
        if rows.count == q.shape[0]:
            return cpu_attention.decode(q, k_cache, v_cache, rows.tables, rows.lens, scale)
        out = torch.empty_like(q)
        if rows.count:
            picked = q[:rows.count] if rows.index is None else q.index_select(0, rows.index)
            done = cpu_attention.decode(picked, k_cache, v_cache, rows.tables, rows.lens, scale)
            if rows.index is None:
                out[:rows.count] = done
            else:
                out.index_copy_(0, rows.index, done)
        for r, start in rows.torch_chunks:
            n, ctx = meta.query_lens[r], meta.context_lens[r]
            out[start:start + n] = self._prefill(q[start:start + n], k_cache, v_cache,
                                                 meta.block_tables[r], ctx)
        return out

    def _prefill(self, q, k_cache, v_cache, table, ctx):
        """One request's chunk of n new tokens attends causally over its ctx cached tokens."""
        n, h_kv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
        bs = k_cache.shape[1]
        table = table[: -(-ctx // bs)]
        keys = k_cache[table].reshape(-1, h_kv, d)[:ctx]
        values = v_cache[table].reshape(-1, h_kv, d)[:ctx]
        query_pos = torch.arange(ctx - n, ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]
        # With a batch dimension of one: on a CPU, torch takes 3-D inputs down its math path
        # and 4-D ones to its flash kernel, 1.3-2.7x faster here (14 query heads over 2,
        # chunks of 32-480 tokens, fp32 and bf16; AMD EPYC Zen 4).
        o = attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                      values.transpose(0, 1)[None], attn_mask=causal,
                      enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)


# cuDNN's attention builds an execution plan for every new shape, and a decode step's
# context grows by one token per step: on a GPU it re-planned every layer of every step
# (gpu_evidence's engine part on an H200: decode steps flat in the batch size, their time
# almost all cuDNN's planning on the CPU, as torch.profiler showed). The other backends
# have no such cost.
GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q, k, v, **kwargs):
    """``scaled_dot_product_attention``, never by cuDNN on a GPU."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(GPU_ATTENTION_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store each new token's K and V in its slot (block * block_size + offset)."""
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, h_kv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, h_kv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_ctx: int, kernel=None):
    """Single-token requests at once, each over its own blocks: a fused kernel when given
    (``kernel_ops``); else on a CPU our C kernel (``cpu_attention``, where it is built);
    else pad the contexts to ``max_ctx`` and mask the padding."""
    scale = q.shape[-1] ** -0.5
    if kernel is not None:
        return kernel(q, k_cache, v_cache, block_tables, context_lens, scale)
    if cpu_attention.supports(q, k_cache):
        return cpu_attention.decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    max_blocks = -(-max_ctx // k_cache.shape[1])
    tables = block_tables[:, :max_blocks]
    keys = gather_kv(k_cache, tables)[:, :max_ctx].transpose(1, 2)    # [B, Hkv, S, D]
    values = gather_kv(v_cache, tables)[:, :max_ctx].transpose(1, 2)
    valid = None
    # Where every context is max_ctx long (always at B=1) there is no padding to mask:
    # attention without a mask is the same arithmetic, bit for bit, in about 2/3 of the time
    # (one decode row on a CPU). On a GPU this check would stall the stream.
    if q.is_cuda or int(context_lens.min()) < max_ctx:
        valid = (torch.arange(max_ctx, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    dtype = q.dtype
    if not q.is_cuda and dtype in (torch.bfloat16, torch.float16):
        # On a CPU, torch's attention for one query row is 2.5-4x slower in bf16 than
        # in fp32 (32 rows of 100-300 tokens, AMD EPYC Zen 4 with AVX512-BF16, torch
        # 2.13): half of a bf16 decode step at B=32 went there. Upcasting the gathered
        # keys and values costs far less.
        q, keys, values = q.float(), keys.float(), values.float()
    o = attention(q[:, :, None, :], keys, values, attn_mask=valid,
                  enable_gqa=q.shape[1] != k_cache.shape[2])
    return o[:, :, 0, :].to(dtype)


@torch.library.custom_op("tinyserve::padded_decode_attention", mutates_args=("k_cache", "v_cache"))
def padded_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    """``Attention.attend`` for a padded decode batch, run eagerly inside a compiled graph.

    The graph has fixed shapes (the bucket's rows, the widest table); this op
    attends over the contexts the rows actually have, which grow every step.
    vLLM splits its graphs at attention for the same reason. Padding rows write
    to a scratch slot and attend over one token: harmless, and their outputs
    are dropped. Nothing here reads a tensor back to the host on a GPU, so the
    op can sit inside a CUDA graph."""
    k_layer, v_layer = k_cache[layer], v_cache[layer]
    write_kv(k_layer, v_layer, slot_mapping, k, v)
    # The longest context bounds the padded attention: read it on a CPU; on a GPU that
    # read would stall the stream, so the table's width bounds it instead.
    max_ctx = (block_tables.shape[1] * k_layer.shape[1] if q.is_cuda
               else int(context_lens.max()))
    kernel = kernel_ops("triton")["decode_attention"] if use_kernel else None
    return decode_attention(q, k_layer, v_layer, block_tables, context_lens, max_ctx, kernel)


@padded_decode_attention.register_fake
def _padded_decode_attention_shape(q, k, v, k_cache, v_cache, layer, slot_mapping,
                                   block_tables, context_lens, use_kernel):
    return torch.empty_like(q)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x, ops: dict, packed=None):
        if packed is None:
            return self.down_proj(ops["silu_mul"](self.gate_proj(x), self.up_proj(x)))
        return packed.down_proj(ops["silu_mul"](*packed.project_gate_up(x)))


class DecoderLayer(nn.Module):
    """One block: attention and MLP, each behind a norm, with the residual threaded
    through (``residual=None`` for the first layer, whose input is the embedding)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata, kv_cache: KVCache, ops: dict,
                packed=None):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, ops)
        x = self.self_attn(x, cos, sin, meta, kv_cache, ops, packed)
        x, residual = self.post_attention_layernorm(x, residual, ops)
        return self.mlp(x, ops, packed), residual


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``, but with no random init when built on the meta device
    (``checkpoint.load_pretrained``): there ``normal_`` alone imports torch._dynamo (~1 s, ~150 MB)."""
    weight = torch.empty(num, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)               # nn.Embedding's own init
    return nn.Embedding.from_pretrained(weight, freeze=False)


class DecoderStack(nn.Module):
    """Named like transformers' ``LlamaModel`` so parameter names line up."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForServing(nn.Module):
    def __init__(self, config: ModelConfig, kernels: str = "torch"):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.use_kernels(kernels)

    def tie_weights(self) -> None:
        """With tied embeddings the output projection *is* the embedding matrix
        (one tensor, saved once): Llama 3.2 1B/3B, Qwen2.5 0.5B-3B."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_kernels(self, kernels: str) -> "LlamaForServing":
        """Run the memory-bound ops as eager torch ("torch") or fused Triton kernels ("triton")."""
        self.ops = kernel_ops(kernels)
        self.kernels = kernels
        return self

    @classmethod
    def from_seed(cls, config: ModelConfig, seed: int = 0) -> "LlamaForServing":
        """Random weights, identical on every machine for the same seed."""
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    # In place, the same numbers as torch.randn(p.shape, generator=gen),
                    # without a temporary per weight (cpu-bench: 14 MiB of them stayed
                    # with the allocator after start-up).
                    p.normal_(generator=gen)
                    if name != "model.embed_tokens.weight":
                        # 1/sqrt(fan_in) keeps activations O(1) through the stack, so
                        # logits are well separated and greedy ties (which would make
                        # token-for-token comparisons fragile) are rare.
                        p.div_(math.sqrt(p.shape[1]))
        return model.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor | None = None, packed=None) -> torch.Tensor:
        """Run the flat batch; return logits only for the rows in ``logits_indices``
        (the last new token of each request that is due to sample), or for every row.
        ``packed``: the GEMMs run on packed weights (``packed_gemm.PackedWeights``),
        which replace the dense ones once the engine packs them."""
        x = self.model.embed_tokens(input_ids)
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, meta, kv_cache, self.ops,
                                None if packed is None else packed.layers[i])
        # Only the rows that sample need the final norm and the (large) vocabulary projection.
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.model.norm(x, residual, self.ops)
        return (self.lm_head(x) if packed is None else packed.lm_head(x)).float()

