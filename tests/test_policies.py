"""Scheduling policies: each one's choice on hand-built queues, and on the real engine."""

from __future__ import annotations

import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.policies import (POLICIES, BucketPolicy, FCFSPolicy, PriorityPolicy, SJFPolicy,
                                make_policy)
from tinyserve.request import Request, RequestStatus
from tinyserve.scheduler import SchedulerConfig


def req(rid, prompt_len, arrival=0.0, priority=0, hint=None):
    return Request(str(rid), [5] * prompt_len, SamplingParams(max_tokens=4), arrival_time=arrival,
                   priority=priority, output_len_hint=hint)


def test_fcfs_takes_the_head():
    assert FCFSPolicy().select([req(0, 50), req(1, 2)], now=1.0) == 0


def test_sjf_takes_the_shortest_prompt_and_breaks_ties_by_position():
    waiting = [req(0, 50), req(1, 7), req(2, 9), req(3, 7)]
    assert SJFPolicy().select(waiting, now=0.0) == 1


def test_sjf_adds_the_output_hint_when_given():
    waiting = [req(0, 10, hint=100), req(1, 40, hint=5)]
    assert SJFPolicy().select(waiting, now=0.0) == 1          # 45 < 110
    assert SJFPolicy().select([req(0, 10), req(1, 40, hint=5)], now=0.0) == 0


def test_sjf_aging_lets_a_long_request_through_after_waiting():
    # Effective size = size - aging * wait. Aging is linear, so between two requests it
    # only matters how much earlier one came: 990 tokens of difference / 100 per second
    # means a short request must arrive within 9.9 s of the long one to overtake it.
    policy = SJFPolicy(aging=100.0)
    long_request = req(0, 1000, arrival=0.0)
    assert policy.select([long_request, req(1, 10, arrival=9.0)], now=20.0) == 1
    assert policy.select([long_request, req(1, 10, arrival=10.0)], now=20.0) == 0
    assert SJFPolicy().select([long_request, req(1, 10, arrival=1e5)], now=1e6) == 1  # no aging


def test_priority_lower_value_first_and_aging_bounds_the_wait():
    # At 1 level per second, priority 10 goes ahead of priority-0 requests arriving > 10 s later.
    low = req(0, 5, arrival=0.0, priority=10)
    aging = PriorityPolicy(aging=1.0)
    assert aging.select([low, req(1, 5, arrival=4.0, priority=0)], now=30.0) == 1
    assert aging.select([low, req(1, 5, arrival=11.0, priority=0)], now=30.0) == 0
    assert PriorityPolicy(aging=0.0).select([low, req(1, 5, arrival=1e5)], now=1e6) == 1


def test_priority_with_equal_priorities_is_fcfs():
    waiting = [req(i, 100 - i, arrival=i * 0.1) for i in range(6)]
    assert PriorityPolicy(aging=3.0).select(waiting, now=2.0) == 0


def test_bucket_admits_one_bucket_per_step_and_none_when_it_is_empty():
    policy = BucketPolicy(boundaries=(16, 64))
    waiting = [req(0, 30), req(1, 5), req(2, 40), req(3, 200)]
    assert policy.select(waiting, now=1.0) == 0                 # head's bucket: (16, 64]
    del waiting[0]
    assert policy.select(waiting, now=1.0) == 1                 # same step, same bucket
    del waiting[1]
    assert policy.select(waiting, now=1.0) is None              # no more of that bucket now
    assert policy.select(waiting, now=2.0) == 0                 # next step: the new head's bucket


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_resumes_a_preempted_request_first(name):
    preempted = req(9, 500, arrival=5.0, priority=99)
    preempted.status = RequestStatus.PREEMPTED
    waiting = [preempted, req(0, 1, arrival=0.0), req(1, 2)]
    assert make_policy(name).select(waiting, now=6.0) == 0


def test_bad_policies_are_rejected():
    with pytest.raises(ValueError, match="policy: unknown policy 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="policy: unknown policy"):
        SchedulerConfig(policy="shortest")
    with pytest.raises(ValueError, match="aging must be >= 0"):
        SJFPolicy(aging=-1)
    with pytest.raises(ValueError, match="aging must be >= 0"):
        PriorityPolicy(aging=-0.5)
    with pytest.raises(ValueError, match="boundaries must be increasing"):
        BucketPolicy(boundaries=(64, 16))
    policy = SJFPolicy(aging=5.0)
    assert make_policy(policy) is policy


# ---- on the real engine ------------------------------------------------------------

PROMPTS = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([40, 3, 25, 9, 60, 2, 14, 33])]


def _generate(policy, **kw):
    llm = LLM("tiny", seed=0, max_num_seqs=3, max_num_batched_tokens=32, policy=policy,
              enable_prefix_caching=False, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return llm, outs


@pytest.fixture(scope="module")
def fcfs_run():
    return _generate("fcfs")


@pytest.mark.parametrize("policy", ["sjf", "priority", "bucket", "decode-first", "prefill-first",
                                    SJFPolicy(aging=50.0), BucketPolicy((8, 32))])
def test_policies_change_the_order_not_the_tokens(fcfs_run, policy):
    _, reference = fcfs_run
    llm, outs = _generate(policy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_sjf_on_the_engine_starts_short_prompts_first(fcfs_run):
    llm, _ = _generate("sjf")
    first_steps = {rid for rid, _ in llm.engine.step_stats[0].batch}
    # Three seats: the three shortest prompts (ids 5, 1, 3) start; FCFS starts 0, 1, 2.
    assert first_steps == {"5", "1", "3"}
    assert {rid for rid, _ in fcfs_run[0].engine.step_stats[0].batch} == {"0"}   # 40 tokens fill the budget


def test_prefill_first_never_mixes_prefill_and_decode_in_one_step():
    llm, _ = _generate("prefill-first")
    stats = llm.engine.step_stats
    assert all(s.num_prefill_tokens == 0 or s.num_decode_tokens == 0 for s in stats)
    assert any(s.num_prefill_tokens for s in stats) and any(s.num_decode_tokens for s in stats)
    fcfs, _ = _generate("decode-first")
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in fcfs.engine.step_stats)
