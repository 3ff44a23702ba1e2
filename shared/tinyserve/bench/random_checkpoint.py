"""Random-weight checkpoints in Hugging Face format that any engine can load: a
tinyserve preset's shape, or Qwen2.5-0.5B's, with a byte-level tokenizer covering the
whole vocabulary (so every id a random model samples decodes, in every engine).
Written once to a cache folder and reused (``checkpoint_dir``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from tinyserve.host import cache_root


def model_config(shape: str):
    """A tinyserve preset's shape (``small`` for the tests, ``cpu-bench``), or Qwen2.5-0.5B's."""
    from tinyserve.model import MODEL_PRESETS, ModelConfig
    if shape in MODEL_PRESETS:
        return MODEL_PRESETS[shape]
    if shape == "qwen2.5-0.5b-shape":
        return ModelConfig(vocab_size=32000, hidden_size=896, intermediate_size=4864,
                           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
                           model_type="qwen2", qkv_bias=True, tie_word_embeddings=True)
    raise ValueError(f"model: unknown peer shape {shape!r}; choose one of "
                     f"{sorted(MODEL_PRESETS) + ['qwen2.5-0.5b-shape']}")


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE whose ids 0..vocab_size-1 all decode: the 256 bytes, then two-byte
    merges in a fixed order (enough for 65,792 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    if len(vocab) < vocab_size:
        raise ValueError(f"vocab_size: at most {len(vocab)} for a two-byte tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_checkpoint(shape: str, dtype: str, path: Path, seed: int = 0) -> Path:
    """Random weights of ``shape`` in ``dtype`` (tinyserve's seeded init), in Hugging Face
    format with a full-vocabulary tokenizer; kept and reused if already there."""
    from tinyserve.checkpoint import save_pretrained
    from tinyserve.model import LlamaForServing

    if (path / "tokenizer.json").exists():
        return path
    config = model_config(shape)
    net = LlamaForServing.from_seed(config, seed).to(getattr(torch, dtype))
    # Written beside, then renamed into place: a reader (another test worker, a server
    # starting) sees the whole checkpoint or none.
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, ignore_cleanup_errors=True) as tmp:
        save_pretrained(net, tmp)
        byte_level_tokenizer(config.vocab_size).save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.max_position_embeddings}))
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "tokenizer.json").exists():   # not another process's finished copy
                raise
    return path


def checkpoint_dir(shape: str, dtype: str) -> Path:
    return write_checkpoint(shape, dtype, cache_root() / "peer" / f"{shape}-{dtype}")


