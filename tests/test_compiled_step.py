"""Compiled decode graphs (``enforce_eager=False`` on a GPU, or on a CPU where weights
cannot be packed for oneDNN) give the eager engine's greedy tokens, and a machine where
torch.compile cannot work runs eagerly after one warning. On a CPU these tests turn the
packed path (``test_packed_gemm.py``) off, so that the graphs' padding, scratch slot and
per-bucket choice, shared with the GPU, are tested here."""

from __future__ import annotations

import random
import time
import warnings

import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve import compiled_step, packed_gemm
from tinyserve.compiled_step import capture_sizes_for
from tinyserve.executor import ModelExecutor
from tinyserve.model import LlamaForServing, get_preset
from tinyserve.packed_gemm import prepacked_linear

# Small enough that a long prompt is chunked and the cache runs out (preemption);
# prompts share a prefix (prefix-cache hits); up to 4 running requests fill
# buckets 1, 2 and 4, and 3 running requests are padded to 4.
ENGINE = dict(model="tiny", max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=14,
              block_size=8, enable_prefix_caching=True)


def workload(seed=0, n=12):
    rng = random.Random(seed)
    shared = [rng.randrange(2045) for _ in range(24)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(2045) for _ in range(rng.randint(1, 50))]
        prompts.append(shared + tail if i % 2 else tail)
    params = [SamplingParams(max_tokens=rng.randint(5, 40), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module", autouse=True)
def graphs_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_gemm, "ENABLED", False)
        yield


@pytest.fixture(scope="module")
def compiled():
    # Every bucket on its graph, whichever path is faster here: these tests are about the graphs.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled_step, "CHOOSE_FASTER", False)
        return LLM(**ENGINE, enforce_eager=False)


def test_a_bucket_whose_graph_is_slower_than_eager_runs_eagerly(monkeypatch):
    # Pretend bucket 2's graph lost to eager at start: batches of 2 then run eagerly,
    # batches of 1 and 4 on their graphs, and the tokens are the same.
    measured = {1: 1.3, 2: 0.8, 4: 1.1}
    monkeypatch.setattr(compiled_step.CompiledDecode, "time_against_eager",
                        lambda self, size, pairs=compiled_step.CHOICE_PAIRS: measured[size])
    llm = LLM(**ENGINE, enforce_eager=False)
    graphs = llm.engine.executor.graphs
    assert graphs.choices == {1: "compiled", 2: "eager", 4: "compiled"}
    assert [graphs.bucket(b) for b in (1, 2, 3, 4, 5)] == [1, None, 4, 4, None]
    assert "B=2: eager (0.80x)" in graphs.describe()
    pair = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = graphs.steps_run
    got = [o.token_ids for o in llm.generate(pair, params)]
    assert graphs.steps_run == before          # every decode step had 2 rows: eager
    assert got == [o.token_ids for o in LLM(**ENGINE).generate(pair, params)]


def test_the_choice_at_start_follows_the_measured_side(monkeypatch):
    """With a clock where bucket 2's graph takes 10 ms and its eager step 1 ms (and the
    other way round in buckets 1 and 4), the start-up timing measures exactly that
    and bucket 2 alone runs eagerly."""
    model = LlamaForServing.from_seed(get_preset("tiny"))
    now, eager_slow = [0.0], {1, 4}

    def eager_step(module, args):
        now[0] += 0.010 if args[0].shape[0] in eager_slow else 0.001

    real_replay = compiled_step.CompiledDecode.replay

    def replay(self, graph_inputs):
        now[0] += 0.001 if graph_inputs[1][0].shape[0] in eager_slow else 0.010
        return real_replay(self, graph_inputs)

    model.register_forward_pre_hook(eager_step)
    monkeypatch.setattr(compiled_step.CompiledDecode, "replay", replay)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    executor = ModelExecutor(model, num_blocks=16, block_size=4, enforce_eager=False,
                             capture_sizes=(1, 2, 4))
    monkeypatch.undo()
    graphs = executor.graphs
    assert graphs.speedups == pytest.approx({1: 10.0, 2: 0.1, 4: 10.0})
    assert graphs.choices == {1: "compiled", 2: "eager", 4: "compiled"}
    assert [graphs.bucket(b) for b in (1, 2, 3, 4)] == [1, None, 4, 4]


def test_compiled_greedy_tokens_equal_eager_under_batching_chunking_caching_preemption(compiled):
    eager = LLM(**ENGINE, enforce_eager=True)
    prompts, params = workload()
    expected = eager.generate(prompts, params)
    got = compiled.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]

    executor = compiled.engine.executor
    assert not executor.enforce_eager and executor.graphs.sizes == (1, 2, 4)
    assert executor.graphs.steps_run > 0
    # The workload did exercise what the graphs must survive.
    assert sum(o.request.num_preemptions for o in got) > 0
    assert compiled.engine.block_manager.num_hit_tokens > 0
    assert max(len(p) for p in prompts) > ENGINE["max_num_batched_tokens"]
    assert compiled.engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_a_padded_bucket_gives_the_rows_of_the_exact_batch(compiled):
    # 3 requests decode together in bucket 4: the padding row changes nothing.
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = compiled.engine.executor.graphs.steps_run
    got = [o.token_ids for o in compiled.generate(prompts, params)]
    one_by_one = [compiled.generate(p, params)[0].token_ids for p in prompts]
    assert got == one_by_one
    assert compiled.engine.executor.graphs.steps_run > before


def test_without_a_cpp_compiler_the_engine_warns_once_and_runs_eagerly(tmp_path, monkeypatch):
    # A fresh Inductor cache, so that no kernel compiled earlier can be loaded instead.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (str(tmp_path / "no-such-c++"),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM("tiny", max_num_seqs=2, enforce_eager=False)
    ours = [w for w in caught if "enforce_eager=False" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert "running eagerly" in str(ours[0].message)
    assert llm.engine.executor.enforce_eager
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert (llm.generate("hello", params)[0].token_ids
            == LLM("tiny", max_num_seqs=2).generate("hello", params)[0].token_ids)


def test_buckets_reach_max_num_seqs_and_no_further():
    assert capture_sizes_for(8) == (1, 2, 4, 8)
    assert capture_sizes_for(5) == (1, 2, 4, 8)
    assert capture_sizes_for(1) == (1,)
    assert capture_sizes_for(100, (1, 2, 4)) == (1, 2, 4)     # larger batches run eagerly
    with pytest.raises(ValueError, match="capture_sizes"):
        capture_sizes_for(4, (0, 2))


def test_enforce_eager_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="enforce_eager must be True, False or None"):
        LLM("tiny", enforce_eager="no")


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_a_prepacked_weight_multiplies_like_a_linear_layer(batch):
    gen = torch.Generator().manual_seed(batch)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(batch, 64, generator=gen)
    layer = prepacked_linear(weight, batch)
    if layer is None:
        pytest.skip("this torch has no MKL")
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert prepacked_linear(weight.double(), batch) is None      # only fp32 packs
