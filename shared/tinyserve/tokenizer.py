"""Byte-level BPE tokenizer and a streaming detokenizer.

Text becomes UTF-8 bytes, and ids 0..255 are exactly those bytes, so every
string can be encoded and no token is ever "unknown". Training learns merges:
each merge glues the most frequent adjacent pair of ids into one new id
(256, 257, ... in the order they were learned). Special tokens such as
"<|eos|>" take the last ids; encode() never produces them from text.

Merges never cross the chunks produced by a regex pre-split (a run of
Chinese characters, a word, up to 3 digits, punctuation, whitespace), so a
token is always part of one "word".
"""

from __future__ import annotations

import functools
import heapq
import json
import operator
import re
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

DEFAULT_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")

# CJK ideographs (extension A, the main block, compatibility ideographs).
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"

# Every character falls into exactly one branch, so the chunks always join
# back to the original text. Runs are capped at 32 characters because BPE on
# one chunk costs about (merges applied x chunk length): a 20,000-character
# line of Chinese without punctuation must not take seconds to encode.
SPLIT_PATTERN = (
    rf" ?[{_CJK}]{{1,32}}"  # a run of Chinese: lets 2-3 character words merge
    rf"| ?[^\W\d_{_CJK}]{{1,32}}"  # a run of other letters, with its leading space
    r"|\d{1,3}"  # numbers in groups of at most 3 digits
    r"| ?(?:[^\s\w]|_){1,32}"  # punctuation, symbols, emoji
    r"|\s+(?!\S)|\s+"  # whitespace; the last space before a word joins the word
)

# Bounded work per chunk and a bounded cache. Only whitespace runs are uncapped in the
# pattern above (a 10 MB run of spaces is one chunk): BPE works on pieces of at most
# MAX_CHUNK_CHARS characters of a chunk (the shipped vocabulary has no whitespace merges,
# so this changes no ids), and only chunks of at most CACHED_CHUNK_CHARS characters are
# cached, at most CACHE_ENTRIES of them: about 1 KB each at worst, so ~16 MB in all.
MAX_CHUNK_CHARS = 64
CACHED_CHUNK_CHARS = 32
CACHE_ENTRIES = 1 << 14

_FORMAT = "tinyserve-byte-bpe"
_FORMAT_VERSION = 1
# The name of this tokenizer's file inside a checkpoint directory (``LLM.save_pretrained``).
TOKENIZER_FILE = "tinyserve_tokenizer.json"


def check_token_id(token_id, vocab_size: int) -> int:
    """``token_id`` as an int, or a TypeError (not an integer) / ValueError (outside
    ``[0, vocab_size)``) naming it: what every tokenizer's decode checks first."""
    try:
        i = operator.index(token_id)
    except TypeError:
        raise TypeError(f"token id must be an int, got {type(token_id).__name__}") from None
    if not 0 <= i < vocab_size:
        raise ValueError(f"token id {i} is out of range [0, {vocab_size})")
    return i


