"""The server's engine thread (``serving.engine_loop.EngineLoop``) driven directly,
without HTTP: what a client gets when the engine cannot make progress."""

from __future__ import annotations

import asyncio

import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.policies import Policy
from tinyserve.serving.engine_loop import EngineError, EngineLoop

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
SHORT = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
LONG = list(range(20, 40))                     # 20 tokens: the policy below never admits it


class ShortPromptsOnly(Policy):
    """A user policy with a bug: it never admits a prompt longer than 8 tokens, so when
    such a request is all that is left, nothing can be scheduled (a stall)."""
    name = "short-only"

    def choose(self, waiting, now, running):
        return next((i for i, r in enumerate(waiting) if r.num_prompt_tokens <= 8), None)


async def collect(queue: asyncio.Queue) -> list[int] | EngineError:
    """A client: its tokens, or the error it got. The timeout only turns a hang into a
    failure; nothing is measured with it."""
    tokens = []
    while True:
        item = await asyncio.wait_for(queue.get(), timeout=60)
        if isinstance(item, Exception):
            return item
        tokens += item.token_ids
        if item.finished:
            return tokens


def test_a_stall_fails_the_head_of_the_queue_and_the_others_are_served():
    reference = [o.token_ids for o in LLM("tiny", seed=0).generate(SHORT, PARAMS)]
    engine = LLM("tiny", seed=0, policy=ShortPromptsOnly()).engine
    steps = {"ok": 0, "failed": 0}
    step = engine.step

    def counted_step():
        # Every call the engine thread makes, including the ones that raise: a thread
        # that spins on a stall makes them without end.
        try:
            out = step()
        except Exception:
            steps["failed"] += 1
            raise
        steps["ok"] += 1
        return out
    engine.step = counted_step
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        queues = [asyncio.Queue() for _ in range(1 + len(SHORT))]
        long_id = await loop.add(LONG, PARAMS, queues[0])     # first: at the head of the queue
        for prompt, queue in zip(SHORT, queues[1:]):
            await loop.add(prompt, PARAMS, queue)
        results = await asyncio.gather(*(collect(q) for q in queues))
        # Two snapshots from the engine thread, each taken between two of its iterations.
        first = await loop.call(lambda e: (dict(steps), e.has_unfinished_requests()))
        second = await loop.call(lambda e: dict(steps))
        return long_id, results, first, second

    try:
        long_id, results, (after, unfinished), later = asyncio.run(main())
    finally:
        loop.stop()
    error = results[0]
    assert isinstance(error, EngineError) and error.request_id == long_id
    assert "engine stalled" in str(error) and long_id in str(error)
    assert results[1:] == reference
    # One failed step for the one request that could never be scheduled; the thread is
    # idle afterwards (nothing unfinished, no step between the two snapshots).
    assert after["failed"] == 1 and not unfinished and later == after
    assert loop.num_steps == after["ok"]
    assert loop.request_failure_total == 1 and loop.request_success_total == len(SHORT)
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_offline_generate_raises_the_stall_naming_the_request():
    llm = LLM("tiny", seed=0, policy=ShortPromptsOnly())
    with pytest.raises(RuntimeError, match=r"engine stalled.*'0'.*short-only"):
        llm.generate([LONG], PARAMS)
