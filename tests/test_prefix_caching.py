"""Prefix caching: shared prefix blocks are reused (refcount + 1), not copied; they are
freed only when the last user leaves, stay cached until evicted (LRU), and never
change a single output token."""

import hashlib
import os
import random
import subprocess
import sys

import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.kv_cache import BlockManager, blocks_for, chain_hash
from tinyserve.scheduler import Scheduler
from tinyserve.sim import simulate
from tinyserve.workload import RequestSpec


def shared_prefix_prompts(seed, groups=3, per_group=4, prefix_len=40, vocab=2045):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
                    for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def slicer(tokens):
    """What ``BlockManager.cache_full_blocks`` reads a request's tokens through."""
    return lambda start, end: tokens[start:end]


def run(prompts, **kwargs):
    llm = LLM("tiny", seed=0, **kwargs)
    outs = []
    for prompt in prompts:          # one at a time, so later prompts find earlier ones cached
        outs += llm.generate([prompt], PARAMS)
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    return [o.token_ids for o in outs], outs, llm


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(seed=4)


@pytest.fixture(scope="module")
def reference(prompts):
    return run(prompts, enable_prefix_caching=False)[0]


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(block_size=4),
    dict(block_size=8, max_num_batched_tokens=9),
    dict(block_size=16, enable_chunked_prefill=False),
    dict(block_size=1, max_num_batched_tokens=17),
], ids=str)
def test_outputs_identical_with_and_without_prefix_caching(prompts, reference, kwargs):
    tokens, outs, llm = run(prompts, enable_prefix_caching=True, **kwargs)
    assert tokens == reference
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert llm.engine.block_manager.prefix_cache_hit_rate > 0


def test_batched_generation_with_shared_prefixes(prompts, reference):
    llm = LLM("tiny", seed=0, max_num_seqs=4, max_num_batched_tokens=48, block_size=8)
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert any(o.metrics.num_cached_tokens for o in outs)
    llm.engine.block_manager.check_integrity()


def test_fully_cached_block_aligned_prompt_still_computes_its_last_token():
    prompt = list(range(100, 132))                  # exactly two 16-token blocks
    first, outs, llm = run([prompt, prompt], block_size=16)
    assert first[0] == first[1]
    # Only the first block can be reused: the last token (in block two) must run.
    assert outs[1].metrics.num_cached_tokens == 16
    alone = LLM("tiny", seed=0, enable_prefix_caching=False).generate([prompt], PARAMS)
    assert alone[0].token_ids == first[0]