def _merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of `pair`, left to right."""
    a, b = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class _PairCounts:
    """Training state: every distinct chunk ("word") as ids, and how often each
    adjacent pair occurs, weighted by how often its word does.

    Works on distinct chunks weighted by their frequency rather than on the raw
    text, and keeps `where` (pair -> indices of the words containing it) so that
    a merge re-counts only the words it touches.
    """

    def __init__(self, texts: list[str], pattern: str):
        split = re.compile(pattern)
        chunk_counts = Counter(c for t in texts for c in split.findall(t))
        self.words = [list(c.encode("utf-8")) for c in chunk_counts]
        self.freqs = list(chunk_counts.values())

        self.pair_counts: dict[tuple[int, int], int] = defaultdict(int)
        self.where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> word indices
        for w, ids in enumerate(self.words):
            for pair in zip(ids, ids[1:]):
                self.pair_counts[pair] += self.freqs[w]
                self.where[pair].add(w)

        # Max-heap with lazy deletion: an entry is valid only while its count
        # still equals the live count; stale entries are skipped when popped.
        self.heap = [(-c, pair) for pair, c in self.pair_counts.items()]
        heapq.heapify(self.heap)

    def pop_most_frequent(self) -> tuple[int, int] | None:
        """The most frequent pair (the smaller one on a tie), or None when none is left."""
        while self.heap:
            neg, pair = heapq.heappop(self.heap)
            if self.pair_counts.get(pair) == -neg:
                return pair
        return None

    def merge(self, best: tuple[int, int], new_id: int) -> None:
        """Glue `best` into `new_id` in every word that has it, and update the counts."""
        pair_counts, where, words, freqs = self.pair_counts, self.where, self.words, self.freqs
        # Only the words containing `best` change: re-count just their pairs.
        changed = set()
        for w in sorted(where.pop(best)):
            old = words[w]
            new = _merge_pair(old, best, new_id)
            f = freqs[w]
            for pair in zip(old, old[1:]):
                pair_counts[pair] -= f
                changed.add(pair)
            for pair in zip(new, new[1:]):
                pair_counts[pair] += f
                changed.add(pair)
                where[pair].add(w)
            words[w] = new
        for pair in changed:
            c = pair_counts[pair]
            if c > 0:
                heapq.heappush(self.heap, (-c, pair))
            else:
                del pair_counts[pair]
                where.pop(pair, None)


class ByteBPETokenizer:
    """A byte-level BPE tokenizer: `merges[k] = (a, b)` creates id `256 + k`."""

    def __init__(
        self,
        merges: Iterable[tuple[int, int]],
        special_tokens: Iterable[str] = DEFAULT_SPECIAL_TOKENS,
        pattern: str = SPLIT_PATTERN,
    ):
        self.merges = [(int(a), int(b)) for a, b in merges]
        self.pattern = pattern
        self._split = re.compile(pattern)

        vocab = [bytes([i]) for i in range(256)]
        self._ranks: dict[tuple[int, int], int] = {}
        for k, pair in enumerate(self.merges):
            new_id = 256 + k
            if not all(0 <= i < new_id for i in pair):
                raise ValueError(f"merge {k} {pair} uses an id that does not exist yet")
            if pair in self._ranks:
                raise ValueError(f"merge {k} {pair} is a duplicate")
            self._ranks[pair] = new_id
            vocab.append(vocab[pair[0]] + vocab[pair[1]])

        names = list(special_tokens)
        if len(set(names)) != len(names):
            raise ValueError(f"special tokens must be distinct, got {names}")
        first = len(vocab)
        self.special_tokens = {name: first + i for i, name in enumerate(names)}
        self._special_names = {i: name for name, i in self.special_tokens.items()}
        # Special tokens have no bytes: they mark structure, they are not text.
        self._vocab = vocab + [b""] * len(names)
        self.vocab_size = len(self._vocab)

        # Per-instance cache: real text repeats the same chunks over and over.
        self._encode_chunk = functools.lru_cache(maxsize=CACHE_ENTRIES)(self._bpe_chunk)
        # At most this many characters of text become one token (its bytes bound them):
        # a text of n characters has at least n / max_token_chars tokens, which a server
        # checks before tokenizing.
        self.max_token_chars = max(1, max(len(b) for b in vocab))

    def clear_cache(self) -> None:
        """Forget encoded chunks (to time encoding on text as if never seen)."""
        self._encode_chunk.cache_clear()

    def __repr__(self) -> str:
        return f"ByteBPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)})"

    # ----------------------------------------------------------------- specials
    @property
    def bos_token_id(self) -> int | None:
        return self.special_tokens.get("<|bos|>")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_tokens.get("<|eos|>")

    @property
    def pad_token_id(self) -> int | None:
        return self.special_tokens.get("<|pad|>")

    def is_special(self, token_id: int) -> bool:
        return check_token_id(token_id, self.vocab_size) in self._special_names

    # ------------------------------------------------------------------ encode
    def _bpe_chunk(self, chunk: str) -> tuple[int, ...]:
        ids = list(chunk.encode("utf-8"))
        ranks = self._ranks
        never = len(ranks) + 256  # larger than any real rank
        while len(ids) > 1:
            # Apply merges in the order they were learned: lowest new id first.
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, never))
            new_id = ranks.get(pair)
            if new_id is None:
                break
            ids = _merge_pair(ids, pair, new_id)
        return tuple(ids)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids. "<|eos|>" inside `text` is plain text, never the special id."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        ids = []
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no <|bos|> token")
            ids.append(self.bos_token_id)
        for match in self._split.finditer(text):
            chunk = match.group()
            if len(chunk) <= CACHED_CHUNK_CHARS:
                ids.extend(self._encode_chunk(chunk))
            else:               # rare and maybe huge: bounded pieces, never cached
                for start in range(0, len(chunk), MAX_CHUNK_CHARS):
                    ids.extend(self._bpe_chunk(chunk[start:start + MAX_CHUNK_CHARS]))
        return ids

    # ------------------------------------------------------------------ decode
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for special tokens)."""
        return self._vocab[check_token_id(token_id, self.vocab_size)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; bytes that are not valid UTF-8 become U+FFFD."""
        if skip_special_tokens:
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        parts, run = [], []
        for i in ids:
            i = check_token_id(i, self.vocab_size)
            if i in self._special_names:
                parts.append(b"".join(run).decode("utf-8", errors="replace"))
                parts.append(self._special_names[i])
                run = []
            else:
                run.append(self._vocab[i])
        parts.append(b"".join(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    # ------------------------------------------------------------------- train
    @classmethod
    def train(
        cls,
        texts: list[str],
        vocab_size: int,
        special_tokens: Iterable[str] = DEFAULT_SPECIAL_TOKENS,
        pattern: str = SPLIT_PATTERN,
    ) -> "ByteBPETokenizer":
        """Learn `vocab_size - 256 - len(special_tokens)` merges from `texts`.

        Deterministic: ties between equally frequent pairs go to the smaller
        (a, b). If the texts run out of pairs first, training stops early
        (with a warning) and the vocabulary is smaller than asked.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("train() expects a list of str")
        special_tokens = tuple(special_tokens)
        smallest = 256 + len(special_tokens)
        if vocab_size < smallest:
            raise ValueError(
                f"vocab_size must be at least {smallest} (256 bytes + "
                f"{len(special_tokens)} special tokens), got {vocab_size}"
            )
        num_merges = vocab_size - smallest

        counts = _PairCounts(texts, pattern)
        merges: list[tuple[int, int]] = []
        while len(merges) < num_merges:
            best = counts.pop_most_frequent()
            if best is None:
                warnings.warn(
                    f"training text has only enough pairs for {len(merges)} merges; "
                    f"vocab_size will be {smallest + len(merges)}, not {vocab_size}"
                )
                break
            new_id = 256 + len(merges)
            merges.append(best)
            counts.merge(best, new_id)

        return cls(merges, special_tokens, pattern)

    # ------------------------------------------------------------- save / load
    def save(self, path) -> None:
        """Write JSON. One merge per line, plus each learned token as text for reading."""
        dump = functools.partial(json.dumps, ensure_ascii=False)
        learned = [self._vocab[256 + k].decode("utf-8", errors="backslashreplace")
                   for k in range(len(self.merges))]
        lines = [
            "{",
            f'  "format": {dump(_FORMAT)},',
            f'  "version": {_FORMAT_VERSION},',
            f'  "pattern": {dump(self.pattern)},',
            f'  "special_tokens": {dump(self.special_tokens)},',
            '  "merges": [',
            ",\n".join(f"    [{a}, {b}]" for a, b in self.merges),
            "  ],",
            '  "tokens_256_onward": [',
            ",\n".join(f"    {dump(t)}" for t in learned),
            "  ]",
            "}",
        ]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path) -> "ByteBPETokenizer":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT or data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"{path} is not a {_FORMAT} v{_FORMAT_VERSION} file")
        merges = [tuple(m) for m in data["merges"]]
        specials = sorted(data["special_tokens"].items(), key=lambda kv: kv[1])
        tok = cls(merges, [name for name, _ in specials], data["pattern"])
        if tok.special_tokens != dict(specials):
            raise ValueError(f"{path}: special token ids must directly follow the merges")
        return tok


