"""Property-based fuzzing of the engine core with hypothesis.

Random workloads: duplicate prompts admitted in one step, shared prefixes of
every length around block boundaries, caches small enough to force
preemption, aborts mid-prefill and mid-decode, token budgets of 1-64 and block
sizes of 1-16. Whatever happens, greedy output equals the same prompt run
alone, with and without prefix caching; ``check_integrity`` holds after every
step; every block is free at the end.

The default run is short; ``TINYSERVE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_engine.py``
runs a long one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tinyserve import LLM, SamplingParams
from tinyserve.engine import LLMEngine
from tinyserve.kv_cache import blocks_for
from tinyserve.request import RequestStatus
from tinyserve.scheduler import SchedulerConfig

EXAMPLES = int(os.environ.get("TINYSERVE_FUZZ_EXAMPLES", "250"))
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference():
    """The prompt run alone, on an engine that never caches: prompt -> greedy tokens."""
    llm = LLM("tiny", seed=0, enable_prefix_caching=False)
    memo: dict[tuple[int, ...], list[int]] = {}

    def alone(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            memo[key] = llm.generate([prompt], params)[0].token_ids
        return memo[key]

    alone.llm = llm
    return alone


@dataclass
class Arrival:
    prompt: list[int]
    max_tokens: int
    step: int                    # added before this step
    abort_after: int | None      # aborted this many steps after it was added
    # A later turn: the first k output tokens of arrival j, then this prompt.
    follow_up: tuple[int, int] | None = None


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4) | st.integers(1, 16))     # small blocks fill often
    # A few shared prefixes, each a block boundary -1, 0 or +1 tokens long, cut
    # from a common text at a block-aligned offset (so one prompt's later block can
    # hold another prompt's first block).
    base = [draw(st.integers(10, 2000)) for _ in range(48)]
    prefixes = []
    for _ in range(draw(st.integers(1, 3))):
        offset = block_size * draw(st.integers(0, 2))
        length = max(1, block_size * draw(st.integers(0, 2)) + draw(st.integers(-1, 1)))
        prefixes.append(base[offset:offset + length] or base[:1])
    pool = [prefix + draw(st.lists(st.integers(10, 2000), max_size=5)) for prefix in prefixes]
    arrivals = []
    for i in range(draw(st.integers(1, 8))):
        follow_up, step = None, draw(st.integers(0, 2))
        if i and draw(st.booleans()):
            follow_up = (draw(st.integers(0, i - 1)), draw(st.integers(1, MAX_TOKENS)))
            step = arrivals[follow_up[0]].step + draw(st.integers(1, 10))
        arrivals.append(Arrival(prompt=list(draw(st.sampled_from(pool))),   # duplicates are likely
                                max_tokens=draw(st.integers(1, MAX_TOKENS)),
                                step=step,
                                abort_after=draw(st.none() | st.integers(0, 6)),
                                follow_up=follow_up))
    for a in arrivals:       # resolve follow-ups to their prompt's length bound
        if a.follow_up is not None:
            a.prompt = [0] * a.follow_up[1] + a.prompt
    longest = max(blocks_for(len(a.prompt) + a.max_tokens, block_size) for a in arrivals)
    knobs = dict(block_size=block_size,
                 max_num_seqs=draw(st.integers(1, 8)),
                 max_num_batched_tokens=draw(st.integers(1, 64)),
                 # As few blocks as the longest request needs, plus a little: preemption.
                 num_kv_blocks=longest + draw(st.integers(0, 6)))
    return knobs, arrivals


def resolve(arrivals: list[Arrival], alone) -> list[list[int]]:
    """Prompts with follow-ups filled in from the earlier turn's greedy output."""
    prompts = []
    for a in arrivals:
        if a.follow_up is None:
            prompts.append(a.prompt)
        else:
            j, k = a.follow_up
            prompts.append(alone(prompts[j])[:k] + a.prompt[k:])
    return prompts


def run(llm: LLM, knobs: dict, arrivals: list[Arrival], prompts: list[list[int]],
        caching: bool) -> dict[int, list[int]]:
    config = SchedulerConfig(max_num_seqs=knobs["max_num_seqs"],
                             max_num_batched_tokens=knobs["max_num_batched_tokens"],
                             block_size=knobs["block_size"], max_model_len=512)
    engine = LLMEngine(llm.model, llm.tokenizer, config, knobs["num_kv_blocks"],
                       enable_prefix_caching=caching)
    bm = engine.block_manager
    ids, done, step = {}, {}, 0
    last_arrival = max(a.step for a in arrivals)
    while step <= last_arrival or engine.has_unfinished_requests():
        for i, a in enumerate(arrivals):
            if a.step == step:
                ids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=a.max_tokens,
                                                                     ignore_eos=True))
            if a.abort_after is not None and a.step + a.abort_after == step and i in ids:
                request = engine.requests.get(ids[i])
                if request is not None and request.status is not RequestStatus.FINISHED:
                    engine.abort(ids[i])
                    done[i] = None
        for out in engine.step():
            if out.finished:
                done[next(i for i, rid in ids.items() if rid == out.request_id)] = out.token_ids
        bm.check_integrity()
        step += 1
        assert step < 2000, "the engine did not finish the workload"
    assert bm.num_free_blocks == bm.num_blocks
    assert len(done) == len(arrivals), "a request was lost"
    return done


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_workloads_keep_greedy_output_and_every_block(reference, workload):
    knobs, arrivals = workload
    prompts = resolve(arrivals, reference)
    for caching in (True, False):
        done = run(reference.llm, knobs, arrivals, prompts, caching)
        for i, tokens in done.items():
            if tokens is not None:
                assert tokens == reference(prompts[i])[:arrivals[i].max_tokens], \
                    f"request {i} (caching={caching}, {knobs})"
