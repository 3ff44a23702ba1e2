"""A checkpoint as a reader downloads it: weights, its own tokenizer.json, a chat
template and generation_config.json, in one directory, built here (nothing is
downloaded). Offline generation and the OpenAI-compatible server (through the
official ``openai`` SDK) must give what ``transformers`` gives on the same files."""

from __future__ import annotations

import json

import pytest

from test_checkpoints import randomize
from test_engine import hf_greedy
from test_hf_tokenizer import CHATML_TEMPLATE, SAMPLES, train_byte_level
from tinyserve import LLM, SamplingParams
from tinyserve.serving.processes import ServerProcess
from tinyserve.serving.request_parsing import chat_renderer

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "你是一个乐于助人的助手。"},
            {"role": "user", "content": "什么是首字延迟？ TTFT 😀"}]
STEPS = 10


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A random-weight Qwen2 (tied embeddings, q/k/v biases) with a byte-level BPE
    tokenizer trained on Chinese + English + emoji, ChatML specials and template, and
    two eos ids in generation_config.json (as Qwen ships them)."""
    path = tmp_path_factory.mktemp("qwen2")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_byte_level(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"])
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(path)
    eos = [hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")]
    config = transformers.Qwen2Config(vocab_size=len(hf_tok) + 5,   # padded, as Qwen's is
                                      hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True,
                                      rope_theta=1e6)
    model = randomize(transformers.Qwen2ForCausalLM(config), seed=3)
    model.save_pretrained(path, safe_serialization=True)
    # After the model: save_pretrained writes a generation_config.json of its own.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path, hf_tok, model, eos


def reference(hf_tok, model, ids):
    """transformers' greedy tokens, never the padded ids the tokenizer lacks (ours
    samples only ids the tokenizer can decode)."""
    out = hf_greedy(model, ids, STEPS)
    assert max(out) < len(hf_tok), "the fixture's greedy path should stay in the vocabulary"
    return out


def test_the_checkpoints_own_tokenizer_and_greedy_tokens(qwen_dir):
    path, hf_tok, model, eos = qwen_dir
    llm = LLM(str(path), block_size=4)
    assert set(eos) <= {llm.tokenizer.eos_token_id, *llm.tokenizer.eos_token_ids}
    texts = [t for t in SAMPLES if t.strip()][:6]
    for text in texts:
        assert llm.tokenizer.encode(text) == hf_tok.encode(text), text
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    # Batched, chunked (budget 7), prefix-cached and preempted (blocks for the longest
    # request and one more) at once.
    prompts = texts + [texts[0] + " " + texts[1]]
    longest = max(len(hf_tok.encode(p)) for p in prompts) + STEPS
    tight = LLM(str(path), block_size=4, max_num_batched_tokens=7, num_kv_blocks=-(-longest // 4) + 1,
                max_num_seqs=4)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for text, out in zip(prompts, outs):
        want = reference(hf_tok, model, hf_tok.encode(text))
        assert out.token_ids == want, text
        assert out.text == hf_tok.decode(want, skip_special_tokens=True)
    tight.engine.block_manager.check_integrity()


def test_streamed_text_adds_up_to_the_final_text(qwen_dir):
    path, hf_tok, _, _ = qwen_dir
    engine = LLM(str(path)).engine
    rid = engine.add_request("你好 😀 world", SamplingParams(max_tokens=24, ignore_eos=True))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            if out.finished:
                final = out
    assert final is not None and final.request_id == rid
    assert "".join(pieces) == final.text == hf_tok.decode(final.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in final.text


def test_chat_prompt_is_the_checkpoints_template(qwen_dir):
    path, hf_tok, _, _ = qwen_dir
    llm = LLM(str(path))
    ids = chat_renderer(llm.tokenizer)(MESSAGES)
    want = hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert ids == list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)


def test_openai_sdk_against_the_server(qwen_dir):
    path, hf_tok, model, _ = qwen_dir
    prompt = "首字延迟 TTFT"
    with ServerProcess(["serve", "--model", str(path)]) as server:
        server.wait()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        done = client.completions.create(model=name, prompt=prompt, max_tokens=STEPS, temperature=0,
                                         extra_body={"ignore_eos": True})
        want = hf_tok.decode(reference(hf_tok, model, hf_tok.encode(prompt)), skip_special_tokens=True)
        assert done.choices[0].text == want
        streamed = client.completions.create(model=name, prompt=prompt, max_tokens=STEPS,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == want
        chat_ids = list(hf_tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False))
        want_chat = reference(hf_tok, model, chat_ids)
        stop_at = next((i + 1 for i, t in enumerate(want_chat)
                        if t in (hf_tok.eos_token_id, hf_tok.pad_token_id)), len(want_chat))
        want_text = hf_tok.decode(want_chat[:stop_at], skip_special_tokens=True)
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=STEPS,
                                              temperature=0)
        assert chat.choices[0].message.content == want_text
        stream = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=STEPS,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_text
