"""The engine's promises: same greedy tokens as transformers and whatever the
batching, every block returned, bad input rejected without hurting others."""

import os
import platform
import random
import subprocess
import sys

import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.core import EngineCore, VirtualClock
from tinyserve.engine import LLMEngine
from tinyserve.kv_cache import BlockManager
from tinyserve.request import Request, RequestStatus
from tinyserve.scheduler import SchedulerConfig


def random_prompts(n, seed, lo=1, hi=70, vocab=2045):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def assert_all_blocks_free(llm):
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, seed=1)


@pytest.fixture(scope="module")
def params():
    return SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(prompts, params):
    """Greedy tokens of each prompt run on its own, one at a time."""
    llm = LLM("tiny", seed=0, max_num_seqs=1)
    return [llm.generate([p], params)[0].token_ids for p in prompts]


# ---- equality with Hugging Face transformers ------------------------------------------

def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_greedy_tokens_match_transformers(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    llm = LLM(preset, seed=3, max_num_seqs=4, max_num_batched_tokens=64)
    llm.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    prompts = random_prompts(6, seed=7, hi=90)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_saved_directory_loads_back_with_same_outputs(tmp_path, prompts, params, reference):
    LLM("tiny", seed=0).save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = LLM(str(tmp_path))
    assert token_ids(loaded.generate(prompts, params)) == reference


def test_different_seeds_give_different_models(prompts, params, reference):
    other = LLM("tiny", seed=1).generate(prompts[:3], params)
    assert token_ids(other) != reference[:3]


# ---- invariance to how requests are batched --------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(batching="static"),
    dict(batching="static", max_num_seqs=3),
    dict(max_num_seqs=2, max_num_batched_tokens=5),
    dict(max_num_seqs=16, max_num_batched_tokens=1024),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    dict(block_size=1),
    dict(block_size=7, max_num_batched_tokens=33),
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_greedy_tokens_do_not_depend_on_batching(kwargs, prompts, params, reference):
    llm = LLM("tiny", seed=0, **kwargs)
    assert token_ids(llm.generate(prompts, params)) == reference
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_preemption_by_recompute_keeps_outputs(batching, prompts, params, reference):
    # 12 blocks of 16 tokens cannot hold 8 requests of up to ~94 tokens at once.
    llm = LLM("tiny", seed=0, num_kv_blocks=12, batching=batching)
    outs = llm.generate(prompts, params)
    assert token_ids(outs) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert_all_blocks_free(llm)


def test_seeded_sampling_does_not_depend_on_batch(prompts):
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=i)
              for i in range(len(prompts))]
    alone = [LLM("tiny", max_num_seqs=1).generate([p], [sp])[0].token_ids
             for p, sp in zip(prompts, params)]
    together = token_ids(LLM("tiny", max_num_seqs=8, num_kv_blocks=20).generate(prompts, params))
    assert together == alone
    assert together != token_ids(LLM("tiny").generate(prompts, SamplingParams(max_tokens=12)))


