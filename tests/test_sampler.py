"""The batched sampler draws exactly what the per-request sampler it replaced drew,
and ``LLM.generate`` tokenizes each text prompt once."""

from __future__ import annotations

import torch

from tinyserve import LLM, SamplingParams, sampler


def per_request_sample(logits, params, generator):
    """The sampler before batching (one request at a time), kept as the reference."""
    logits = logits.float().cpu() / params.temperature
    if params.top_k != -1 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


BATCH = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
         SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.5, top_k=40, top_p=0.5),
         SamplingParams(temperature=2.0, top_p=1e-300), SamplingParams(temperature=1.0, top_k=1),
         SamplingParams(temperature=0.9, top_k=299, top_p=0.99)]


def test_the_batched_draws_equal_the_per_request_draws_on_a_fixed_batch():
    logits = torch.randn(len(BATCH), 300, generator=torch.Generator().manual_seed(0)) * 4
    seeds = [11, 12, 13, 14, 15, 16, 2**40 + 3]
    batched = [torch.Generator().manual_seed(s) for s in seeds]
    alone = [torch.Generator().manual_seed(s) for s in seeds]
    drawn, want = [], []
    for step in range(40):              # generators advance step after step
        step_logits = logits.roll(step, dims=1)
        drawn.append(sampler.sample(step_logits, BATCH, batched))
        want.append([per_request_sample(step_logits[r], p, g)
                     for r, (p, g) in enumerate(zip(BATCH, alone))])
    assert drawn == want
    # Not a constant: the batch draws more than one token per row over the steps.
    assert len({tuple(row) for row in drawn}) > 1


def test_a_row_draws_the_same_whatever_shares_its_batch():
    logits = torch.randn(len(BATCH), 300, generator=torch.Generator().manual_seed(1)) * 4
    batched = [torch.Generator().manual_seed(7) for _ in BATCH]
    together = sampler.sample(logits, BATCH, batched)
    for row, params in enumerate(BATCH):
        alone = sampler.sample(logits[row:row + 1], [params], [torch.Generator().manual_seed(7)])
        assert alone == [together[row]]


def test_generate_tokenizes_each_text_prompt_once(monkeypatch):
    llm = LLM("tiny", seed=0)
    calls = []
    encode = llm.tokenizer.encode
    # monkeypatch: the preset's tokenizer is one shared object, so the spy must not outlive the test.
    monkeypatch.setattr(llm.tokenizer, "encode",
                        lambda text, **kw: calls.append(text) or encode(text, **kw))
    prompts = ["你好，世界", "tokenize me once", "第三个"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2))
    assert calls == prompts
    assert [o.prompt_token_ids for o in outs] == [encode(p) for p in prompts]


def test_greedy_picks_what_argmax_picks_on_bf16_rows_with_ties_and_nans():
    # bf16 has few values: rows of 4,096 draws from 64 hold many equal maxima; a NaN wins.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 64, (8, 4096), generator=gen).to(torch.bfloat16) / 8
    logits[3, 100] = float("nan")
    logits[5] = float("-inf")
    assert sampler.greedy(logits) == logits.argmax(dim=-1).tolist()
    assert sampler.greedy(logits[:, :1000]) == logits[:, :1000].argmax(dim=-1).tolist()   # a strided view
