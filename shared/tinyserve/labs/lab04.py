"""Checks for lab 04 (a streaming detokenizer that never sends half a character).

* ``utf8_length(lead_byte) -> int``: how many bytes the character starting with this byte
  has (1-4), or 0 if the byte cannot start a character.
* ``pending_start(data) -> int``: where an unfinished-but-still-possible character starts at
  the end of ``data`` (``len(data)`` when nothing has to wait).
* ``StreamDetokenizer(tokenizer)`` with ``push(token_id) -> str`` and ``flush() -> str``:
  compared push by push with ``tinyserve.tokenizer.StreamDetokenizer``, which emits exactly
  what Python's incremental UTF-8 decoder (errors="replace") emits.
"""

from __future__ import annotations

import functools
import random

from tinyserve.labs.hints import call, fail
from tinyserve.tokenizer import utf8_lead_info

__all__ = ["check_utf8_length", "check_pending_start", "check_stream_detokenizer"]

LAB04_TEXTS = (
    "你好，世界！",
    "调度器把请求放进队列，轮到时先做预填充。",
    "一个汉字是 3 个字节，一个 emoji 是 4 个：🙂🚀",
    "首字延迟 TTFT ≈ 0.2 s，出字速度 TPOT ≈ 30 ms/token ✅",
    "café, naïve, 𝄞, ☃ and 中文 mixed 🤖!",
    "🧑‍💻👍🏽🇨🇳",
)


def _utf8_length_ref(b: int) -> int:
    """The package detokenizer's answer: 1 for ASCII, else the lead byte's sequence length."""
    return 1 if b < 0x80 else utf8_lead_info(b)[0]


def _char_kind(need: int) -> tuple[str, str]:
    return {2: ("一个 2 字节字符（比如 é）", "a 2-byte character (e.g. é)"),
            3: ("一个 3 字节字符（比如汉字）", "a 3-byte character (e.g. a Chinese character)"),
            4: ("一个 4 字节字符（比如 emoji）", "a 4-byte character (e.g. an emoji)")}.get(
                need, (f"一个 {need} 字节字符", f"a {need}-byte character"))


def check_utf8_length(utf8_length):
    """Check ``utf8_length(lead_byte)`` on all 256 byte values."""
    for b in range(256):
        got = call(utf8_length, "utf8_length", b, where=(f"utf8_length(0x{b:02X})：", f"utf8_length(0x{b:02X}): "))
        want = _utf8_length_ref(b)
        if isinstance(got, bool) or not isinstance(got, int):
            fail(f"utf8_length(0x{b:02X}) 返回了 {got!r}（{type(got).__name__}），应返回 int {want}",
                 f"utf8_length(0x{b:02X}) returned {got!r} ({type(got).__name__}); return the int {want}")
        if got == want:
            continue
        head = (f"utf8_length(0x{b:02X}) 返回 {got}，应为 {want}。字节 0x{b:02X} = 0b{b:08b}：",
                f"utf8_length(0x{b:02X}) returned {got}, expected {want}. Byte 0x{b:02X} = 0b{b:08b}: ")
        if b < 0x80:
            why = ("最高位是 0，它本身就是一个完整的 ASCII 字符，长度 1",
                   "its top bit is 0, so it is a whole ASCII character: length 1")
        elif b < 0xC0:
            why = ("10xxxxxx 是后续字节（continuation byte），只能跟在首字节后面，不能开始一个字符：返回 0",
                   "10xxxxxx is a continuation byte: it only follows a lead byte and never starts a character, "
                   "return 0")
        elif b < 0xC2:
            why = ("0xC0 和 0xC1 只能组成 ASCII 的“超长”编码（overlong），Python 的解码器拒绝它们：返回 0",
                   "0xC0 and 0xC1 could only make overlong forms of ASCII, which Python's decoder rejects: "
                   "return 0")
        elif b > 0xF4:
            why = ("0xF5–0xFF 会编码出大于 U+10FFFF 的码点（或根本不是合法的首字节）：返回 0",
                   "0xF5-0xFF would encode code points above U+10FFFF (or are no lead byte at all): return 0")
        else:
            why = (f"首字节开头有几个 1，这个字符就有几个字节：110xxxxx→2，1110xxxx→3，11110xxx→4，这里是 {want}",
                   f"count the leading 1 bits of a lead byte: 110xxxxx->2, 1110xxxx->3, 11110xxx->4; "
                   f"here {want}")
        fail(head[0] + why[0], head[1] + why[1])
    print("✓ utf8_length 在全部 256 个字节上都对 / utf8_length is right on all 256 byte values "
          "(1: 0x00–0x7F, 2: 0xC2–0xDF, 3: 0xE0–0xEF, 4: 0xF0–0xF4, 0: the rest)")


