"""Tests for the byte-level BPE tokenizer and the streaming detokenizer."""

import codecs
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from tinyserve.tokenizer import (
    SPLIT_PATTERN,
    ByteBPETokenizer,
    StreamDetokenizer,
    load_default_tokenizer,
)

CORPUS_DIR = Path(__file__).resolve().parents[1] / "shared" / "tinyserve" / "data" / "corpus"

SAMPLES = [
    "",
    "大语言模型的推理分为预填充和解码两个阶段。",
    "Continuous batching keeps the GPU busy.",
    "首字延迟 TTFT 是 320ms，出字速度 TPOT 约 45 ms/token！",
    "emoji: 😀🚀👩‍💻🇨🇳 和 ☔️",
    "   \n\t  \r\n  two  spaces\u3000全角空格 ",
    "1234567890 3.14159 ２０２４年",
    "（全角标点）：“引号”、《书名》…… (ASCII) [x]; a_b-c!?",
    "罕见字 𠀀𪚥 and combining e\u0301 and Ω≈ç√∫",
    "<|bos|>hello<|eos|> 不要解析特殊词元 <|pad|>",
]

MIXED_TEXT = "今天☔️下雨，我们在 GPU 上跑推理🚀！解码 1024 个词元只用了 0.8 秒😀。"


@pytest.fixture(scope="module")
def tok():
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def corpus():
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt"))}


def random_text(rng, n):
    """Random code points from all planes (no surrogates, which UTF-8 cannot encode)."""
    chars = []
    while len(chars) < n:
        cp = rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
        if not 0xD800 <= cp <= 0xDFFF:
            chars.append(chr(cp))
    return "".join(chars)


# --------------------------------------------------------------------- encode


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < tok.vocab_size - len(tok.special_tokens) for i in ids)


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 30))
        assert tok.decode(tok.encode(text)) == text


def test_pre_split_covers_text_and_limits_digits():
    split = re.compile(SPLIT_PATTERN)
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, 50)
        assert "".join(split.findall(text)) == text
    assert split.findall("推理引擎，batch=32 12345") == ["推理引擎", "，", "batch", "=", "32", " ", "123", "45"]
    assert split.findall("hello  world") == ["hello", " ", " world"]
    # Long runs are capped so that encoding stays linear in the text length.
    assert [len(c) for c in split.findall("推" * 70 + "x" * 40)] == [32, 32, 6, 32, 8]


def test_learned_tokens_never_cross_chunks(tok):
    split = re.compile(SPLIT_PATTERN)
    for i in range(256, tok.vocab_size - len(tok.special_tokens)):
        try:
            piece = tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a multi-byte character: inside one chunk by construction
        assert split.findall(piece) == [piece], (i, piece)


def test_encode_is_deterministic(tok):
    text = MIXED_TEXT * 3
    fresh = ByteBPETokenizer(tok.merges)  # no shared cache with `tok`
    assert tok.encode(text) == tok.encode(text) == fresh.encode(text)


def test_shipped_vocab(tok):
    assert tok.vocab_size == 2048
    assert len(tok.merges) == 2048 - 256 - 3
    assert tok.special_tokens == {"<|bos|>": 2045, "<|eos|>": 2046, "<|pad|>": 2047}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2045, 2046, 2047)
    assert load_default_tokenizer() is tok  # cached
    # Common words of the corpus became single tokens.
    for word in ["推理", "请求", " the", " cache"]:
        assert len(tok.encode(word)) == 1, word


def test_compression(tok, corpus):
    def bytes_per_token(text):
        return len(text.encode("utf-8")) / len(tok.encode(text))

    # Measured on the shipped vocab: zh 3.46, en 2.84 (raw bytes would be 1.0).
    assert bytes_per_token(corpus["zh"]) > 3.0
    assert bytes_per_token(corpus["en"]) > 2.5
    # Unseen sentences (measured zh 3.43, en 2.77).
    held_out_zh = (
        "周二下午，我们小组讨论了如何让模型在一张显卡上同时服务更多的用户。大家都认为，"
        "先把请求组成批次，再用分页的方式管理缓存，是最直接的办法。"
        "晚上回家的路上下起了小雨，我在便利店买了一个饭团当夜宵。"
    )
    held_out_en = (
        "On Tuesday our group discussed how to serve more users from a single GPU. "
        "Everyone agreed that batching requests and managing the cache in pages is the "
        "most direct approach. It started to rain on my way home."
    )
    assert bytes_per_token(held_out_zh) > 2.5
    assert bytes_per_token(held_out_en) > 2.2


# -------------------------------------------------------------------- specials


def test_special_tokens(tok):
    ids = tok.encode("你好", add_bos=True)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "你好"
    with_eos = ids + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_eos) == "你好"
    assert tok.decode(with_eos, skip_special_tokens=False) == "<|bos|>你好<|eos|><|pad|>"
    assert tok.token_bytes(tok.eos_token_id) == b""
    assert tok.is_special(tok.pad_token_id) and not tok.is_special(65)