@functools.lru_cache(maxsize=None)
def load_default_tokenizer() -> ByteBPETokenizer:
    """The vocabulary shipped with the package (2048 ids), loaded once."""
    return ByteBPETokenizer.load(Path(__file__).parent / "data" / "tokenizer.json")


# ---------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------

def utf8_lead_info(b: int) -> tuple[int, int, int]:
    """(sequence length, lowest, highest allowed second byte) for a UTF-8 lead byte.

    Length 0 means `b` cannot start a multi-byte character. The narrower
    second-byte ranges rule out overlong forms, surrogates and code points
    above U+10FFFF, exactly like Python's decoder.
    """
    if 0xC2 <= b <= 0xDF:
        return 2, 0x80, 0xBF
    if b == 0xE0:
        return 3, 0xA0, 0xBF
    if b == 0xED:
        return 3, 0x80, 0x9F
    if 0xE1 <= b <= 0xEF:
        return 3, 0x80, 0xBF
    if b == 0xF0:
        return 4, 0x90, 0xBF
    if 0xF1 <= b <= 0xF3:
        return 4, 0x80, 0xBF
    if b == 0xF4:
        return 4, 0x80, 0x8F
    return 0, 0, 0


def _pending_start(data: bytes) -> int:
    """Where an unfinished-but-still-possible character starts at the end of `data`.

    Returns len(data) when nothing needs to wait. Everything before the
    returned index is settled: decoding it alone gives the same text as
    decoding it together with whatever bytes come later.
    """
    n = len(data)
    # An unfinished character is a lead byte plus at most 2 continuation bytes.
    for start in range(n - 1, max(n - 4, -1), -1):
        if not 0x80 <= data[start] <= 0xBF:
            break
    else:
        return n
    need, lo, hi = utf8_lead_info(data[start])
    have = n - start
    if have >= need:  # ASCII, invalid lead, or already long enough: settled
        return n
    if have >= 2 and not lo <= data[start + 1] <= hi:
        return n  # a wrong second byte: can never become valid
    return start