def _settle_reason(data: bytes) -> tuple[str, str]:
    """Why all of ``data`` is settled (the reference returned len(data))."""
    from tinyserve.tokenizer import utf8_lead_info
    n = len(data)
    start = n
    for s in range(n - 1, max(n - 4, -1), -1):
        if not 0x80 <= data[s] <= 0xBF:
            start = s
            break
    if start == n:
        return ("末尾（最多 3 个）都是后续字节，前面没有能等待它们的首字节：它们再也凑不成字符，现在就输出（变成 U+FFFD）",
                "the last bytes (up to 3) are all continuation bytes with no lead byte they could belong to: "
                "they can never form a character, emit them now (as U+FFFD)")
    lead = data[start]
    need = _utf8_length_ref(lead)
    have = n - start
    if need == 0:
        return (f"0x{lead:02X} 不能开始一个字符（utf8_length 为 0）：后面再来什么都救不了它，现在就输出（U+FFFD）",
                f"0x{lead:02X} cannot start a character (utf8_length is 0): nothing that comes later can save it, "
                f"emit it now (as U+FFFD)")
    if have >= need:
        return (f"以 0x{lead:02X} 开头的 {need} 字节字符已经到齐了（或者它本身就是 ASCII）：完整的字符要立刻输出",
                f"the {need}-byte character starting with 0x{lead:02X} is complete (or it is ASCII): "
                f"emit complete characters at once")
    lo, hi = utf8_lead_info(lead)[1:]
    sec = data[start + 1]
    return (f"首字节 0x{lead:02X} 之后的第二个字节必须在 0x{lo:02X}–0x{hi:02X} 之间，而这里是 0x{sec:02X}：这个字符已经"
            f"不可能合法了（超长编码、代理区或超出 U+10FFFF），Python 的解码器此时就输出 U+FFFD，你也要现在输出"
            f"（用 second_byte_range(lead)）",
            f"after the lead byte 0x{lead:02X} the second byte must be 0x{lo:02X}-0x{hi:02X}, here it is "
            f"0x{sec:02X}: this character can no longer be valid (overlong, surrogate or above U+10FFFF); "
            f"Python's decoder emits U+FFFD right now and so must you (use second_byte_range(lead))")


def _invalid_reason(data: bytes, skip_chars: int) -> tuple[str, str]:
    """Why the first invalid bytes of ``data`` that decode past character ``skip_chars`` are settled."""
    pos = chars = 0
    while True:
        try:
            data[pos:].decode("utf-8")
            return _settle_reason(data)
        except UnicodeDecodeError as e:
            start, end = pos + e.start, pos + e.end
        chars += len(data[pos:start].decode("utf-8"))
        if chars >= skip_chars:
            break
        chars += 1
        pos = end
    bad = data[start:end]
    lead = bad[0]
    if end - start == 1 and 0x80 <= lead <= 0xBF:
        return (f"{bad!r} 是一个后续字节，前面没有等着它的首字节，它永远凑不成字符（U+FFFD）",
                f"{bad!r} is a continuation byte with no lead byte waiting for it: it can never form a "
                f"character (U+FFFD)")
    if _utf8_length_ref(lead) == 0:
        return (f"0x{lead:02X} 不能开始一个字符（utf8_length 为 0），它永远是 U+FFFD",
                f"0x{lead:02X} cannot start a character (utf8_length is 0): it is U+FFFD for good")
    nxt = data[end:end + 1]
    if end - start == 1 and nxt and 0x80 <= nxt[0] <= 0xBF:
        from tinyserve.tokenizer import utf8_lead_info
        lo, hi = utf8_lead_info(lead)[1:]
        return (f"首字节 0x{lead:02X} 之后的第二个字节必须在 0x{lo:02X}–0x{hi:02X} 之间（second_byte_range），"
                f"而这里是 0x{nxt[0]:02X}：超长编码、代理区或超出 U+10FFFF，这个字符不可能合法，现在就输出 U+FFFD",
                f"after the lead byte 0x{lead:02X} the second byte must be 0x{lo:02X}-0x{hi:02X} "
                f"(second_byte_range), here it is 0x{nxt[0]:02X}: overlong, surrogate or above U+10FFFF, this "
                f"character can never be valid, emit U+FFFD now")
    return (f"{bad!r} 是{_char_kind(_utf8_length_ref(lead))[0]}的开头，但下一个字节 {nxt!r} 不是后续字节"
            f"（10xxxxxx）：这个字符再也补不全了，现在就输出 U+FFFD",
            f"{bad!r} starts {_char_kind(_utf8_length_ref(lead))[1]}, but the next byte {nxt!r} is not a "
            f"continuation byte (10xxxxxx): it can never be completed, emit U+FFFD now")


