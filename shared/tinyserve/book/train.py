"""Train the ``tiny-zh`` model: a few million parameters on the project's own text.

    python -m tinyserve.book.train                  # ~9 minutes on a 2-core CPU
    python -m tinyserve.book.train --minutes 1 --out /tmp/tiny-zh

The corpus is text written for this project (``data/corpus/zh.txt`` and
``en.txt``) plus the markdown prose of the chapter notebooks. It is small
(tens of thousands of tokens), so the model mostly learns to recite it; that
is all a demo needs: streamed output that reads like Chinese instead of the
random tokens of an untrained preset.

The serving forward (``LlamaForServing.forward``) runs over a paged KV cache.
Training needs a plain causal forward over a ``[batch, seq]`` tensor, written
here with the *same* modules and parameters, so the trained weights serve
unchanged (``tests/test_train.py`` checks both give the same logits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyserve.checkpoint import save_pretrained
from tinyserve.model import (MODEL_PRESETS, TRAINED_MODELS, LlamaForServing, ModelConfig,
                             apply_rotary, rotary_cos_sin)
from tinyserve.tokenizer import TOKENIZER_FILE, load_default_tokenizer

DATA_DIR = Path(__file__).parents[1] / "data"


TRAIN_PRESETS = {
    # The `small` shape with a 512-token context: ~3.9M parameters, 7.8 MB in fp16.
    "tiny-zh": replace(MODEL_PRESETS["small"], max_position_embeddings=512),
    # For tests: trains a step in milliseconds.
    "test": ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64),
}


# ---- the training forward -----------------------------------------------------------

def causal_forward(model: LlamaForServing, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, vocab] for token ids [B, S], every position attending to the ones
    before it. Same arithmetic as the serving path, without a KV cache."""
    c = model.config
    b, s = input_ids.shape
    x = model.model.embed_tokens(input_ids)                          # [B, S, H]
    positions = torch.arange(s, device=input_ids.device)
    cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        # apply_rotary wants [T, heads, D] with cos/sin [T, D]: fold the batch into heads.
        q = attn.q_proj(h).view(b, s, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(b, s, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, s, attn.num_kv_heads, attn.head_dim)
        q = apply_rotary(q.transpose(0, 1).reshape(s, -1, attn.head_dim), cos, sin)
        k = apply_rotary(k.transpose(0, 1).reshape(s, -1, attn.head_dim), cos, sin)
        q = q.view(s, b, attn.num_heads, attn.head_dim).permute(1, 2, 0, 3)    # [B, Hq, S, D]
        k = k.view(s, b, attn.num_kv_heads, attn.head_dim).permute(1, 2, 0, 3)
        v = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=attn.num_heads != attn.num_kv_heads)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = layer.post_attention_layernorm(x)
        m = layer.mlp
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return model.lm_head(model.model.norm(x))


