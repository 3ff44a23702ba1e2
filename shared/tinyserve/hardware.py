"""Roofline arithmetic for a decode step: hardware and model specs, and their presets.

This is the model behind the chapter section 「批多大才划算」. In a decode
step every running request contributes one new token, and the step has two
costs:

* **Reading the weights.** Each step streams every parameter from memory once,
  however many requests share it. For a 7B-parameter model in fp16 that is
  7e9 x 2 bytes = 14 GB; at an A100's 2039 GB/s it takes about 6.9 ms. This is
  the floor of the step time, already paid at batch size 1.
* **Computing.** One token costs about 2 FLOPs per parameter (a multiply and an
  add), 14 GFLOP for the 7B model, which the A100's 312 TFLOP/s of dense fp16
  tensor-core throughput finishes in about 45 us. This cost grows with the batch.

While batch x 45 us is below 6.9 ms the arithmetic hides under the memory
traffic, the step time stays flat and throughput grows linearly with the batch.
The two meet at 6.9 ms / 45 us = 153 requests. That ratio is no accident: the
bytes per parameter and the 2 FLOPs per parameter cancel (exactly, in fp16),
leaving peak FLOP/s / bandwidth = 312e12 / 2039e9 = 153, the arithmetic
intensity at which the hardware turns from memory-bound to compute-bound.
Past the crossover every extra request makes every user's step longer, which is
why engines keep the batch near it rather than in the thousands.

``decode_step_time`` puts both costs into one roofline,
``max(bytes / bandwidth, FLOPs / peak)``, and also counts the KV cache that
attention reads once ``context_len > 0``. ``tinyserve.measure`` measures the two
ceilings of the machine it runs on and locates the crossover in a measured curve.

All times are in seconds, sizes in bytes, throughputs in FLOP/s and bytes/s.
Dtypes are strings: "fp32", "tf32", "fp16", "bf16", "fp8", "int8".

>>> crossover_batch(A100_SXM_80GB, LLAMA_7B, "fp16")  # doctest: +ELLIPSIS
153.0...
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

BYTES_PER_ELEMENT: dict[str, int] = {
    "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1,
}


def lookup(table: dict, name: str, what: str):
    """``table[name]``, or a ValueError that lists the choices."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]


def bytes_per_element(dtype: str) -> int:
    return lookup(BYTES_PER_ELEMENT, dtype, "dtype")


# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class HardwareSpec:
    """The ceilings of one accelerator (or CPU).

    ``flops`` maps a dtype to the dense peak in FLOP/s (no structured
    sparsity); ``memory_bandwidth`` is in bytes/s and ``memory_size`` in bytes.
    ``source`` says where the figures come from.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory_size: float
    source: str = ""

    def peak_flops(self, dtype: str) -> float:
        bytes_per_element(dtype)  # validates the name
        if dtype not in self.flops:
            raise ValueError(f"{self.name}: no peak FLOP/s for dtype {dtype!r}; "
                             f"known: {sorted(self.flops)}")
        return self.flops[dtype]

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte at which compute time equals memory time."""
        return self.peak_flops(dtype) / self.memory_bandwidth


T = 1e12
# Memory sizes are binary: what a datasheet prints as "80GB" of HBM is 80 GiB (nvidia-smi
# shows an A100 80GB as 81,920 MiB and an RTX 4090 as 24,564 MiB). Bandwidths and FLOP/s
# are decimal, as printed.
GiB = 2**30
A100_SXM_80GB = HardwareSpec(
    name="A100-SXM4-80GB",
    flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T, "int8": 624 * T},
    memory_bandwidth=2039e9,
    memory_size=80 * GiB,
    source="NVIDIA A100 datasheet, SXM 80GB column, dense (fp32 without tensor cores)",
)
H100_SXM = HardwareSpec(
    name="H100-SXM5-80GB",
    flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989 * T, "bf16": 989 * T,
           "fp8": 1979 * T, "int8": 1979 * T},
    memory_bandwidth=3.35e12,
    memory_size=80 * GiB,
    source="NVIDIA H100 datasheet, SXM column, dense (half the with-sparsity figures)",
)
# The same Ampere chip with the first, smaller HBM2 (same FLOP/s).
A100_SXM_40GB = dataclasses.replace(
    A100_SXM_80GB,
    name="A100-SXM4-40GB",
    memory_bandwidth=1555e9,
    memory_size=40 * GiB,
    source="NVIDIA A100 datasheet, 40GB columns (1,555 GB/s), dense (fp32 without tensor cores)",
)
# The same Hopper chip as the H100 (same FLOP/s), with more and faster HBM.
H200 = dataclasses.replace(
    H100_SXM,
    name="H200-SXM-141GB",
    memory_bandwidth=4.8e12,
    memory_size=141 * GiB,
    source="NVIDIA H200 datasheet, SXM column, dense (half the with-sparsity figures)",
)