def test_shared_block_is_reused_not_copied_and_freed_by_the_last_user():
    llm = LLM("tiny", seed=0, block_size=4)
    engine, bm = llm.engine, llm.engine.block_manager
    prefix = list(range(10, 22))                    # three full blocks
    a = engine.add_request(prefix + [1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()                                   # prefill a: its full blocks get cached
    b = engine.add_request(prefix + [2], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    shared = bm.block_table(a)[:3]
    assert bm.block_table(b)[:3] == shared
    assert all(bm.blocks[i].ref_count == 2 for i in shared)
    while a in engine.requests:
        engine.step()
    assert all(bm.blocks[i].ref_count == 1 for i in shared)   # b still holds them
    assert not any(i in bm.free_blocks for i in shared)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].block_hash is not None
               for i in shared)                    # free, but still cached
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_request_hits_the_cache_when_readmitted(prompts, reference):
    llm = LLM("tiny", seed=0, block_size=8, num_kv_blocks=18, max_num_seqs=6)
    engine = llm.engine
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_integrity()
    assert [r.output_token_ids for r in requests] == reference
    assert engine.scheduler.num_preemptions > 0
    readmitted = [r.cached_tokens_per_admission[1:] for r in requests if r.num_preemptions]
    assert any(hit > 0 for later in readmitted for hit in later)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_readmission_after_preemption_reuses_its_own_blocks():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    tokens = list(range(50, 63))                    # 13 tokens: 3 full blocks + 1
    bm.allocate("r", 13)
    bm.cache_full_blocks("r", 13, slicer(tokens))
    table = bm.block_table("r")
    bm.free("r")                                    # preempted
    hits = bm.find_cached_prefix(tokens)
    assert hits == table[:3]
    assert bm.claim_cached_prefix("r", hits, len(tokens)) == 12
    bm.allocate("r", 13)
    bm.check_integrity()
    assert bm.prefix_cache_hit_rate == pytest.approx(12 / 13)


def test_lru_eviction_keeps_the_most_recently_freed_prefixes():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old, new = [1, 2, 3], [7, 8, 9]
    for rid, tokens in (("old", old), ("new", new)):
        bm.allocate(rid, 3)
        bm.cache_full_blocks(rid, 3, slicer(tokens))
        bm.free(rid)
    assert len(bm.find_cached_prefix(old)) == 1 and len(bm.find_cached_prefix(new)) == 1
    bm.allocate("x", 4)            # takes the two least recently freed blocks: "old"'s
    assert bm.find_cached_prefix(old) == []
    assert len(bm.find_cached_prefix(new)) == 1
    bm.check_integrity()


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("r", 4)
    bm.cache_full_blocks("r", 4, slicer([1, 2, 3, 4, 5]))
    bm.free("r")
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [] and not bm.cached


def test_static_batch_members_waiting_for_budget_look_up_the_cache_once():
    prompts = shared_prefix_prompts(seed=9, groups=1, per_group=4, prefix_len=24)
    llm = LLM("tiny", seed=0, batching="static", max_num_seqs=4, block_size=8,
              enable_chunked_prefill=False, max_num_batched_tokens=64)
    engine = llm.engine
    llm.generate(prompts[:1], PARAMS)                # warm the cache with the shared prefix
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    requests = [engine.requests[i] for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
    assert all(len(r.cached_tokens_per_admission) == 1 for r in requests)
    assert all(r.num_cached_tokens == 24 for r in requests)
    bm = engine.block_manager
    assert bm.num_queried_tokens == sum(len(p) for p in prompts) + len(prompts[0])


def test_duplicate_prompts_in_one_step_never_poison_the_chain_of_later_blocks():
    # Two copies of one prompt compute the same blocks in the same step. A later
    # prompt that starts with tokens 0-3 of their output must not find blocks that
    # were hashed as if they were a prompt's first block (they hold KV of other
    # positions). Greedy output must equal an engine without the cache.
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    for probe in range(3):
        cached = LLM("tiny", seed=probe, block_size=4, num_kv_blocks=64)
        plain = LLM("tiny", seed=probe, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
        first = cached.generate([prompt, prompt], params)
        cached.engine.block_manager.check_integrity()
        follow_up = first[0].token_ids[:4] + [5, 6, 7]
        got = cached.generate([follow_up], params)[0].token_ids
        assert got == plain.generate([follow_up], params)[0].token_ids, f"probe {probe}"
        cached.engine.block_manager.check_integrity()


def test_integrity_check_catches_a_cached_block_whose_chain_is_broken():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", 4, slicer([1, 2, 3, 4]))
    bm.check_integrity()
    second = bm.blocks[bm.block_table("a")[1]]
    second.parent_hash = None                 # as if block 1 were a prompt's first block
    second.block_hash = chain_hash(None, second.token_ids)
    bm.cached = {bm.blocks[bm.block_table("a")[0]].block_hash: [bm.block_table("a")[0]],
                 second.block_hash: [second.block_id]}
    with pytest.raises(AssertionError, match="not chained"):
        bm.check_integrity()


def test_chain_hash_is_sha256_of_the_parent_digest_and_little_endian_uint32_ids():
    """The encoding spelled out independently: ids past 65,535 (Qwen's 151k vocabulary)
    keep all their bytes, and a child's digest covers its parent's."""
    first, second = (1, 70_000, 2**32 - 1, 0), (5, 6, 7, 8)
    encode = lambda ids: b"".join(t.to_bytes(4, "little") for t in ids)      # noqa: E731
    root = hashlib.sha256(encode(first)).digest()
    assert chain_hash(None, first) == root and len(root) == 32
    assert chain_hash(root, second) == hashlib.sha256(root + encode(second)).digest()
    assert chain_hash(root, second) != chain_hash(None, second)
    assert chain_hash(None, (1, 70_000 - 65_536, 2**32 - 1, 0)) != root


def test_chain_hash_is_the_same_in_another_process_whatever_its_hash_seed():
    """Python's hash() of a tuple holding None changes from process to process before
    3.12, and str/bytes hashes follow PYTHONHASHSEED: a block's name must not."""
    ids = (3, 1, 4, 1, 5, 9, 2, 6)
    code = ("from tinyserve.kv_cache import chain_hash; "
            f"print(chain_hash(chain_hash(None, {ids!r}), {ids!r}).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == chain_hash(chain_hash(None, ids), ids).hex()


def lookup_from_scratch(scheduler, request):
    """The lookup as it was before requests kept their block hashes: every call hashes
    the whole prompt again."""
    if request.num_computed_tokens or not scheduler.block_manager.enable_prefix_caching:
        return []
    return scheduler.block_manager.find_cached_prefix(request.all_token_ids)


def random_prefix_workload(rng, block_size):
    """Requests in a few shared-prefix groups (prefixes around block boundaries), arriving
    in bursts onto a cache too small for all of them: heads of the queue wait, some are
    preempted and come back."""
    specs = []
    for _ in range(rng.randint(10, 30)):
        group = rng.randrange(3)
        prefix = block_size * rng.randint(0, 4) + rng.randint(-1, 1) if group else 0
        prompt = max(1, prefix) + rng.randint(0, 3 * block_size)
        specs.append(RequestSpec(arrival=rng.choice([0.0, 0.0, rng.uniform(0, 0.2)]),
                                 prompt_len=prompt, output_len=rng.randint(1, 24),
                                 prefix_group=group if prefix > 0 else None, prefix_len=max(0, prefix)))
    return specs


@pytest.mark.parametrize("seed", range(12))
def test_kept_block_hashes_change_no_lookup_result(monkeypatch, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    specs = random_prefix_workload(rng, block_size)
    most = max(blocks_for(s.prompt_len + s.output_len, block_size) for s in specs)
    knobs = dict(block_size=block_size, num_kv_blocks=most + rng.randint(0, 2 * most),
                 max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.choice([8, 16, 64]),
                 batching=rng.choice(["continuous", "continuous", "static"]), enable_prefix_caching=True,
                 check_invariants=True)
    kept = simulate(specs, **knobs)
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_prefix_hits", lookup_from_scratch)
        scratch = simulate(specs, **knobs)
    assert [o.metrics for o in kept] == [o.metrics for o in scratch]
    assert (kept.prefix_cache_hit_rate, kept.num_preemptions) == \
        (scratch.prefix_cache_hit_rate, scratch.num_preemptions)


def test_a_head_of_queue_request_that_cannot_be_admitted_is_hashed_once(monkeypatch):
    """It shares 8 cached blocks with a running request but needs more free blocks than
    the running one leaves, so it waits at the head of the queue for many steps, looked
    up at every one: its blocks are hashed at the first lookup only."""
    from tinyserve import kv_cache

    llm = LLM("tiny", seed=0, block_size=4, num_kv_blocks=24, enable_chunked_prefill=False)
    engine = llm.engine
    prefix = list(range(100, 132))                               # 8 blocks
    engine.add_request(prefix + [7], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(5):                                           # now it holds 10 of the 24 blocks
        engine.step()
    lookups = []
    real_hash = kv_cache.chain_hash

    def counted(parent, tokens):
        if sys._getframe(1).f_code.co_name == "find_cached_prefix":
            lookups.append(tuple(tokens))
        return real_hash(parent, tokens)

    monkeypatch.setattr(kv_cache, "chain_hash", counted)
    head = engine.requests[engine.add_request(prefix + list(range(200, 260)), SamplingParams(max_tokens=1))]
    waited = 0
    while head.status.name == "WAITING":
        engine.step()
        waited += 1
    assert waited >= 10
    assert len(lookups) == len(set(lookups)) == 9                # 8 hits and the first miss
    assert head.num_cached_tokens == 32
