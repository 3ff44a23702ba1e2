"""A checkpoint's own tokenizer (tinyserve.hf_tokenizer) against transformers.

Fixtures are trained here with `tokenizers` on a few paragraphs of Chinese,
English and emoji, saved with transformers' save_pretrained, then loaded both
ways: ours (tokenizers only) and PreTrainedTokenizerFast.from_pretrained.
"""

import json
import random

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tinyserve.hf_tokenizer import (
    HFTokenizer,
    _CleanupStream,
    bytes_to_unicode,
    clean_up_tokenization,
    load_checkpoint_tokenizer,
)
from tinyserve.tokenizer import StreamDetokenizer

transformers = pytest.importorskip("transformers")
PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

CORPUS = [
    "大语言模型的推理分为两个阶段：预填充阶段一次处理整个提示词，解码阶段每一步只生成一个词元。"
    "连续批处理让显卡一直保持忙碌，分页注意力把键值缓存切成固定大小的块，减少了内存碎片。",
    "今天天气很好，我们去公园散步吧！路上看到了☔️和🌈，小朋友们开心地笑了😀。"
    "晚上一家人👨‍👩‍👧‍👦一起吃饭，聊到了去中国🇨🇳和日本🇯🇵旅行的计划。",
    "Continuous batching keeps the GPU busy: new requests join the running batch as soon as "
    "others finish. The time to first token (TTFT) is dominated by prefill, while the time per "
    "output token (TPOT) is dominated by reading the weights and the KV cache from memory.",
    "Mixed text works too: 首字延迟 TTFT 是 320ms，出字速度 TPOT 约 45 ms/token 🚀🚀. "
    "Developers 👩‍💻👨🏽‍💻 love emoji; flags 🇺🇸🇬🇧🇫🇷 are pairs of regional indicators. "
    "Don't forget the tabs\tand  double  spaces, or the newlines\n\nbetween paragraphs.",
    "罕见字：𠀀𪚥龘靐齉，全角标点（例如：“引号”、《书名》……）和数字１２３４也要能编码。"
    "我们的目标是：每个字都能正确地流式输出，不会出现半个字符的乱码。",
]

SAMPLES = [
    "", " ", "你好", "你好，世界！", "Hello, world!", " leading space", "trailing space ",
    "😀", "🚀🌈☔️", "👨‍👩‍👧‍👦", "👩‍💻 codes", "🇨🇳🇯🇵🇺🇸", "e\u0301 café naïve",
    "   \n\t  \r\n  two  spaces\u3000全角空格 ", "1234567890 3.14159 ２０２４年",
    "首字延迟 TTFT 是 320ms，出字速度 TPOT 约 45 ms/token！", "𠀀𪚥 罕见字 龘",
    "<|im_start|>user\n你好<|im_end|>", "<s>hi</s> <unk>", "调用工具<tool_call>{\"a\": 1}</tool_call>",
    "don't . , ! ? it's we're I'm",
    "混合 mixed 文本 text 😀 with 🇨🇳 flags and\nnew lines\n\n",
] + CORPUS