class StreamDetokenizer:
    """Turn generated ids into text one token at a time, never splitting a character.

    A Chinese character (3 bytes) or an emoji (4 bytes) may be spread over
    several tokens, so the last few bytes may have to wait. Bytes that can
    never form a valid character are replaced by U+FFFD at once, matching
    bytes.decode("utf-8", errors="replace"), so for any ids:
        "".join(det.push(i) for i in ids) + det.flush() == tok.decode(ids)

    A tokenizer whose text is not just its tokens' bytes joined (a checkpoint's
    own, see tinyserve.hf_tokenizer) provides `stream_decoder()`: an object with
    push(id) -> str, flush() -> str and .pending, which then does the work.
    """

    def __init__(self, tokenizer: ByteBPETokenizer):
        self.tokenizer = tokenizer
        self._pending = b""  # at most 3 bytes of an unfinished character
        self._pieces: list[str] = []
        make = getattr(tokenizer, "stream_decoder", None)
        self._custom = make() if make is not None else None

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became printable (maybe "")."""
        if self._custom is not None:
            return self._keep(self._custom.push(token_id))
        data = self._pending + self.tokenizer.token_bytes(token_id)
        cut = _pending_start(data)
        self._pending = data[cut:]
        piece = data[:cut].decode("utf-8", errors="replace")
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """End of stream: return the rest (an unfinished character becomes U+FFFD)."""
        if self._custom is not None:
            return self._keep(self._custom.flush())
        piece = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished character still waiting for the next token."""
        return self._custom.pending if self._custom is not None else self._pending

    def _keep(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)
