"""A checkpoint's own tokenizer (``tokenizer.json``) behind tinyserve's tokenizer interface.

``load_checkpoint_tokenizer(path)`` reads a Hugging Face checkpoint directory
with the ``tokenizers`` library only (no transformers): ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``.
The ``HFTokenizer`` it returns encodes and decodes exactly like transformers'
``PreTrainedTokenizerFast`` loaded from the same directory, renders the chat
template like ``apply_chat_template(..., tokenize=False)``, and streams text
(through ``tinyserve.tokenizer.StreamDetokenizer``) that always adds up to
``decode(ids)`` and never shows half a character.

Streaming needs a model of the tokenizer's *decoder* (tokenizer.json "decoder"),
because ``decode(ids)`` is not always the concatenation of per-token strings:

* byte-level BPE (GPT-2, Llama-3, Qwen): every token is a string over the GPT-2
  byte-to-unicode alphabet, i.e. raw bytes; the text is those bytes decoded as
  UTF-8 with replacement. A character can be split over tokens.
* SentencePiece-style BPE with byte fallback (Llama-2, Mistral): ``▁`` is a
  space, ``<0xNN>`` is one byte, and a Strip (or Metaspace) step drops the space
  that the encoder put in front of the first word. Consecutive byte tokens are
  decoded together, and if any byte of such a run is invalid, every byte of the
  run becomes U+FFFD, so the stream holds a byte run until it ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable, Mapping

from tokenizers import AddedToken, Tokenizer, processors

from tinyserve.chat_template import read_chat_template, render_chat_template
from tinyserve.tokenizer import StreamDetokenizer, check_token_id

# The attributes transformers passes to chat templates (its `special_tokens_map`).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token",
                        "pad_token", "cls_token", "mask_token")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # ByteFallback's "<0xNN>" tokens


# ---- Byte-level alphabet ----------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: every byte gets a printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (control
    characters, space, 0x7F-0xA0, 0xAD) are moved to U+0100 onward, in order,
    so that a token never contains whitespace or an invisible character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    moved = [b for b in range(256) if b not in table]
    for k, b in enumerate(moved):
        table[b] = chr(256 + k)
    return dict(sorted(table.items()))


UNICODE_TO_BYTE = {ch: b for b, ch in bytes_to_unicode().items()}


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (for WordPiece-era tokenizers), verbatim."""
    for old, new in _CLEANUP:
        text = text.replace(old, new)
    return text


_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


# ---- A model of tokenizer.json's "decoder", just enough to stream -----------------------

@dataclass
class DecoderModel:
    """What the decoder does to each token, in order (see module doc).

    ops: per-token string steps, ("replace", old, new) or ("metaspace", mark, drop_first);
    Metaspace drops *every* mark of the first token when its prepend scheme is
    not "never" (that is what tokenizers does), and turns the others into spaces.
    strip: (char, count): Strip after Fuse, up to `count` leading chars of the text.
    """

    byte_level: bool = False
    ops: list[tuple] = field(default_factory=list)
    byte_fallback: bool = False
    strip: tuple[str, int] = (" ", 0)


def _flatten(decoder: dict) -> list[dict]:
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder["decoders"] for d in _flatten(sub)]
    return [decoder]


def parse_decoder(decoder: dict | None) -> DecoderModel:
    """Read tokenizer.json's decoder; ValueError for one whose output cannot be streamed."""
    steps = _flatten(decoder) if decoder else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        return DecoderModel(byte_level=True)
    model, fused = DecoderModel(), False
    for step, kind in zip(steps, kinds):
        # Steps that look at one token must come before Fuse and ByteFallback,
        # which glue tokens together; after that a step sees text we cannot cut.
        per_token_ok = not fused and not model.byte_fallback
        if kind == "Replace" and per_token_ok and "String" in step["pattern"]:
            model.ops.append(("replace", step["pattern"]["String"], step["content"]))
        elif kind == "Metaspace" and per_token_ok:
            scheme = step.get("prepend_scheme") or (
                "always" if step.get("add_prefix_space", True) else "never")
            model.ops.append(("metaspace", step["replacement"], scheme != "never"))
        elif kind == "ByteFallback" and not fused:
            model.byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and step["stop"] == 0 and model.strip[1] == 0:
            model.strip = (step["content"], step["start"])
        else:
            steps = []
    if not steps:  # (no decoder at all joins tokens with spaces)
        raise ValueError(f"tokenizer.json: cannot stream with this decoder: {decoder}")
    return model


# ---- Streams (used by tinyserve.tokenizer.StreamDetokenizer through `stream_decoder()`) ---

class _ByteStream(StreamDetokenizer):
    """Byte-level tokens: StreamDetokenizer's own byte path (only the bytes of an
    unfinished UTF-8 character wait). It is handed nothing but `token_bytes`, so it
    does not ask this tokenizer for a stream decoder again."""

    def __init__(self, tok: "HFTokenizer"):
        super().__init__(SimpleNamespace(token_bytes=tok.token_bytes))


