"""Train the shipped vocabulary: `python -m tinyserve.book.build_tokenizer`.

Reads every data/corpus/*.txt (sorted by name), trains a 2048-id byte-level
BPE, and writes data/tokenizer.json. Deterministic: the same corpus always
gives a byte-identical file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tinyserve.tokenizer import ByteBPETokenizer

DATA_DIR = Path(__file__).parents[1] / "data"
DEFAULT_VOCAB_SIZE = 2048


def read_corpus(corpus_dir: Path) -> dict[str, str]:
    """File name -> text, in sorted order so training never depends on the file system."""
    files = sorted(Path(corpus_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in {corpus_dir}")
    return {f.name: f.read_text(encoding="utf-8") for f in files}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=DATA_DIR / "corpus")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DATA_DIR / "tokenizer.json")
    args = parser.parse_args(argv)

    corpus = read_corpus(args.corpus)
    start = time.perf_counter()
    tok = ByteBPETokenizer.train(list(corpus.values()), args.vocab_size)
    seconds = time.perf_counter() - start
    tok.save(args.out)

    print(f"trained {tok.vocab_size} ids ({len(tok.merges)} merges) in {seconds:.2f} s -> {args.out}")
    for name, text in corpus.items():
        n_bytes = len(text.encode("utf-8"))
        n_tokens = len(tok.encode(text))
        print(f"  {name}: {n_bytes} bytes -> {n_tokens} tokens ({n_bytes / n_tokens:.2f} bytes/token)")


if __name__ == "__main__":
    main()