def lm_loss(model: LlamaForServing, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a [B, S+1] batch of token ids."""
    logits = causal_forward(model, batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


# ---- data ------------------------------------------------------------------------------

def corpus_texts(include_notebooks: bool = True) -> dict[str, str]:
    """Every training text, by source: the corpus files and (optionally) notebook prose."""
    texts = {f"corpus/{p.name}": p.read_text(encoding="utf-8")
             for p in sorted((DATA_DIR / "corpus").glob("*.txt"))}
    chapters = Path(__file__).resolve().parents[3] / "chapters"
    if include_notebooks and chapters.is_dir():
        for nb in sorted(chapters.glob("*/*.ipynb")):
            cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
            prose = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
            texts[str(nb.relative_to(chapters.parent))] = prose
    return texts


def tokenize(texts: dict[str, str]) -> torch.Tensor:
    """All documents as one stream of ids, each ended by <|eos|>."""
    tok = load_default_tokenizer()
    ids: list[int] = []
    for text in texts.values():
        for para in text.split("\n\n"):          # paragraphs become separate documents
            if para.strip():
                ids += tok.encode(para.strip()) + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def random_batch(data: torch.Tensor, batch_size: int, seq_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    """batch_size random windows of seq_len + 1 consecutive tokens."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])


def lr_at(step: int, done: float, peak: float, warmup: int) -> float:
    """Linear warmup over the first ``warmup`` steps, then cosine decay to 10% of the
    peak as ``done`` (fraction of the training budget used) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


# ---- the loop --------------------------------------------------------------------------

def init_model(config: ModelConfig, seed: int) -> LlamaForServing:
    """GPT-2-style init (std 0.02, smaller on the residual projections)."""
    torch.manual_seed(seed)
    model = LlamaForServing(config)
    std = 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0, std / math.sqrt(2 * config.num_hidden_layers))
            else:
                p.normal_(0, std)
    return model


def train(config: ModelConfig, data: torch.Tensor, seconds: float, seed: int = 0,
          batch_size: int = 16, seq_len: int = 128, lr: float = 3e-3,
          max_steps: int | None = None, log_every: int = 50, log=print) -> tuple[LlamaForServing, dict]:
    """Train for ``seconds`` of wall time (or ``max_steps``); return the model and a summary."""
    seq_len = min(seq_len, config.max_position_embeddings, len(data) - 2)
    model = init_model(config, seed).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)

    # The schedule runs on the fraction of the budget used, wall time or steps, so a
    # busy machine trains fewer steps but still warms up, decays and stops on time.
    start = time.perf_counter()
    warmup = 20
    step, losses = 0, []
    while True:
        elapsed = time.perf_counter() - start
        done = step / max_steps if max_steps is not None else elapsed / max(seconds, 1e-9)
        if done >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, done, lr, warmup)
        loss = lm_loss(model, random_batch(data, batch_size, seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            log(f"step {step:5d}  loss {recent:.3f}  lr {opt.param_groups[0]['lr']:.2e}"
                f"  {time.perf_counter() - start:6.1f} s / {seconds:.0f} s")
    tail = losses[-min(log_every, len(losses)):]
    summary = {"steps": step, "final_loss": round(sum(tail) / max(1, len(tail)), 4),
               "first_loss": round(losses[0], 4), "train_seconds": round(time.perf_counter() - start, 1),
               "batch_size": batch_size, "seq_len": seq_len, "peak_lr": lr, "seed": seed}
    return model.eval(), summary


def save(model: LlamaForServing, out: Path, summary: dict, dtype=torch.float16) -> Path:
    """Weights in fp16 (half the bytes; loading casts them back into fp32 modules)."""
    out = Path(out)
    tokenizer = load_default_tokenizer()
    save_pretrained(model.to(dtype), out, tokenizer)
    model.float()
    # A checkpoint elsewhere carries its tokenizer. The shipped ones (data/tiny-zh) read
    # the package's own vocabulary instead, data/tokenizer.json (load_tokenizer's
    # fallback for a directory without one): a second copy in the package would be
    # byte-identical, and could drift from the first.
    if out.resolve() not in {p.resolve() for p in TRAINED_MODELS.values()}:
        tokenizer.save(out / TOKENIZER_FILE)
    (out / "training.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-zh", choices=sorted(TRAIN_PRESETS))
    ap.add_argument("--minutes", type=float, default=9.0)
    ap.add_argument("--out", default=str(TRAINED_MODELS["tiny-zh"]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-notebooks", action="store_true", help="train on data/corpus only")
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else os.cpu_count() or 1))
    texts = corpus_texts(include_notebooks=not args.no_notebooks)
    data = tokenize(texts)
    config = TRAIN_PRESETS[args.preset]
    print(f"corpus: {len(texts)} sources, {sum(map(len, texts.values()))} characters, "
          f"{len(data)} tokens; model: {config.num_parameters() / 1e6:.2f}M parameters; "
          f"{torch.get_num_threads()} threads", flush=True)
    model, summary = train(config, data, args.minutes * 60, seed=args.seed,
                           batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           log=lambda msg: print(msg, flush=True))
    summary.update({
        "preset": args.preset, "num_parameters": config.num_parameters(),
        "corpus_sources": sorted(texts), "corpus_characters": sum(map(len, texts.values())),
        "corpus_tokens": len(data), "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__, "python": platform.python_version(),
    })
    out = save(model, Path(args.out), summary)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 2**20:.1f} MiB): final loss {summary['final_loss']}")


if __name__ == "__main__":
    main()