class _PieceStream:
    """SentencePiece-style tokens: text pieces pass at once, a byte run waits until it ends."""

    def __init__(self, tok: "HFTokenizer"):
        self._tok = tok
        self._run = bytearray()
        self._first = True  # no token has reached the decoder yet (specials are skipped first)
        self._strip_char, self._strip_left = tok.decoder_model.strip

    @property
    def pending(self) -> bytes:
        return bytes(self._run)

    def push(self, token_id: int) -> str:
        piece = self._tok.piece(token_id, first=self._first)
        if piece is None:  # skipped: a special token or an id with no token
            return ""
        self._first = False
        if isinstance(piece, int):
            self._run.append(piece)
            return ""
        return self._lstrip(self._end_run() + piece)

    def flush(self) -> str:
        return self._lstrip(self._end_run())

    def _end_run(self) -> str:
        run, self._run = bytes(self._run), bytearray()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:  # ByteFallback: one U+FFFD per byte of a bad run
            return "\ufffd" * len(run)

    def _lstrip(self, text: str) -> str:
        # Strip(start=k) after Fuse: up to k leading strip chars of the whole text.
        n = 0
        while self._strip_left and n < len(text):
            if text[n] != self._strip_char:
                self._strip_left = 0
                break
            n += 1
            self._strip_left -= 1
        return text[n:]


class _CleanupStream:
    """`clean_up_tokenization` applied to a stream, exactly as to the whole text.

    Each replacement pass can change only its input's last (pattern length - 1)
    chars when text is appended, so all passes together change at most the last
    sum(len - 1) = 19 chars of the output: those are held back. The passes are
    re-run on the whole text each push because how `str.replace` pairs up
    overlapping matches depends on everything to the left.
    """

    HOLD = 24

    def __init__(self, inner):
        self._inner, self._raw, self._sent = inner, "", 0

    @property
    def pending(self) -> bytes:
        return self._inner.pending

    def push(self, token_id: int) -> str:
        self._raw += self._inner.push(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        self._raw += self._inner.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        text = clean_up_tokenization(self._raw)
        end = len(text) if final else max(self._sent, len(text) - self.HOLD)
        out, self._sent = text[self._sent:end], end
        return out


# ---- The tokenizer ----------------------------------------------------------------------

def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, Mapping) else token


def named_special_tokens(config: Mapping) -> dict[str, str]:
    """name -> token, as transformers 5 reads them: the usual seven, any other `*_token`
    key holding a token (e.g. image_token), and a dict-form extra_special_tokens."""
    named = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, (str, Mapping))}
    for more in (config.get("extra_special_tokens"), config.get("model_specific_special_tokens")):
        named.update(more if isinstance(more, Mapping) else {})
    order = [*NAMED_SPECIAL_TOKENS, *named]
    return {k: _content(named[k]) for k in dict.fromkeys(order) if _content(named.get(k)) is not None}


def _added_token(token, special: bool) -> AddedToken:
    """`special`: a named special token (bos, eos, ...), which transformers always marks special."""
    if not isinstance(token, Mapping):
        return AddedToken(token, special=special, normalized=not special)
    flags = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in token}
    return AddedToken(token["content"], special=special or bool(token.get("special")), **flags)


