"""``enforce_eager=False`` on a CPU: decode steps on weights packed once for oneDNN give
the eager engine's greedy tokens (transformers' are checked in test_checkpoints.py), and
a bucket where packing measured slower runs eagerly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_compiled_step import ENGINE, workload
from tinyserve import LLM, SamplingParams, packed_gemm
from tinyserve.model import get_preset, LlamaForServing

pytestmark = pytest.mark.skipif(not packed_gemm.onednn_available(),
                                reason="this torch has no oneDNN")


def test_packed_greedy_tokens_equal_eager_under_batching_chunking_caching_preemption(monkeypatch):
    monkeypatch.setattr(packed_gemm, "CHOOSE_FASTER", False)     # every bucket packed
    packed, eager = LLM(**ENGINE, enforce_eager=False), LLM(**ENGINE, enforce_eager=True)
    prompts, params = workload(seed=1)
    expected = eager.generate(prompts, params)
    got = packed.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    executor = packed.engine.executor
    assert executor.packed is not None and executor.graphs is None and not executor.enforce_eager
    assert executor.packed.sizes == (1, 2, 4) and executor.packed.steps_run > 0
    assert sum(o.request.num_preemptions for o in got) > 0
    assert packed.engine.block_manager.num_hit_tokens > 0
    assert packed.engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_a_bucket_where_packing_is_slower_runs_eagerly(monkeypatch):
    measured = {1: 1.3, 2: 0.8, 4: 1.1}
    monkeypatch.setattr(packed_gemm.PackedDecode, "time_against_eager",
                        lambda self, size, pairs=packed_gemm.CHOICE_PAIRS: measured[size])
    llm = LLM(**ENGINE, enforce_eager=False)
    path = llm.engine.executor.packed
    assert path.choices == {1: "packed", 2: "eager", 4: "packed"}
    assert "B=2: eager (0.80x)" in path.describe()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = path.steps_run
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)      # every decode step has 2 rows
    assert path.steps_run == before
    llm.generate([[5, 6, 7], [8, 9, 10, 11], [12], [13, 14]], params)
    assert path.steps_run > before                           # 3 and 4 rows: bucket 4
    assert path.use_for(5) is None                           # past the largest bucket


def test_the_choice_at_start_is_a_measured_ratio_for_every_bucket():
    path = LLM(**ENGINE, enforce_eager=False).engine.executor.packed
    assert set(path.speedups) == set(path.sizes)
    assert all(0 < r < float("inf") for r in path.speedups.values())
    assert all(path.choices[s] == ("packed" if path.speedups[s] >= 1.0 else "eager")
               for s in path.sizes)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_layers_compute_what_the_linear_layers_compute(bias):

    config = dataclasses.replace(get_preset("tiny"), qkv_bias=bias, mlp_bias=bias, o_bias=bias)
    model = LlamaForServing.from_seed(config, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    layer, packed = model.model.layers[0], packed_gemm.PackedWeights(model).layers[0]
    x = torch.randn(5, config.hidden_size)
    attn, mlp = layer.self_attn, layer.mlp
    for got, linear in zip(packed.project_qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    for got, linear in zip(packed.project_gate_up(x), (mlp.gate_proj, mlp.up_proj)):
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    y = torch.randn(5, config.intermediate_size)
    torch.testing.assert_close(packed.down_proj(y), mlp.down_proj(y), rtol=1e-5, atol=1e-5)


def test_other_dtypes_are_not_packed():
    model = LlamaForServing.from_seed(get_preset("tiny")).to(torch.bfloat16)
    assert not packed_gemm.supported(model)


def test_the_default_packs_weights_larger_than_the_last_level_cache(monkeypatch):
    from tinyserve import engine, host
    model = LlamaForServing.from_seed(get_preset("tiny"))
    size = packed_gemm.weight_bytes(model)
    monkeypatch.setattr(host, "l3_cache_bytes", lambda: size - 1)
    assert engine.default_enforce_eager(model) is False           # streams from memory: pack
    monkeypatch.setattr(host, "l3_cache_bytes", lambda: size)
    assert engine.default_enforce_eager(model) is True            # fits in the cache: eager
    assert engine.default_enforce_eager(model.to(torch.bfloat16)) is True


def test_weight_bytes_count_a_tied_output_projection_once():
    model = LlamaForServing.from_seed(get_preset("tiny"))
    assert model.config.tie_word_embeddings is False
    untied = packed_gemm.weight_bytes(model)
    expected = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert untied == expected
    tied = LlamaForServing.from_seed(dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True))
    assert packed_gemm.weight_bytes(tied) == expected      # the table, read once, as lm_head