def test_special_strings_in_text_are_plain_text(tok):
    text = "<|eos|><|bos|><|pad|>"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == text


# ---------------------------------------------------------------------- errors


def test_errors(tok):
    with pytest.raises(ValueError, match="token id 2048 is out of range"):
        tok.decode([1, 2048])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.token_bytes(-1)
    with pytest.raises(TypeError, match="token id must be an int, got str"):
        tok.decode(["a"])
    with pytest.raises(TypeError, match="encode\\(\\) expects a str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(TypeError, match="encode\\(\\) expects a str, got NoneType"):
        tok.encode(None)
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        ByteBPETokenizer.train(["abc"], 258)
    with pytest.raises(TypeError, match="expects a list of str"):
        ByteBPETokenizer.train("abc", 300)


def test_decode_invalid_utf8_uses_replacement(tok):
    assert tok.decode([0xE4, 0xB8, ord("A")]) == "\ufffdA"
    assert tok.decode([0xFF, 0xE4]) == "\ufffd\ufffd"


# -------------------------------------------------------------------- training


def naive_train(texts, num_merges):
    """Reference: recount every pair after every merge (slow but obviously right)."""
    counts = Counter(c for t in texts for c in re.findall(SPLIT_PATTERN, t))
    words = {c: list(c.encode("utf-8")) for c in counts}
    merges = []
    for k in range(num_merges):
        pairs = Counter()
        for c, ids in words.items():
            for p in zip(ids, ids[1:]):
                pairs[p] += counts[c]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for c, ids in words.items():
            out, i = [], 0
            while i < len(ids):
                if ids[i : i + 2] == list(best):
                    out.append(256 + k)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            words[c] = out
    return merges


def test_train_small_text():
    # Pairs: aa x4 (overlapping), ab x2, ...; then (97,98) and (256,97) tie at 2:
    # the smaller pair wins.
    tok = ByteBPETokenizer.train(["aaabdaaabac"], 256 + 2 + 3)
    assert tok.merges == [(97, 97), (97, 98)]
    assert tok.vocab_size == 261
    assert tok.encode("aaabdaaabac") == [256, 257, 100, 256, 257, 97, 99]


def test_train_matches_naive_reference(corpus):
    texts = [corpus["zh"][:1500], corpus["en"][:1500]]
    tok = ByteBPETokenizer.train(texts, 256 + 3 + 150)
    assert tok.merges == naive_train(texts, 150)


def test_train_is_deterministic_and_sized(corpus):
    texts = [corpus["zh"][:3000], corpus["en"][:3000]]
    a = ByteBPETokenizer.train(texts, 512)
    b = ByteBPETokenizer.train(list(texts), 512)
    assert a.vocab_size == 512 and a.merges == b.merges
    assert a.special_tokens == {"<|bos|>": 509, "<|eos|>": 510, "<|pad|>": 511}
    for text in SAMPLES:
        assert a.decode(a.encode(text)) == text


def test_train_custom_specials_and_no_merges():
    tok = ByteBPETokenizer.train(["hi"], 257, special_tokens=["<|end|>"])
    assert tok.merges == [] and tok.special_tokens == {"<|end|>": 256}
    assert tok.bos_token_id is None
    assert tok.encode("hi") == [104, 105]


def test_train_stops_early_when_out_of_pairs():
    with pytest.warns(UserWarning, match="only enough pairs for 2 merges"):
        tok = ByteBPETokenizer.train(["abc"], 400)
    assert tok.vocab_size == 256 + 2 + 3


# ------------------------------------------------------------------ save / load


def test_save_load_round_trip(tok, tmp_path, corpus):
    path = tmp_path / "tok.json"
    tok.save(path)
    loaded = ByteBPETokenizer.load(path)
    assert loaded.merges == tok.merges
    assert loaded.special_tokens == tok.special_tokens
    assert loaded.pattern == tok.pattern
    assert loaded.encode(corpus["zh"][:5000]) == tok.encode(corpus["zh"][:5000])
    # Saving is deterministic: the same tokenizer gives the same file bytes.
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_shipped_file_matches_saved_form(tok, tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "shared" / "tinyserve" / "data" / "tokenizer.json"
    tok.save(tmp_path / "tok.json")
    assert (tmp_path / "tok.json").read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 500_000


def test_load_rejects_other_files(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"model": {"type": "BPE"}}', encoding="utf-8")
    with pytest.raises(ValueError, match="is not a tinyserve-byte-bpe v1 file"):
        ByteBPETokenizer.load(path)


# ---------------------------------------------------------- stream detokenizer


def complete_prefix(data: bytes) -> str:
    """Oracle for valid UTF-8 input: the text of all complete characters in `data`."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            pass
    raise AssertionError("not a prefix of valid UTF-8")


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def check_stream(tok, ids):
    """Push ids one by one; check every step and the final invariant."""
    det = StreamDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == tok.decode(ids) == det.text
    return pieces


def check_valid_text_stream(tok, text, ids):
    """For valid text: after every push, exactly the complete characters are out."""
    det = StreamDetokenizer(tok)
    for k, i in enumerate(ids, 1):
        piece = det.push(i)
        assert "\ufffd" not in piece
        assert det.text == complete_prefix(tok.decode_bytes(ids[:k]))
    assert det.flush() == ""
    assert det.text == text


def test_stream_token_by_token(tok):
    ids = tok.encode(MIXED_TEXT)
    # The shipped vocab really does split some characters across tokens here.
    assert any(not is_utf8(tok.token_bytes(i)) for i in ids)
    check_valid_text_stream(tok, MIXED_TEXT, ids)


def test_stream_byte_by_byte(tok):
    ids = list(MIXED_TEXT.encode("utf-8"))  # ids 0..255 are single bytes
    check_valid_text_stream(tok, MIXED_TEXT, ids)


def test_stream_every_split_point(tok):
    # Stop the stream after k ids: the pieces before flush() hold exactly the complete characters.
    for ids in (tok.encode(MIXED_TEXT), list(MIXED_TEXT.encode("utf-8"))):
        for k in range(len(ids) + 1):
            pieces = check_stream(tok, ids[:k])
            assert "".join(pieces[:-1]) == complete_prefix(tok.decode_bytes(ids[:k]))


def test_stream_whole_corpus(tok, corpus):
    for text in corpus.values():
        ids = tok.encode(text)
        pieces = check_stream(tok, ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_stream_random_ids_over_whole_vocab(tok):
    rng = random.Random(1234)
    for _ in range(1000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))]
        check_stream(tok, ids)


def test_stream_random_bytes_is_eager(tok):
    # Byte soup biased towards the tricky values (lead bytes, range edges).
    tricky = [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF,
              0xE0, 0xE4, 0xED, 0xEF, 0xF0, 0xF3, 0xF4, 0xF5, 0xFF]
    rng = random.Random(7)
    for _ in range(2000):
        ids = [rng.choice(tricky) for _ in range(rng.randint(0, 12))]
        det = StreamDetokenizer(tok)
        reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, ref = "", ""
        for i in ids:
            out += det.push(i)
            ref += reference.decode(bytes([i]))
            # Never later than Python's own incremental decoder ...
            assert out.startswith(ref)
            # ... and at most one unfinished character is held back.
            assert len(det.pending) <= 3
            assert det.pending.decode("utf-8", errors="replace") in ("", "\ufffd")
        assert out + det.flush() == bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"\xe4\xb8A", ["", "", "\ufffdA"]),  # lead + continuation, then a letter
        (b"\xff\xe4", ["\ufffd", ""]),  # 0xFF can never start a character
        (b"\x80", ["\ufffd"]),  # a continuation byte out of place
        (b"\xe0\x80", ["", "\ufffd\ufffd"]),  # overlong form: E0 needs A0..BF next
        (b"\xed\xa0", ["", "\ufffd\ufffd"]),  # would be a surrogate
        (b"\xf4\x90", ["", "\ufffd\ufffd"]),  # would be above U+10FFFF
        (b"\xf0\x9f\x98", ["", "", ""]),  # still waiting for the 4th byte
        (b"\xf0\x9f\x98\x80", ["", "", "", "😀"]),
    ],
)
def test_stream_replaces_as_soon_as_certain(tok, data, expected):
    det = StreamDetokenizer(tok)
    assert [det.push(b) for b in data] == expected
    rest = det.flush()
    assert "".join(expected) + rest == data.decode("utf-8", errors="replace")


def test_stream_skips_specials_without_breaking_characters(tok):
    det = StreamDetokenizer(tok)
    emoji = "😀".encode("utf-8")
    pieces = [det.push(emoji[0]), det.push(emoji[1]), det.push(tok.eos_token_id), det.push(emoji[2]), det.push(emoji[3])]
    assert pieces == ["", "", "", "", "😀"]
    assert det.flush() == ""


def test_stream_rejects_bad_ids(tok):
    det = StreamDetokenizer(tok)
    with pytest.raises(ValueError, match="token id 5000 is out of range"):
        det.push(5000)


def test_clear_cache_forgets_chunks_but_not_results():
    tok = load_default_tokenizer()
    ids = tok.encode("清空缓存之后，编码结果不变。")
    tok.clear_cache()
    assert tok._encode_chunk.cache_info().currsize == 0
    assert tok.encode("清空缓存之后，编码结果不变。") == ids