def test_text_prompts_and_text_outputs():
    llm = LLM("tiny")
    outs = llm.generate(["你好，世界", "continuous batching"], SamplingParams(max_tokens=8))
    for prompt, out in zip(["你好，世界", "continuous batching"], outs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason in ("stop", "length")


def test_stops_at_eos_and_stop_token_ids(prompts):
    llm = LLM("tiny")
    free_run = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    stop_id = free_run[0].token_ids[5]
    out = llm.generate(prompts[0], SamplingParams(max_tokens=30, stop_token_ids=[stop_id]))[0]
    first = free_run[0].token_ids.index(stop_id)
    assert out.token_ids == free_run[0].token_ids[:first + 1]
    assert out.finish_reason == "stop"
    assert llm.generate(prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_eos_stops_unless_ignored():
    def finished_by(params, outputs):
        request = Request("r", [1, 2], params, arrival_time=0.0, eos_token_id=2046)
        request.output_token_ids = outputs
        return request.check_stop(max_model_len=512)
    assert finished_by(SamplingParams(), [5, 2046]) == "stop"
    assert finished_by(SamplingParams(ignore_eos=True), [5, 2046]) is None
    assert finished_by(SamplingParams(max_tokens=2, ignore_eos=True), [5, 2046]) == "length"
    assert finished_by(SamplingParams(), [5, 6]) is None


def test_generation_stops_at_max_model_len():
    llm = LLM("tiny", max_model_len=40)
    out = llm.generate([[1] * 35], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert_all_blocks_free(llm)


# ---- every block accounted for ------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_return_every_block(seed):
    rng = random.Random(seed)
    llm = LLM("tiny", seed=seed, max_num_seqs=rng.randint(1, 12),
              max_num_batched_tokens=rng.randint(8, 200), block_size=rng.choice([1, 4, 16]),
              num_kv_blocks=rng.randint(40, 120), batching=rng.choice(["continuous", "static"]))
    engine: LLMEngine = llm.engine
    bm = engine.block_manager
    max_len = bm.num_blocks * bm.block_size
    requests = []
    for i in range(rng.randint(5, 25)):
        n = rng.randint(1, 60)
        params = SamplingParams(max_tokens=rng.randint(1, min(40, max_len - n)),
                                ignore_eos=rng.random() < 0.5)
        requests.append(engine.add_request(random_prompts(1, seed * 100 + i, hi=n)[0], params))
    aborted = set(rng.sample(requests, 2))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        bm.check_integrity()
        held = sum(len(bm.block_table(r.request_id)) for r in engine.scheduler.running)
        assert held == bm.num_used_blocks
        assert all(r.status is RequestStatus.WAITING or r.status is RequestStatus.PREEMPTED
                   for r in engine.scheduler.waiting)
        if steps == 3:
            for rid in aborted:
                engine.abort(rid)
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.requests


def test_blocks_are_freed_the_step_a_request_finishes():
    llm = LLM("tiny", max_num_seqs=4)
    engine = llm.engine
    short = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request([4] * 40, SamplingParams(max_tokens=10, ignore_eos=True))
    while True:
        finished = [o for o in engine.step() if o.finished]
        if finished:
            break
    assert finished[0].request_id == short
    assert engine.block_manager.block_table(short) == []
    assert engine.block_manager.num_used_blocks == 3          # 41 tokens of the long one
    engine.block_manager.check_integrity()


def test_static_batching_admits_nobody_until_the_batch_is_done():
    llm = LLM("tiny", max_num_seqs=2, batching="static")
    engine = llm.engine
    lengths = [2, 10, 3, 3]
    ids = [engine.add_request([7] * 5, SamplingParams(max_tokens=n, ignore_eos=True))
           for n in lengths]
    while engine.has_unfinished_requests():
        engine.step()
    members = [{rid for rid, _ in s.batch} for s in engine.step_stats]
    # The first batch (requests 0 and 1) runs 10 steps; 2 and 3 start only after.
    assert all(m <= {ids[0], ids[1]} for m in members[:10])
    assert members[10] == {ids[2], ids[3]}
    # Continuous batching fills request 0's seat as soon as it leaves.
    cont = LLM("tiny", max_num_seqs=2).engine
    ids = [cont.add_request([7] * 5, SamplingParams(max_tokens=n, ignore_eos=True)) for n in lengths]
    while cont.has_unfinished_requests():
        cont.step()
    assert ids[2] in {rid for rid, _ in cont.step_stats[2].batch}
    assert len(cont.step_stats) < len(engine.step_stats)


class FixedToken:
    """An executor with no model: every request that samples emits token 7."""

    last_prepare_time = 0.0

    def execute(self, plan):
        return {s.request.request_id: 7 for s in plan.scheduled if s.samples}

    def release(self, request_id):
        pass


def test_static_batching_preempts_only_members_that_hold_blocks():
    """Members of a static batch that the token budget has not reached yet hold no
    blocks: preempting one frees nothing (it only shrank the batch and inflated the
    count). Randomized small caches and budgets; every victim held blocks when its
    step began, and the case the rule is about (a blockless member behind the one
    that needs a block) does come up."""
    rng = random.Random(0)
    num_preempted = blockless_behind = 0
    for _ in range(40):
        config = SchedulerConfig(max_num_seqs=rng.randint(2, 6),
                                 max_num_batched_tokens=rng.choice([4, 8, 16]), block_size=4,
                                 batching="static", max_model_len=64)
        bm = BlockManager(rng.randint(4, 12), 4)
        core = EngineCore(config, bm, FixedToken(), VirtualClock(), check_invariants=True)
        for i in range(rng.randint(2, 10)):
            core.add_request(Request(str(i), [1 + i] * rng.randint(1, 8),
                                     SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True), 0.0))
        while core.has_unfinished_requests():
            held = {rid for rid, table in bm.block_tables.items() if table}
            waiting_for_budget = [r for r in core.scheduler.running if r.request_id not in held]
            result = core.step()
            assert all(v.request_id in held for v in result.plan.preempted), "a blockless victim"
            num_preempted += len(result.plan.preempted)
            blockless_behind += bool(result.plan.preempted and waiting_for_budget)
        assert bm.num_free_blocks == bm.num_blocks
    assert num_preempted > 0 and blockless_behind > 0


def test_a_static_batch_that_one_request_fills_preempts_nobody():
    """4 blocks hold one of these requests (8 + 8 tokens, blocks of 4) at a time; the
    other members wait in their seats, blockless, until it leaves. Preempting them
    (6 preemptions before) freed nothing. Outputs are those of each request alone."""
    prompts = [[11 + i] * 8 for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = LLM("tiny", seed=0, max_num_seqs=1, block_size=4)
    reference = [alone.generate([p], params)[0].token_ids for p in prompts]
    llm = LLM("tiny", seed=0, batching="static", max_num_seqs=4, max_num_batched_tokens=8,
              block_size=4, num_kv_blocks=4)
    assert token_ids(llm.generate(prompts, params)) == reference
    assert llm.engine.scheduler.num_preemptions == 0
    assert len(llm.engine.step_stats) == 4 * 8        # one request at a time, 8 steps each
    assert_all_blocks_free(llm)


def test_token_budget_and_seats_are_respected():
    llm = LLM("tiny", max_num_seqs=3, max_num_batched_tokens=20)
    llm.generate(random_prompts(12, seed=5), SamplingParams(max_tokens=5, ignore_eos=True))
    for s in llm.engine.step_stats:
        assert s.num_scheduled_tokens <= 20
        assert len(s.batch) <= 3
    assert max(s.num_scheduled_tokens for s in llm.engine.step_stats) == 20


# ---- metrics --------------------------------------------------------------------------------

def test_metrics_follow_the_serving_benchmark_definitions():
    ticks = iter(range(10_000))
    llm = LLM("tiny", max_num_seqs=2, clock=lambda: float(next(ticks)))
    outs = llm.generate([[1] * 30, [2] * 3, [3] * 8], SamplingParams(max_tokens=6, ignore_eos=True))
    for out in outs:
        m = out.metrics
        assert m.num_output_tokens == 6 == len(m.token_times)
        assert m.ttft == m.first_token_time - m.arrival_time > 0
        assert m.e2e == m.finished_time - m.arrival_time
        assert m.tpot == pytest.approx((m.e2e - m.ttft) / 5)
        assert m.itl == [b - a for a, b in zip(m.token_times, m.token_times[1:])]
        assert 0 <= m.queue_time <= m.ttft
    # The third request waits for a seat.
    assert outs[2].metrics.queue_time > outs[0].metrics.queue_time


# ---- bad input: a clear ValueError, and the engine keeps serving -------------------------

BAD_INPUTS = [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "prompt must not be empty"),
    ([1] * 513, SamplingParams(), "max_model_len"),
    ([1, 2, 5000], SamplingParams(), "token id 5000"),
    ([1, -1], SamplingParams(), "token id -1"),
    (3.5, SamplingParams(), "prompt must be a str or a list of token ids"),
]


@pytest.mark.parametrize("prompt,bad_params,message", BAD_INPUTS)
def test_bad_prompts_are_rejected_and_engine_keeps_serving(prompt, bad_params, message, prompts,
                                                           reference):
    llm = LLM("tiny", seed=0)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompts[0], prompt], bad_params)
    good = llm.generate(prompts[:2], SamplingParams(max_tokens=24, ignore_eos=True))
    assert token_ids(good) == reference[:2]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(model="no-such-preset"), "unknown preset"),
    (dict(policy="lottery"), "unknown policy"),
    (dict(batching="dynamic"), "unknown batching mode"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(max_model_len=10_000), "max_model_len"),
    (dict(dtype="int3"), "dtype"),
    (dict(kernels="cuda-graphs"), "kernels"),
])
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(**kwargs)