def _pending_cases():
    import itertools
    rng = random.Random(4)
    yield b""
    for b in range(256):
        yield bytes([b])
    for a in range(256):
        for b in (0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xE4, 0xF0):
            yield bytes([a, b])
    interesting = (0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE4, 0xED, 0xEF,
                   0xF0, 0xF4, 0xF5, 0xFF)
    for combo in itertools.product(interesting, repeat=3):
        yield bytes(combo)
    for _ in range(3000):
        yield bytes(rng.choice(interesting) for _ in range(rng.randint(4, 7)))
    for text in LAB04_TEXTS:
        raw = text.encode("utf-8")
        for i in range(len(raw) + 1):
            yield raw[:i]


def check_pending_start(pending_start):
    """Check ``pending_start(data)`` on every short byte string that matters, and on prefixes of real text."""
    count = 0
    for data in _pending_cases():
        count += 1
        got = call(pending_start, "pending_start", data, where=(f"pending_start({data!r})：", f"pending_start({data!r}): "))
        want = _engine_pending_start(data)
        n = len(data)
        if got == _incremental_pending_start(data):   # CPython waits one byte longer after ED A0-BF
            continue
        if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= n:
            fail(f"pending_start({data!r}) 返回了 {got!r}，应返回 0 到 len(data)={n} 之间的 int（这里应为 {want}）",
                 f"pending_start({data!r}) returned {got!r}; return an int between 0 and len(data)={n} "
                 f"(here {want})")
        if got == want:
            continue
        head = (f"pending_start({data!r}) 返回 {got}，应为 {want}。", f"pending_start({data!r}) returned {got}, "
                f"expected {want}. ")
        if want < n:
            tail = data[want:]
            need = _utf8_length_ref(tail[0])
            kind = _char_kind(need)
            if got > want:
                fail(head[0] + f"末尾的 {len(tail)} 个字节 {tail!r} 是{kind[0]}的前 {len(tail)} 个字节，后面的 token "
                     f"还可能把它补全——留在缓冲区里，不要现在解码",
                     head[1] + f"the last {len(tail)} bytes {tail!r} are the first {len(tail)} bytes of {kind[1]}; "
                     f"a later token may still complete it: keep them pending, do not decode them yet")
            fail(head[0] + f"只有末尾的 {tail!r}（{kind[0]}的开头）需要等；它前面的字节都已确定，应该输出",
                 head[1] + f"only the tail {tail!r} (the start of {kind[1]}) has to wait; every byte before it "
                 f"is settled and should be emitted")
        zh, en = _settle_reason(data)
        fail(head[0] + f"这些字节都已确定：{zh}", head[1] + f"every byte is settled: {en}")
    print(f"✓ pending_start 在 {count} 个字节串上与参考实现一致 / pending_start matches the reference on "
          f"{count} byte strings (all 1-byte, many 2-4-byte ones, every prefix of Chinese and emoji text)")


# ---- the stream check -----------------------------------------------------------------
#
# Two answers are accepted at every step, and a student must stick to one of them: the reference
# (emit U+FFFD as soon as the second byte proves a character impossible) and CPython's incremental
# decoder, which differ only after ED A0-BF (a UTF-16 surrogate): with errors="replace" it is
# already certain, but CPython waits for the third byte. The final text is the same either way.

