"""The training loop, its forward against the serving path, and the shipped tiny-zh weights."""

import json
import math

import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.checkpoint import load_pretrained, save_pretrained
from tinyserve.model import MODEL_PRESETS, LlamaForServing
from tinyserve.tokenizer import TOKENIZER_FILE, ByteBPETokenizer, load_default_tokenizer
from tinyserve.book.train import (TRAIN_PRESETS, TRAINED_MODELS, causal_forward, corpus_texts,
                             init_model, lm_loss, lr_at, save, tokenize, train)


def test_a_few_steps_reduce_loss_on_a_repeated_batch():
    model = init_model(TRAIN_PRESETS["test"], seed=0).train()
    batch = torch.randint(0, 2048, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = lm_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(2048), abs=0.1)    # untrained: uniform guess
    assert losses[-1] < losses[0] - 0.05


def test_schedule_warms_up_then_decays():
    lrs = [lr_at(s, s / 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] >= 0.1


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_training_forward_matches_serving_logits(tmp_path, preset):
    """Teacher-forced logits of the training forward equal the logits the engine
    computes while decoding, and greedy decoding picks the same tokens."""
    model = LlamaForServing.from_seed(MODEL_PRESETS[preset], seed=1)
    save_pretrained(model, tmp_path)
    llm = LLM(str(tmp_path), seed=0)
    prompt = llm.tokenizer.encode("推理引擎把请求排进队列，再按批调度。")
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        logits = causal_forward(model, torch.tensor([seq]))[0]
    # The token chosen at each step is the argmax of the training forward at that position.
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out.token_ids
    # And the serving path's last-token logits match numerically.
    from tinyserve.model import AttentionMetadata, KVCache
    n = len(seq)
    cache = KVCache(model.config, num_blocks=-(-n // 16), block_size=16,
                    dtype=torch.float32, device="cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_lens=[n], context_lens=[n],
                             block_tables=torch.arange(cache.num_blocks)[None, :], num_decodes=0,
                             decode_context_lens=torch.zeros(0, dtype=torch.long))
    served = model(torch.tensor(seq), torch.arange(n), meta, cache, torch.arange(n))
    torch.testing.assert_close(served, logits, rtol=1e-4, atol=1e-4)


def test_train_and_save_round_trip(tmp_path):
    data = torch.randint(0, 2048, (500,), generator=torch.Generator().manual_seed(0))
    model, summary = train(TRAIN_PRESETS["test"], data, seconds=0, max_steps=3, seq_len=16,
                           batch_size=2, log=lambda *_: None)
    assert summary["steps"] == 3
    out = save(model, tmp_path / "m", summary)
    # Outside the package a checkpoint carries its own tokenizer file.
    assert ByteBPETokenizer.load(out / TOKENIZER_FILE).merges == load_default_tokenizer().merges
    loaded = load_pretrained(out)
    assert loaded.lm_head.weight.dtype == torch.float32       # fp16 on disk, fp32 in memory
    ids = data[:20][None]
    with torch.no_grad():
        torch.testing.assert_close(causal_forward(loaded, ids),
                                   causal_forward(model.half().float(), ids))
    assert LLM(str(out)).generate("你好", SamplingParams(max_tokens=3))[0].token_ids


def test_corpus_is_the_projects_own_text():
    texts = corpus_texts(include_notebooks=False)
    assert set(texts) == {"corpus/en.txt", "corpus/zh.txt"}
    ids = tokenize(texts)
    assert ids.max() < 2048 and (ids == load_default_tokenizer().eos_token_id).sum() > 10


def test_shipped_tiny_zh_is_trained():
    path = TRAINED_MODELS["tiny-zh"]
    if not (path / "model.safetensors").exists():
        pytest.skip("tiny-zh weights not built (python -m tinyserve.book.train)")
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 20 * 2**20
    info = json.loads((path / "training.json").read_text())
    assert info["final_loss"] < 5
    model = load_pretrained(path)
    assert model.config.vocab_size == load_default_tokenizer().vocab_size == 2048
    zh = corpus_texts(include_notebooks=False)["corpus/zh.txt"]
    ids = torch.tensor([load_default_tokenizer().encode(zh[:400])])
    with torch.no_grad():
        loss = lm_loss(model, ids).item()
    assert math.isfinite(loss) and loss < math.log(2048) - 3     # far below a random model's 7.6


def test_tiny_zh_loads_by_name_and_generates_text():
    from tinyserve import LLM, SamplingParams
    if not (TRAINED_MODELS["tiny-zh"] / "model.safetensors").exists():
        pytest.skip("tiny-zh weights are not shipped in this checkout")
    llm = LLM("tiny-zh")
    # The shipped weights read the package's one copy of the vocabulary (data/tokenizer.json).
    assert not (TRAINED_MODELS["tiny-zh"] / TOKENIZER_FILE).exists()
    assert llm.tokenizer is load_default_tokenizer()
    out = llm.generate("推理引擎", SamplingParams(max_tokens=20))[0]
    assert out.text and out.text == llm.tokenizer.decode(out.token_ids)