class HFTokenizer:
    """tokenizers' `Tokenizer` plus the checkpoint's configs, with ByteBPETokenizer's interface."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping | None = None,
                 generation_config: Mapping | None = None, chat_template: str | None = None):
        """`config`: tokenizer_config.json; `generation_config`: generation_config.json."""
        self._tok = tokenizer
        config = dict(config or {})
        self.decoder_model = parse_decoder(json.loads(tokenizer.to_str()).get("decoder"))
        self._add_config_tokens(config)
        self._tok.no_truncation()  # a prompt must never be cut silently
        self._tok.no_padding()
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

        self.special_tokens_map = named_special_tokens(config)  # also the template's variables
        self._install_post_processor(config)
        added = self._tok.get_added_tokens_decoder()
        self._special_contents = frozenset(t.content for t in added.values() if t.special)
        self.vocab_size = 1 + max(self._tok.get_vocab(with_added_tokens=True).values())

        eos = generation_config.get("eos_token_id") if generation_config else None
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = tuple(dict.fromkeys(
            i for i in [self.eos_token_id, *extra] if i is not None))
        self.chat_template = chat_template
        # HF skips this cleanup for BPE models unless forced (it eats spaces before punctuation).
        force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            type(self._tok.model).__name__ != "BPE" or bool(config.get(force)))
        self._bytes_cache: dict[int, bytes] = {}
        # An upper bound on the characters of text one token covers (the longest token
        # string: a byte-level token has one character per byte, "<0x0A>" covers one).
        # A normalizer may shorten text (NFC composes up to 4 characters into one), so
        # a server allows for that before it rejects a prompt by its length.
        self.max_token_chars = max(1, max(len(t) for t in self._tok.get_vocab(with_added_tokens=True)))

    # -------------------------------------------------------------- loading
    def _add_config_tokens(self, config: Mapping) -> None:
        """Add what tokenizer_config.json declares but tokenizer.json lacks, as transformers does."""
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        declared = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
        wanted = [_added_token(tok, special=False) for _, tok in declared]
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        extras = list(extras) if isinstance(extras, (list, tuple)) else []
        named = [config.get(n, v) for n, v in named_special_tokens(config).items()]
        wanted += [_added_token(tok, special=True) for tok in [*named, *extras]]
        for token in wanted:
            if token.content not in have:
                have.add(token.content)
                add = self._tok.add_special_tokens if token.special else self._tok.add_tokens
                add([token])

    def _install_post_processor(self, config: Mapping) -> None:
        """BOS/EOS come from tokenizer.json's post-processor, as in transformers 5.

        transformers ignores add_bos_token / add_eos_token when a tokenizer.json
        exists; we honour them only when tokenizer.json has no post-processor,
        so a Llama-style checkpoint that says add_bos_token still gets its BOS.
        """
        if self._tok.post_processor is not None:
            return
        parts = [self.bos_token] if config.get("add_bos_token") and self.bos_token else []
        parts += ["$A"] + ([self.eos_token] if config.get("add_eos_token") and self.eos_token else [])
        if len(parts) > 1:
            specials = {t: self._tok.token_to_id(t) for t in parts if t != "$A"}
            self._tok.post_processor = processors.TemplateProcessing(
                single=" ".join(f"{p}:0" for p in parts), special_tokens=list(specials.items()))

    # -------------------------------------------------------------- specials
    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        return None if content is None else self._tok.token_to_id(content)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def is_special(self, token_id: int) -> bool:
        """Whether decode(skip_special_tokens=True) drops it (tokenizers checks the token string)."""
        return self._tok.id_to_token(check_token_id(token_id, self.vocab_size)) in self._special_contents

    def clear_cache(self) -> None:
        """Forget cached work (to time encoding on text as if never seen)."""
        self._bytes_cache.clear()
        getattr(self._tok.model, "_clear_cache", lambda: None)()  # tokenizers' BPE word cache

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, byte_level={self.decoder_model.byte_level})"

    # -------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, with the checkpoint's BOS/EOS when add_special_tokens (like HF's encode).

        Special-token strings inside `text` (e.g. "<|im_end|>") become their ids,
        as in transformers; encode a rendered chat with add_special_tokens=False.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [check_token_id(i, self.vocab_size) for i in ids]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def piece(self, token_id: int, first: bool = False) -> str | int | None:
        """What the decoder makes of one token before tokens are joined.

        None for a token decode skips, an int for a ByteFallback byte, else text.
        `first`: whether it is the first token the decoder sees (Metaspace).
        """
        if self.is_special(token_id):
            return None
        s = self._tok.id_to_token(token_id)
        if s is None:
            return None
        for op, mark, arg in self.decoder_model.ops:  # arg: the replacement, or drop_first
            s = s.replace(mark, arg if op == "replace" else "" if first and arg else " ")
        if self.decoder_model.byte_fallback and (m := _BYTE_PIECE.fullmatch(s)):
            return int(m.group(1), 16)
        return s

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (b"" for special tokens), as if not first."""
        i = check_token_id(token_id, self.vocab_size)
        cached = self._bytes_cache.get(i)
        if cached is None:
            cached = self._bytes_cache[i] = self._token_bytes(i)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        if not self.decoder_model.byte_level:
            p = self.piece(token_id)
            return b"" if p is None else bytes([p]) if isinstance(p, int) else p.encode("utf-8")
        if self.is_special(token_id):
            return b""
        s = self._tok.id_to_token(token_id) or ""
        # tokenizers' ByteLevel decoder: a token with a char outside the alphabet
        # (an added token such as "中文") passes through as its own UTF-8.
        if all(ch in UNICODE_TO_BYTE for ch in s):
            return bytes(UNICODE_TO_BYTE[ch] for ch in s)
        return s.encode("utf-8")

    def stream_decoder(self):
        """A fresh per-request stream state for StreamDetokenizer (push / flush / pending)."""
        inner = _ByteStream(self) if self.decoder_model.byte_level else _PieceStream(self)
        return _CleanupStream(inner) if self.clean_up_tokenization_spaces else inner

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[Mapping], add_generation_prompt: bool = True,
                            tools: list | None = None, documents: list | None = None, **kwargs) -> str:
        """The prompt text, equal to transformers' apply_chat_template(..., tokenize=False).

        Extra keyword arguments become template variables (e.g. enable_thinking).
        """
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat_template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    tools=tools, documents=documents,
                                    **{**self.special_tokens_map, **kwargs})


# ---- Loading a checkpoint directory -----------------------------------------------------

def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_checkpoint_tokenizer(path) -> HFTokenizer | None:
    """The tokenizer a checkpoint directory ships, or None when it has no tokenizer.json."""
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    config = _read_json(directory / "tokenizer_config.json")
    return HFTokenizer(Tokenizer.from_file(str(tokenizer_file)), config,
                       _read_json(directory / "generation_config.json"),
                       read_chat_template(directory, config))
