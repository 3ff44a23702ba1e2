"""Real-time trace replay: every request served, outputs unchanged, arrivals respected."""

import random

import numpy as np
import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.serving.replay import poisson_arrivals, replay


def random_prompts(n, seed, lo=1, hi=40, vocab=2045):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def workload():
    prompts = random_prompts(30, seed=3)
    rng = random.Random(4)
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    # Bursts and gaps: a few requests at once, then idle stretches the replayer must sleep through.
    offsets = [0.002 * i + (0.03 if i >= 15 else 0.0) for i in range(len(prompts))]
    return prompts, params, offsets


def test_replay_serves_every_request_with_the_same_tokens(workload):
    prompts, params, offsets = workload
    reference = LLM("tiny", seed=0, max_num_seqs=4).generate(prompts, params)
    llm = LLM("tiny", seed=0, max_num_seqs=4)
    # Shuffled trace order: outputs must still come back in trace order.
    trace = list(zip(offsets, prompts, params))[::-1]
    outputs = replay(llm.engine, trace)
    assert len(outputs) == len(prompts)
    expected = [o.token_ids for o in reference][::-1]
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finished for o in outputs)
    assert_all_blocks_free(llm.engine)


def test_replay_respects_arrival_times(workload):
    prompts, params, offsets = workload
    llm = LLM("tiny", seed=0, max_num_seqs=4)
    outputs = replay(llm.engine, list(zip(offsets, prompts, params)))
    arrivals = sorted(o.metrics.arrival_time for o in outputs)
    start = arrivals[0] - offsets[0]
    assert np.allclose(np.array(arrivals) - start, offsets, atol=1e-9)
    for out in outputs:
        m = out.metrics
        assert m.first_scheduled_time >= m.arrival_time
        assert m.ttft >= 0 and m.queue_time >= 0
        assert m.num_output_tokens == len(out.token_ids)
    # The 30 ms gap really was waited out: the second burst starts after it.
    assert min(o.metrics.first_scheduled_time for o in outputs[15:]) >= start + offsets[15]


def test_max_duration_aborts_leftovers_and_frees_blocks():
    llm = LLM("tiny", seed=0, max_num_seqs=2)
    prompts = random_prompts(40, seed=5)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    trace = [(0.001 * i, p, params) for i, p in enumerate(prompts)]
    outputs = replay(llm.engine, trace, max_duration=0.15)
    # Two seats and 200 tokens each: far from everything can finish in 0.15 s.
    assert len(outputs) < len(prompts)
    assert all(o.finished and len(o.token_ids) == 200 for o in outputs)
    assert_all_blocks_free(llm.engine)
    assert not llm.engine.requests


def test_poisson_arrivals_reproducible_sorted_and_at_the_right_rate():
    a = poisson_arrivals(200.0, 2000, seed=7)
    b = poisson_arrivals(200.0, 2000, seed=7)
    assert len(a) == 2000
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, poisson_arrivals(200.0, 2000, seed=8))
    assert np.all(np.diff(a) >= 0) and a[0] >= 0
    mean_gap = np.diff(np.concatenate([[0.0], a])).mean()
    assert abs(mean_gap - 1 / 200) < 0.1 / 200     # 2000 gaps: std of the mean ~2.2%

    window = poisson_arrivals(50.0, 10.0, seed=1)       # a float: every arrival within 10 s
    assert np.all(window < 10.0) and np.all(np.diff(window) >= 0)
    assert 400 < len(window) < 600                      # mean 500, std ~22
    np.testing.assert_array_equal(window, poisson_arrivals(50.0, 10.0, seed=1))


def test_poisson_arrivals_rejects_bad_rate():
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 10, seed=0)