def test_request_larger_than_the_cache_is_rejected_and_others_still_served(prompts, reference):
    llm = LLM("tiny", seed=0, num_kv_blocks=6)          # 96 token slots
    engine = llm.engine
    with pytest.raises(ValueError, match="num_kv_blocks=6"):
        engine.add_request([1] * 90, SamplingParams(max_tokens=20))
    good = llm.generate([prompts[1]], SamplingParams(max_tokens=24, ignore_eos=True))
    assert good[0].token_ids == reference[1]
    assert_all_blocks_free(llm)


def test_unchunked_prompt_larger_than_budget_is_rejected():
    llm = LLM("tiny", enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=8))
    assert llm.generate([[1] * 20], SamplingParams(max_tokens=8))[0].finish_reason


def test_abort_frees_blocks_and_others_finish(prompts, reference):
    llm = LLM("tiny", seed=0)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts[:3]]
    engine.step()
    engine.step()
    assert engine.abort(ids[1]) and not engine.abort(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done == {ids[0]: reference[0], ids[2]: reference[2]}
    assert_all_blocks_free(llm)


def test_duplicate_request_id_is_rejected():
    engine = LLM("tiny").engine
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="request_id 'a'"):
        engine.add_request([3, 4], request_id="a")


def test_fused_triton_kernels_give_the_same_greedy_tokens(prompts, reference):
    pytest.importorskip("triton")
    llm = LLM("tiny", seed=0, kernels="triton", max_num_batched_tokens=64)
    outs = llm.generate(prompts[:4], SamplingParams(max_tokens=24, ignore_eos=True))
    assert token_ids(outs) == reference[:4]
    assert_all_blocks_free(llm)