# GPUs readers own or rent. All figures dense (no structured sparsity). Where a table gives
# FP16 tensor throughput with FP16 and with FP32 accumulate (the GeForce whitepapers do, and
# GeForce cards run FP32 accumulate at half rate), we take FP32 accumulate: PyTorch's fp16 /
# bf16 matmuls accumulate in fp32. Sizes are binary, as above (24 GB -> 24 GiB).
RTX_3090 = HardwareSpec(
    name="GeForce-RTX-3090-24GB",
    flops={
        "fp32": 35.6 * T,   # GA102 whitepaper, Appendix A Table 9: Peak FP32 TFLOPS (non-Tensor) 35.6
        "fp16": 71 * T,     # same table: Peak FP16 Tensor TFLOPS with FP32 Accumulate 71/142 (dense/sparse)
        #                     (with FP16 accumulate it is 142/284; not used, see above)
        "bf16": 71.2 * T,   # RTX Blackwell whitepaper, Table 3, RTX 3090 column: Peak BF16 Tensor
        #                     TFLOPS with FP32 Accumulate 71.2/142.4 (the GA102 BF16 row was not
        #                     retrievable; 71.2 is the same rate, rounded differently)
        "int8": 284 * T,    # GA102 whitepaper, Appendix A Table 9: Peak INT8 Tensor TOPS 284/568
        # no fp8: Ampere tensor cores have none
    },
    memory_bandwidth=936e9,  # GA102 whitepaper, Appendix A Table 9: Memory Bandwidth 936 GB/sec
    memory_size=24 * GiB,     # same table: 24 GB GDDR6X
    source=("NVIDIA Ampere GA102 GPU architecture whitepaper, Appendix A Table 9 (GeForce RTX 3090), "
            "dense, fp16 with FP32 accumulate; bf16 from the NVIDIA RTX Blackwell GPU architecture "
            "whitepaper, Table 3 (RTX 3090 column), BF16 with FP32 accumulate"),
)
RTX_4090 = HardwareSpec(
    name="GeForce-RTX-4090-24GB",
    flops={
        "fp32": 82.6 * T,   # Ada whitepaper, Appendix A (RTX 4090): Peak FP32 TFLOPS (non-Tensor) 82.6
        "fp16": 165.2 * T,  # same: Peak FP16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4
        #                     (with FP16 accumulate 330.3/660.6; not used, see above)
        "bf16": 165.2 * T,  # same: Peak BF16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4
        "fp8": 330.3 * T,   # same: Peak FP8 Tensor TFLOPS with FP32 Accumulate 330.3/660.6 (the
        #                     value as corrected in whitepaper v2.02, footnote 4; FP16 accumulate
        #                     is 660.6/1321.2). torch._scaled_mm accumulates fp8 in fp32.
        "int8": 660.6 * T,  # same: Peak INT8 Tensor TOPS 660.6/1321.2
    },
    memory_bandwidth=1008e9,  # same: Memory Bandwidth 1008 GB/sec
    memory_size=24 * GiB,     # same: 24 GB GDDR6X
    source=("NVIDIA Ada Lovelace GPU architecture whitepaper (AD102), Appendix A (GeForce RTX 4090), "
            "dense, fp16/bf16/fp8 with FP32 accumulate"),
)
L4 = HardwareSpec(
    name="L4-24GB",
    # The L4 datasheet prints the tensor figures with sparsity only ("* with sparsity"):
    # FP16 242*, FP8 485*, INT8 485* TOPS. Dense is half, as for the H100 above.
    flops={
        "fp32": 30.3 * T,   # L4 datasheet: FP32 30.3 TFLOPS (non-tensor)
        "fp16": 121 * T,    # L4 datasheet: FP16 Tensor Core 242 TFLOPS*, halved
        "fp8": 242.5 * T,   # L4 datasheet: FP8 Tensor Core 485 TFLOPS*, halved
        "int8": 242.5 * T,  # L4 datasheet: INT8 Tensor Core 485 TOPS*, halved
        # bf16 left out: the datasheet's BFLOAT16 row could not be retrieved (only
        # third-party copies), so no sourced figure; use fp16 for the L4.
    },
    memory_bandwidth=300e9,  # L4 datasheet: GPU memory bandwidth 300 GB/s
    memory_size=24 * GiB,     # L4 datasheet: 24 GB GDDR6
    source="NVIDIA L4 datasheet, dense (half the with-sparsity tensor figures)",
)
L40S = HardwareSpec(
    name="L40S-48GB",
    # The L40S datasheet prints dense | sparse* pairs and does not name the accumulator.
    flops={
        "fp32": 91.6 * T,    # L40S datasheet: FP32 91.6 TFLOPS
        "tf32": 183 * T,     # L40S datasheet: TF32 Tensor Core 183 | 366* TFLOPS
        "fp16": 362.05 * T,  # L40S datasheet: FP16 Tensor Core 362.05 | 733* TFLOPS
        "bf16": 362.05 * T,  # L40S datasheet: BFLOAT16 Tensor Core 362.05 | 733* TFLOPS
        "fp8": 733 * T,      # L40S datasheet: FP8 Tensor Core 733 | 1,466* TFLOPS
        # int8 left out: the retrieved copies of the datasheet leave the L40S INT8 cell blank.
    },
    memory_bandwidth=864e9,  # L40S datasheet: memory bandwidth 864 GB/s
    memory_size=48 * GiB,     # L40S datasheet: 48 GB GDDR6 with ECC
    source="NVIDIA L40S datasheet, dense (the first of each dense | sparse* pair)",
)
del T, GiB

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "A100_SXM_80GB": A100_SXM_80GB,
    "H100_SXM": H100_SXM,
    "H200": H200,
    "RTX_3090": RTX_3090,
    "RTX_4090": RTX_4090,
    "L4": L4,
    "L40S": L40S,
    "A100_SXM_40GB": A100_SXM_40GB,
}