def _engine_pending_start(data: bytes) -> int:
    """Where the engine's StreamDetokenizer cuts ``data`` (one token of these bytes)."""
    from types import SimpleNamespace

    from tinyserve.tokenizer import StreamDetokenizer
    det = StreamDetokenizer(SimpleNamespace(token_bytes=lambda _id: data))
    det.push(0)
    return len(data) - len(det.pending)


def _incremental_pending_start(data: bytes) -> int:
    import codecs
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(data, final=False)
    return len(data) - len(dec.getstate()[0])


class _IncrementalOracle:
    def __init__(self, tok):
        import codecs
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def pending(self) -> bytes:
        return self.dec.getstate()[0]

    def push(self, token_id) -> str:
        return self.dec.decode(self.tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def _greedy_ids(tok, data: bytes) -> list[int]:
    """Cover ``data`` with vocabulary tokens, longest match first (any bytes, even invalid UTF-8)."""
    table = _token_table(tok)
    longest = max(len(b) for b in table)
    ids, i = [], 0
    while i < len(data):
        for size in range(min(longest, len(data) - i), 0, -1):
            tid = table.get(data[i:i + size])
            if tid is not None:
                ids.append(tid)
                i += size
                break
    return ids


@functools.lru_cache(maxsize=4)
def _token_table(tok) -> dict:
    table = {}
    for tid in range(tok.vocab_size):
        b = tok.token_bytes(tid)
        if b and b not in table:
            table[b] = tid
    return table


def _stream_cases(tok):
    """(label, ids, valid) for every stream the check feeds."""
    rng = random.Random(44)
    specials = [tok.special_tokens[name] for name in tok.special_tokens]
    for text in LAB04_TEXTS:
        raw = text.encode("utf-8")
        yield f"encode({text!r})", tok.encode(text), True
        yield f"{text!r} byte by byte", list(raw), True
        for i in range(1, len(raw)):
            yield f"{text!r} split at byte {i}", _greedy_ids(tok, raw[:i]) + _greedy_ids(tok, raw[i:]), True
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(2, 8))))
            parts = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
            yield f"{text!r} cut at bytes {cuts}", [t for p in parts for t in _greedy_ids(tok, p)], True
        ids = tok.encode(text)
        with_specials = list(ids)
        for _ in range(3):
            with_specials.insert(rng.randint(0, len(with_specials)), rng.choice(specials))
        yield f"encode({text!r}) with special tokens", with_specials, True
        raw_ids = list(raw)
        for _ in range(3):
            raw_ids.insert(rng.randint(1, len(raw_ids)), rng.choice(specials))
        yield f"{text!r} byte by byte, special tokens in the middle of characters", raw_ids, True
    # What a random-weight model produces: any id, in any order.
    for seed in range(40):
        r = random.Random(seed)
        ids = [r.randrange(tok.vocab_size) for _ in range(r.randint(5, 40))]
        yield f"random ids (seed {seed})", ids, None
    # Mostly single high bytes: lots of unfinished and impossible sequences.
    high = list(range(0x80, 0x100)) + [0x41, 0x20]
    for seed in range(60):
        r = random.Random(1000 + seed)
        ids = [r.choice(high) if r.random() < 0.8 else r.randrange(tok.vocab_size) for _ in range(r.randint(3, 25))]
        yield f"random bytes (seed {seed})", ids, None
    for data in (b"\xe4\xbd", b"\xf0\x9f\x99", b"\xe4\xbd\xa0\xe5", b"\xe0\x80\x80", b"\xed\xa0\x80",
                 b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80\x80\x80\x80", b"\xe4A\xe5\xa5", b"\xf0\x9f\x99\x82\xf0"):
        yield f"bytes {data!r} one by one", list(data), None


def _describe_ids(tok, ids, upto):
    return ", ".join(f"{i}:{tok.token_bytes(i)!r}" if not tok.is_special(i) else f"{i}:<special>"
                     for i in ids[max(0, upto - 5):upto + 1])


def _explain_push(tok, label, ids, k, got, want, pending_before, ref_pending, valid):
    step = (f"[{label}] 第 {k + 1} 个 token（id {ids[k]}）之后，", f"[{label}] after token {k + 1} (id {ids[k]}), ")
    ctx = (f"\n  最近的 token（id:字节）：{_describe_ids(tok, ids, k)}",
           f"\n  recent tokens (id:bytes): {_describe_ids(tok, ids, k)}")
    data = pending_before + tok.token_bytes(ids[k])
    if not isinstance(got, str):
        fail(step[0] + f"push 返回了 {got!r}（{type(got).__name__}），应返回 str（没有可输出的就返回 \"\"）",
             step[1] + f"push returned {got!r} ({type(got).__name__}); return a str (\"\" when nothing is ready)")
    if tok.is_special(ids[k]) and got != want:
        fail(step[0] + f"你输出了 {got!r}。特殊 token（{tok.decode([ids[k]], skip_special_tokens=False)}）没有文字："
             f"跳过它，不输出任何东西，也不要动缓冲区里等待的字节（decode 会跳过它们）" + ctx[0],
             step[1] + f"you emitted {got!r}. A special token ({tok.decode([ids[k]], skip_special_tokens=False)}) "
             f"has no text: skip it, emit nothing and leave the pending bytes alone (decode skips specials)" + ctx[1])
    if len(got) > len(want) and got.startswith(want):
        extra = got[len(want):]
        need = _utf8_length_ref(ref_pending[0]) if ref_pending else 0
        kind = _char_kind(need)
        if "\ufffd" in extra and ref_pending:
            fail(step[0] + f"你输出了 {extra!r}，但缓冲区末尾的 {len(ref_pending)} 个字节 {ref_pending!r} 只是"
                 f"{kind[0]}的前 {len(ref_pending)} 个字节——后面的 token 还可能补全它：先留在缓冲区，等字符到齐"
                 f"（或确定不可能到齐）再输出" + ctx[0],
                 step[1] + f"you emitted {extra!r}, but the {len(ref_pending)} bytes {ref_pending!r} at the end "
                 f"are only the first {len(ref_pending)} bytes of {kind[1]}; a later token may complete it: keep "
                 f"them pending until the character is complete (or can no longer be)" + ctx[1])
        fail(step[0] + f"你多输出了 {extra!r}：这些字节还没确定（等待中的是 {ref_pending!r}）" + ctx[0],
             step[1] + f"you emitted {extra!r} too early: those bytes are not settled yet (pending: "
             f"{ref_pending!r})" + ctx[1])
    if len(got) < len(want) and want.startswith(got):
        held = want[len(got):]
        if "\ufffd" in held:
            settled = data[:len(data) - len(ref_pending)]
            zh, en = _invalid_reason(settled, len(got))
            fail(step[0] + f"应该输出 {want!r}，你只输出了 {got!r}。字节 {settled!r} 已经确定，不会再变：{zh}。"
                 f"一直留着它们，文字就会卡住，缓冲区越积越多" + ctx[0],
                 step[1] + f"expected {want!r}, you emitted only {got!r}. The bytes {settled!r} are settled: {en}. "
                 f"Holding them back stalls the text and the buffer keeps growing" + ctx[1])
        fail(step[0] + f"应该输出 {want!r}，你只输出了 {got!r}：{held!r} 的字节已经全部到了，完整的字符要立刻"
             f"发出去（流式输出的意义就在于此），只有末尾未完成的字符才等待" + ctx[0],
             step[1] + f"expected {want!r}, you emitted only {got!r}: all the bytes of {held!r} have arrived; "
             f"emit complete characters at once (that is the point of streaming) and keep only an unfinished "
             f"last character pending" + ctx[1])
    if valid and "\ufffd" in got:
        fail(step[0] + f"你输出了 {got!r}，应为 {want!r}。输入是合法的 UTF-8 文本，输出里不该出现 U+FFFD（�）："
             f"是不是把半个字符解码了？" + ctx[0],
             step[1] + f"you emitted {got!r}, expected {want!r}. The input is valid UTF-8, so U+FFFD must never "
             f"appear: did you decode half a character?" + ctx[1])
    fail(step[0] + f"你输出了 {got!r}，应为 {want!r}（缓冲区加上这个 token 的字节是 {data!r}）" + ctx[0],
         step[1] + f"you emitted {got!r}, expected {want!r} (pending bytes plus this token's bytes: {data!r})" + ctx[1])


def check_stream_detokenizer(detokenizer_cls, tokenizer=None, show=True):
    """Feed ``detokenizer_cls(tokenizer)`` Chinese and emoji text split at every byte, token by token,
    byte by byte, with special tokens, and random id streams; compare every push and flush with the
    reference, and the concatenation with ``tokenizer.decode(ids)``."""
    from tinyserve.tokenizer import load_default_tokenizer
    tok = tokenizer or load_default_tokenizer()
    streams = tokens = 0
    for label, ids, valid in _stream_cases(tok):
        out = _check_stream(detokenizer_cls, tok, label, ids, valid)
        full = tok.decode(ids)
        assert "".join(out) == full, "internal: the reference detokenizer disagrees with decode"
        if valid:
            assert "\ufffd" not in full
        streams += 1
        tokens += len(ids)
    print(f"✓ {streams} 条流、{tokens} 个 token：每次 push 与 flush 都和参考实现一致，拼起来等于 tokenizer.decode(ids)；"
          f"合法文本从未输出 U+FFFD\n/ {streams} streams, {tokens} tokens: every push and flush matches the reference, "
          f"the concatenation equals tokenizer.decode(ids), and valid text never showed U+FFFD")
    if show:
        ids = list("好🙂".encode("utf-8"))
        det = detokenizer_cls(tok)
        pieces = [det.push(i) for i in ids] + [det.flush()]
        naive = [tok.decode([i]) for i in ids]
        print("逐字节喂入 / fed byte by byte:", tok.decode(ids))
        print("  naive decode per token:", naive)
        print("  your push/flush       :", pieces)


def _check_stream(detokenizer_cls, tok, label, ids, valid):
    """One stream, push by push against both accepted answers, then the flush; the pieces emitted."""
    from tinyserve.tokenizer import StreamDetokenizer
    det = call(detokenizer_cls, "StreamDetokenizer(tokenizer)", tok, where=(f"[{label}] ", f"[{label}] "))
    alive = [StreamDetokenizer(tok), _IncrementalOracle(tok)]
    out = []
    for k, tid in enumerate(ids):
        before = [o.pending for o in alive]
        wants = [o.push(tid) for o in alive]
        got = call(det.push, "push", tid, where=(f"[{label}] 第 {k + 1} 个 token：", f"[{label}] token {k + 1}: "))
        if got not in wants:
            _explain_push(tok, label, ids, k, got, wants[0], before[0], alive[0].pending, valid)
        alive = [o for o, w in zip(alive, wants) if w == got]
        out.append(got)
    out.append(_check_flush(det, alive[0], label))
    return out


def _check_flush(det, ref, label):
    """The student's ``flush()`` against the reference that matched every push; what it returned."""
    ref_pending = ref.pending
    want = ref.flush()
    got = call(det.flush, "flush", where=(f"[{label}] 结尾：", f"[{label}] at the end: "))
    if got is None and want == "":
        got = ""
    if got != want:
        if not isinstance(got, str):
            fail(f"[{label}] flush() 返回了 {got!r}，应返回 str {want!r}",
                 f"[{label}] flush() returned {got!r}; return the str {want!r}")
        if got == "":
            fail(f"[{label}] 流结束时缓冲区里还有 {ref_pending!r}：flush() 要把它们交出来——未完成的字符变成 "
                 f"U+FFFD，就像 decode 做的那样（应返回 {want!r}），并清空缓冲区",
                 f"[{label}] the stream ended with {ref_pending!r} pending: flush() must hand them over, an "
                 f"unfinished character becoming U+FFFD as decode does (expected {want!r}), and empty the buffer")
        fail(f"[{label}] flush() 返回了 {got!r}，应为 {want!r}（缓冲区里是 {ref_pending!r}，用 "
             f"bytes.decode('utf-8', errors='replace') 解码它）",
             f"[{label}] flush() returned {got!r}, expected {want!r} (the pending bytes are {ref_pending!r}; "
             f"decode them with bytes.decode('utf-8', errors='replace'))")
    return got