def test_streamed_text_adds_up_and_stages_are_timed():
    llm = LLM("tiny", max_num_batched_tokens=8)
    engine = llm.engine
    rid = engine.add_request("流式输出：一个汉字是三个字节 🙂", SamplingParams(max_tokens=30))
    pieces, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            last = out
    assert last.request_id == rid and last.finished
    assert "".join(pieces) == last.text == llm.tokenizer.decode(last.token_ids)
    m = last.metrics
    assert m.tokenize_time > 0 and m.detokenize_time > 0
    # Chunked prefill (budget 8) then one step per further token.
    assert sum(n for _, n in m.schedule_log) == m.num_prompt_tokens + m.num_output_tokens - 1
    assert max(n for _, n in m.schedule_log) == 8
    assert m.schedule_log[0][0] == pytest.approx(m.arrival_time + m.queue_time)


STEP_FAULTS = """
import random, resource
from tinyserve import LLM, SamplingParams
from tinyserve.host import keep_freed_memory
llm = LLM("small", seed=0, max_num_seqs=16, max_num_batched_tokens=1024)
eng, rng = llm.engine, random.Random(0)
def step():
    for _ in range(16):
        eng.add_request([rng.randrange(100, 1000) for _ in range(64)], SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(keep_freed_memory(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_a_step_reuses_the_memory_the_step_before_freed():
    # 16 prompts of 64 tokens in one step, again and again: with glibc's thresholds left to
    # move, every step faults its activations in anew (about 12,000 pages on an AMD EPYC Zen 5);
    # the engine fixes them (host.keep_freed_memory) and the pages stay in the process.
    runs = {}
    for keep in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", STEP_FAULTS], capture_output=True, text=True, check=True,
                             env={**os.environ, "TINYSERVE_KEEP_FREED_MEMORY": keep})
        kept, faults = out.stdout.split()
        runs[keep] = (kept == "True", float(faults))
    assert runs["1"][0] and not runs["0"][0]
    assert runs["1"][1] < 1000 and runs["0"][1] > 4 * runs["1"][1], runs