def get_hardware(name: str) -> HardwareSpec:
    return lookup(HARDWARE_PRESETS, name, "hardware preset")


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """What the roofline needs to know about a decoder-only model.

    ``embedding_parameters`` is the input embedding table when it is not tied to
    the output head: a step gathers only its tokens' rows of it, so it counts in
    memory (``weight_bytes``) but is not streamed. The pure roofline ignores it;
    ``tinyserve.sim.cost_model``'s calibrated models do not.
    """

    name: str
    num_parameters: float
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    embedding_parameters: float = 0.0

    @classmethod
    def from_config(cls, config, name: str = "custom") -> "ModelSpec":
        """From a ``tinyserve.model.ModelConfig`` (e.g. the ``cpu-bench`` preset)."""
        return cls(name=name, num_parameters=config.num_parameters(),
                   hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   vocab_size=config.vocab_size,
                   embedding_parameters=0 if config.tie_word_embeddings
                   else config.vocab_size * config.hidden_size)


# Parameter counts rounded the way the chapter rounds them (7e9 -> 14 GB in fp16).
LLAMA_7B = ModelSpec("Llama-7B", 7e9, hidden_size=4096, num_layers=32,
                     num_kv_heads=32, head_dim=128, vocab_size=32000)
LLAMA_13B = ModelSpec("Llama-13B", 13e9, hidden_size=5120, num_layers=40,
                      num_kv_heads=40, head_dim=128, vocab_size=32000)
LLAMA_70B = ModelSpec("Llama-70B", 70e9, hidden_size=8192, num_layers=80,
                      num_kv_heads=8, head_dim=128, vocab_size=32000)  # grouped-query attention


# Open 7-8B checkpoints, counted exactly from their config.json (untied embeddings,
# grouped-query attention); tests/test_cost_model.py rebuilds each count from the config.
MISTRAL_7B = ModelSpec("Mistral-7B-v0.3", 7_248_023_552, hidden_size=4096, num_layers=32,
                       num_kv_heads=8, head_dim=128, vocab_size=32768,
                       embedding_parameters=32768 * 4096)
LLAMA_3_8B = ModelSpec("Llama-3-8B", 8_030_261_248, hidden_size=4096, num_layers=32,
                       num_kv_heads=8, head_dim=128, vocab_size=128256,
                       embedding_parameters=128256 * 4096)        # Llama 3.1 8B has the same shapes
QWEN2_5_7B = ModelSpec("Qwen2.5-7B", 7_615_616_512, hidden_size=3584, num_layers=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064,
                       embedding_parameters=152064 * 3584)