# Written in the style of Qwen's and Llama-3's: `{%-` eats the newline before a tag,
# and trim_blocks / lstrip_blocks must remove the rest of the layout.
CHATML_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Today: ' + strftime_now('%Y') + '\n' }}
{{- ns.system + '<|eot_id|>' }}
{% for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' -}}
    {% if message.meta is defined %}
        {% for key, value in message.meta | dictsort %}
{{ key }}={{ value | tojson }}
        {% endfor %}
    {% endif %}
    {{- message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CONVERSATION = [
    {"role": "system", "content": "你是一个乐于助人的助手。 "},
    {"role": "user", "content": "你好！What is TTFT? 😀"},
    {"role": "assistant", "content": "首字延迟 (time to first token) 🚀", "tool_calls": None},
    {"role": "user", "content": "谢谢 <b>&</b>", "meta": {"lang": "中文", "n": 2}},
]


# --------------------------------------------------------------------- fixtures

def train_byte_level() -> Tokenizer:
    """GPT-2 / Qwen style: ByteLevel pre-tokenizer and decoder, all 256 bytes in the alphabet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def train_byte_fallback() -> Tokenizer:
    """Llama-2 style: Metaspace, BPE with byte fallback, <0x00>..<0xFF> in the model vocab.

    The trainer puts the listed tokens first (ids 0..258, like Llama-2); the
    model is then rebuilt so the byte tokens are plain vocab, not added tokens.
    A small alphabet makes most Chinese characters and all emoji fall back to bytes.
    """
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  limit_alphabet=60, show_progress=False)
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = metaspace
    draft.train_from_iterator(CORPUS, trainer)
    model = json.loads(draft.to_str())["model"]
    tok = Tokenizer(models.BPE(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                               unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def save(hf, directory, generation_config=None, config_extra=None):
    hf.save_pretrained(directory)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    if config_extra:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_extra}))
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    byte_level, fallback = train_byte_level(), train_byte_fallback()
    out = {}

    chatml = Tokenizer.from_str(byte_level.to_str())
    chatml.post_processor = processors.ByteLevel(trim_offsets=False)  # Qwen: adds no BOS
    hf = PreTrainedTokenizerFast(tokenizer_object=chatml, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>",
                                 extra_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE)
    out["chatml"] = save(hf, root / "chatml",
                         {"eos_token_id": hf.convert_tokens_to_ids("<|endoftext|>")})

    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(byte_level.to_str()), bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>", add_bos_token=True, chat_template=LLAMA3_TEMPLATE,
        extra_special_tokens=["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"])
    ids = hf.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    # Llama-3's config asks for cleanup, which transformers 5 ignores for a BPE model.
    out["llama3"] = save(hf, root / "llama3", {"eos_token_id": ids, "bos_token_id": hf.bos_token_id},
                         config_extra={"clean_up_tokenization_spaces": True})

    hf = PreTrainedTokenizerFast(tokenizer_object=fallback, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", add_bos_token=True)
    out["llama2"] = save(hf, root / "llama2")
    # Forcing HF's cleanup on a BPE tokenizer, to test that streaming follows it too.
    out["cleanup"] = save(hf, root / "cleanup", config_extra={
        "clean_up_tokenization_spaces": True,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True})
    # A Metaspace decoder drops every "▁" of the first token, not just a leading one.
    meta = Tokenizer.from_str(fallback.to_str())
    meta.decoder = decoders.Sequence([decoders.Metaspace("▁", prepend_scheme="first"),
                                      decoders.ByteFallback(), decoders.Fuse()])
    hf = PreTrainedTokenizerFast(tokenizer_object=meta, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    out["metaspace"] = save(hf, root / "metaspace")
    out["legacy"] = legacy_layout(out["chatml"], root / "legacy")
    return out


def legacy_layout(src, directory):
    """The older layout: template inside tokenizer_config.json, AddedToken dicts, an
    added token that only tokenizer_config.json declares, and a truncation setting."""
    directory.mkdir()
    data = json.loads((src / "tokenizer.json").read_text())
    # Prompts must never be truncated, whatever tokenizer.json says (HF's encode does not either).
    data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (directory / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = (src / "chat_template.jinja").read_text()
    config["image_token"] = "<image>"  # transformers 5 treats any *_token key as a named special
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                           "normalized": False, "rstrip": False, "single_word": False, "special": True}
    # Added, not special, so decode keeps them; "工具" is outside the byte-level alphabet.
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config["added_tokens_decoder"] = {
        str(9998 + k): {"content": name, "special": False, **flags}
        for k, name in enumerate(["<tool_call>", "工具"])}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["chatml", "llama3", "llama2", "cleanup", "metaspace", "legacy"])
def pair(request, dirs):
    """(ours, transformers') for one checkpoint."""
    path = dirs[request.param]
    return load_checkpoint_tokenizer(path), PreTrainedTokenizerFast.from_pretrained(path)


def stream(tok, ids):
    det = StreamDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    return pieces, det.flush()


def assert_streams_like_decode(tok, ids):
    """Every prefix: what came out so far never changes later; push all + flush == decode."""
    final = tok.decode(ids)
    det = StreamDetokenizer(tok)
    for k, i in enumerate(ids):
        det.push(i)
        assert final.startswith(det.text), (ids[:k + 1], det.text, final)
    det.flush()
    assert det.text == final, (ids, det.text, final)


def _is_utf8(data):
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def random_streams(tok, n, seed):
    """Random ids, leaning on the ones that split characters (bytes) and on specials."""
    rng = random.Random(seed)
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    short = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1]
    for _ in range(n):
        pools = [range(tok.vocab_size), short, short, special]
        yield [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 24))]


# ----------------------------------------------------------------- the tests

def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_fixtures_split_characters(pair):
    """Sanity: the fixtures really spread characters over several tokens."""
    ours, _ = pair
    ids = ours.encode("".join(CORPUS[:2]) + "罕见字𠀀𪚥")
    assert any(not _is_utf8(ours.token_bytes(i)) for i in ids)
    assert 300 < ours.vocab_size <= 1000


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_and_decode_match_transformers(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_match_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)  # the full size, added tokens included
    assert ours.special_tokens_map == hf.special_tokens_map  # what templates see
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == set(hf.all_special_ids)
    assert all(ours.token_bytes(i) == b"" for i in hf.all_special_ids)
    with pytest.raises(ValueError):
        ours.token_bytes(ours.vocab_size)
    with pytest.raises(TypeError):
        ours.token_bytes(1.0)
    ours.clear_cache()
    assert ours.encode("你好😀") == hf.encode("你好😀")


def test_bos_follows_the_checkpoint(dirs):
    l3, l2, qwen = (load_checkpoint_tokenizer(dirs[k]) for k in ("llama3", "llama2", "chatml"))
    assert l3.encode("hi")[0] == l3.bos_token_id and l2.encode("hi")[0] == l2.bos_token_id
    assert qwen.bos_token_id is None and qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


def test_add_bos_token_used_when_tokenizer_json_has_no_post_processor(dirs, tmp_path):
    data = json.loads((dirs["llama2"] / "tokenizer.json").read_text())
    data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((dirs["llama2"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = load_checkpoint_tokenizer(tmp_path)
    assert tok.encode("你好") == [tok.bos_token_id] + tok.encode("你好", add_special_tokens=False)


def test_eos_token_ids_include_generation_config(dirs):
    l3, qwen, l2 = (load_checkpoint_tokenizer(dirs[k]) for k in ("llama3", "chatml", "llama2"))
    names = [l3._tok.id_to_token(i) for i in l3.eos_token_ids]
    assert names[0] == "<|eot_id|>" and set(names) == {"<|eot_id|>", "<|end_of_text|>"}
    assert [qwen._tok.id_to_token(i) for i in qwen.eos_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    assert l2.eos_token_ids == (l2.eos_token_id,)


def test_no_tokenizer_json_means_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_checkpoint_tokenizer(tmp_path) is None


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_of_encoded_text(pair, text):
    ours, _ = pair
    ids = ours.encode(text)
    assert_streams_like_decode(ours, ids)
    pieces, rest = stream(ours, ids)
    assert "\ufffd" not in "".join(pieces) + rest  # valid text never shows a replacement char


def test_stream_of_random_ids(pair):
    ours, hf = pair
    for ids in random_streams(ours, 400, seed=len(ours._tok.to_str())):
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert_streams_like_decode(ours, ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_of_hypothesis_ids(pair, data):
    ours, hf = pair
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=30))
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert_streams_like_decode(ours, ids)


def test_streams_are_per_request(pair):
    """Two interleaved requests do not share state (pending bytes, first-token rules)."""
    ours, _ = pair
    x, y = ours.encode("😀你好 world"), ours.encode(" 罕见字𠀀 ok")
    a, b = StreamDetokenizer(ours), StreamDetokenizer(ours)
    for i in range(max(len(x), len(y))):
        if i < len(x):
            a.push(x[i])
        if i < len(y):
            b.push(y[i])
    a.flush(), b.flush()
    assert (a.text, b.text) == (ours.decode(x), ours.decode(y))


def test_first_token_space_rules(pair):
    """Strip drops one leading space of the text; Metaspace drops every "▁" of the first token."""
    ours, hf = pair
    if ours.decoder_model.byte_level:
        pytest.skip("byte-level decoders keep every space")
    space, bos, byte_space = (ours._tok.token_to_id(t) for t in ("▁", "<s>", "<0x20>"))
    two_marks = ours._tok.token_to_id("▁▁") or space
    for ids in ([bos, space, space], [space, bos, space], [byte_space, space], [two_marks, space]):
        ids = ids + ours.encode("a b", add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert_streams_like_decode(ours, ids)
    if ours.decoder_model.strip[1]:
        assert ours.decode([bos, space, space] + ours.encode("a", add_special_tokens=False)) == "  a"


@given(st.lists(st.text(alphabet=" .?!,'ntmsver", max_size=6), max_size=12))
def test_cleanup_stream_equals_cleanup_of_the_whole(chunks):
    class Chunks:  # an inner stream that emits one given chunk per push
        pending = b""

        def __init__(self):
            self.queue = list(chunks)

        def push(self, _):
            return self.queue.pop(0)

        def flush(self):
            return ""

    s, out = _CleanupStream(Chunks()), []
    whole = clean_up_tokenization("".join(chunks))
    for _ in chunks:
        out.append(s.push(0))
        assert whole.startswith("".join(out))
    assert "".join(out) + s.flush() == whole


@pytest.mark.parametrize("name", ["chatml", "llama3", "legacy"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("n_messages", [1, 2, 4])
def test_chat_template_matches_transformers(dirs, name, add_generation_prompt, n_messages):
    ours, hf = load_checkpoint_tokenizer(dirs[name]), PreTrainedTokenizerFast.from_pretrained(dirs[name])
    for messages in (CONVERSATION[:n_messages], CONVERSATION[1:1 + n_messages]):
        want = hf.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == want
        assert ours.encode(got, add_special_tokens=False) == hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_chat_template_errors(dirs):
    tok = load_checkpoint_tokenizer(dirs["chatml"])
    assert tok.chat_template == CHATML_TEMPLATE
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([])
    no_template = load_checkpoint_tokenizer(dirs["llama2"])
    assert no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat_template"):
        no_template.apply_chat_template(CONVERSATION)


def with_template(directory, template):
    return HFTokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")), chat_template=template)


@pytest.mark.parametrize("template", ["{{ messages.__class__.__mro__ }}",
                                      "{% set ns = namespace(_x=1) %}",
                                      "{{ dict.__init__.__globals__ }}"])
def test_sandbox_refuses_python_internals(dirs, template):
    with pytest.raises(jinja2.exceptions.TemplateError):
        with_template(dirs["chatml"], template).apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_tag_loop_controls_and_tools_match_transformers(dirs):
    template = ("{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}"
                "{{ tools is none }}{{ eos_token }}{{ dict(a=1) | tojson }}{{ extra }}")
    hf = PreTrainedTokenizerFast.from_pretrained(dirs["chatml"])
    want = hf.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False, extra="!")
    assert with_template(dirs["chatml"], template).apply_chat_template(
        CONVERSATION, add_generation_prompt=False, eos_token="<|im_end|>", extra="!") == want


def test_unstreamable_decoder_is_refused(dirs):
    tok = Tokenizer.from_file(str(dirs["chatml"] / "tokenizer.json"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="cannot stream"):
        HFTokenizer(tok)