MODELS: dict[str, ModelSpec] = {"LLAMA_7B": LLAMA_7B, "LLAMA_13B": LLAMA_13B, "LLAMA_70B": LLAMA_70B,
                                "MISTRAL_7B": MISTRAL_7B, "LLAMA_3_8B": LLAMA_3_8B,
                                "QWEN2_5_7B": QWEN2_5_7B}


# --------------------------------------------------------------------------- roofline


def weight_bytes(model: ModelSpec, dtype: str) -> float:
    return model.num_parameters * bytes_per_element(dtype)


def weight_read_time(hw: HardwareSpec, model: ModelSpec, dtype: str) -> float:
    """Streaming every weight once: the floor of a decode step."""
    return weight_bytes(model, dtype) / hw.memory_bandwidth


def per_request_compute_time(hw: HardwareSpec, model: ModelSpec, dtype: str) -> float:
    """2 FLOPs per parameter for one new token, at peak."""
    return 2 * model.num_parameters / hw.peak_flops(dtype)


def crossover_batch(hw: HardwareSpec, model: ModelSpec, dtype: str, context_len: float = 0.0) -> float:
    """Batch size at which a decode step's compute catches up with its memory traffic.

    With ``context_len = 0`` only the weights are read: peak / bandwidth x (bytes per
    parameter / 2), the ridge point itself in fp16. Each request also reads its KV
    cache (``context_len`` tokens) and attends over it, so the crossover moves right
    as contexts grow; ``math.inf`` when a request's KV read alone takes longer than
    its compute (the step stays memory-bound at any batch).
    """
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    per_request = (step_flops(model, 1, context_len) / hw.peak_flops(dtype)
                   - context_len * kv_bytes_per_token(model, dtype) / hw.memory_bandwidth)
    return weight_read_time(hw, model, dtype) / per_request if per_request > 0 else math.inf


def kv_bytes_per_token(model: ModelSpec, dtype: str) -> float:
    """K and V of one token, all layers."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_element(dtype)


def _check_batch(batch: float, context_len: float) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")


def step_bytes(model: ModelSpec, dtype: str, kv_tokens: float) -> float:
    """Bytes one forward pass moves: every weight once, plus ``kv_tokens`` tokens of KV cache."""
    return weight_bytes(model, dtype) + kv_tokens * kv_bytes_per_token(model, dtype)


def step_flops(model: ModelSpec, tokens: float, attention_pairs: float) -> float:
    """2 FLOPs per parameter per new token, plus attention: QK^T and PV are 2 x 2 x hidden
    FLOPs per (query, key) pair per layer."""
    return 2 * model.num_parameters * tokens + 4 * model.num_layers * model.hidden_size * attention_pairs


def step_time(hw: HardwareSpec, model: ModelSpec, dtype: str, tokens: float, kv_tokens: float,
              attention_pairs: float) -> float:
    """Roofline of any step (prefill chunks and decodes mixed): the slower of memory and compute."""
    return max(step_bytes(model, dtype, kv_tokens) / hw.memory_bandwidth,
               step_flops(model, tokens, attention_pairs) / hw.peak_flops(dtype))


def decode_step_bytes(model: ModelSpec, batch: float, dtype: str, context_len: float = 0) -> float:
    """Weights once, plus every request's KV cache."""
    _check_batch(batch, context_len)
    return step_bytes(model, dtype, batch * context_len)


def decode_step_flops(model: ModelSpec, batch: float, context_len: float = 0) -> float:
    """One new token per request, each attending over ``context_len`` tokens."""
    _check_batch(batch, context_len)
    return step_flops(model, batch, batch * context_len)


def decode_step_time(hw: HardwareSpec, model: ModelSpec, batch: float, dtype: str,
                     context_len: float = 0) -> float:
    """Roofline of a decode step: ``step_time`` with one token per request."""
    _check_batch(batch, context_len)
    return step_time(hw, model, dtype, batch, batch * context_len, batch * context_len)


def arithmetic_intensity(model: ModelSpec, batch: float, dtype: str, context_len: float = 0) -> float:
    """FLOPs per byte moved in one decode step (= batch in fp16 when context_len = 0)."""
    return decode_step_flops(model, batch, context_len) / decode_step_bytes(model, batch, dtype, context_len)


def tokens_per_second(hw: HardwareSpec, model: ModelSpec, batch: float, dtype: str,
                      context_len: float = 0) -> tuple[float, float]:
    """(per-user tokens/s, total tokens/s) at this batch size."""
    step = decode_step_time(hw, model, batch, dtype, context_len)
    return 1.0 / step, batch / step
