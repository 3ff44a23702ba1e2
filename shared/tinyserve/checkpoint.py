"""Hugging Face checkpoints in and out: ``config.json`` <-> ``ModelConfig``, and
safetensors files streamed into an already-allocated ``LlamaForServing``
(``load_pretrained``), or written from one (``save_pretrained``).

A directory as downloaded from the Hub holds ``config.json`` and either one
``model.safetensors`` or shards ``model-0000k-of-0000n.safetensors`` listed in
``model.safetensors.index.json``. The families read here (Llama 2/3, Mistral,
Qwen2/2.5, Qwen3) share the Llama layer names, so a tensor goes to the parameter
of the same name; what differs is a handful of config flags, read by
``config_from_hf`` from the fields transformers writes (``LlamaConfig``,
``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``; both the transformers-4
``rope_theta``/``rope_scaling``/``torch_dtype`` and the transformers-5
``rope_parameters``/``dtype`` spellings).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from tinyserve.model import Llama3RopeScaling, LlamaForServing, ModelConfig

# model_type in config.json -> the transformers class that writes it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


# ---- config.json -> ModelConfig ---------------------------------------------------------

def read_config(path: str | Path) -> ModelConfig:
    return config_from_hf(read_raw_config(path))


def read_raw_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def saved_dtype(path: str | Path) -> str:
    """The dtype the weights were saved in ("bfloat16", ...), for ``dtype="auto"``."""
    raw = read_raw_config(path)
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")


def model_type_of(raw: dict) -> str:
    """The family, from ``model_type`` (or the class in ``architectures``); refuses others."""
    by_class = {cls: kind for kind, cls in ARCHITECTURES.items()}
    kind = raw.get("model_type") or next(
        (by_class.get(a, a) for a in raw.get("architectures") or []), "llama")
    if kind not in ARCHITECTURES:
        classes = ", ".join(raw.get("architectures") or [])
        named = f"{kind!r}" + (f" ({classes})" if classes else "")
        raise ValueError(f"model: architecture {named} is not supported; "
                         f"supported model_types: {sorted(ARCHITECTURES)}")
    return kind


def rope_settings(raw: dict) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and the llama3 scaling, if any. transformers 5 writes both into
    ``rope_parameters``; older configs write ``rope_theta`` and ``rope_scaling``."""
    new = raw.get("rope_parameters") or {}
    params = {**(raw.get("rope_scaling") or {}), **new}
    theta = float(new.get("rope_theta") or raw.get("rope_theta") or params.get("rope_theta")
                  or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("model: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        original = params.get("original_max_position_embeddings", raw["max_position_embeddings"])
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original))
    raise ValueError(f"model: rope_type {kind!r} is not supported; "
                     "supported: ['default', 'llama3']")


def sliding_window_of(raw: dict, kind: str) -> int | None:
    """The attention window, if the config really uses one (Qwen only with
    ``use_sliding_window``; Mistral 7B v0.1 always: 4096)."""
    if kind in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    layer_types = raw.get("layer_types")
    if layer_types and all(t == "full_attention" for t in layer_types):
        return None
    return raw.get("sliding_window")


def context_length(raw: dict, kind: str) -> int:
    """max_position_embeddings, capped at the sliding window: we attend over the whole
    context, which is exactly sliding-window attention while a sequence fits the window."""
    context = raw["max_position_embeddings"]
    window = sliding_window_of(raw, kind)
    if window is not None and window < context:
        warnings.warn(f"model: sliding-window attention ({window} tokens) is not implemented; "
                      f"the context is capped at {window} tokens (max_position_embeddings "
                      f"{context}), where it equals full attention", stacklevel=3)
        return window
    return context


def biases(raw: dict, kind: str) -> dict[str, bool]:
    """Which projections carry a bias: Qwen2 always has one on q, k, v (not on o);
    Llama/Qwen3's ``attention_bias`` puts one on all four."""
    if kind == "qwen2":
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    attention = bool(raw.get("attention_bias", False))
    return {"qkv_bias": attention, "o_bias": attention,
            "mlp_bias": bool(raw.get("mlp_bias", False)) if kind == "llama" else False}


def config_from_hf(raw: dict) -> ModelConfig:
    kind = model_type_of(raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = rope_settings(raw)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        max_position_embeddings=context_length(raw, kind),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        model_type=kind, explicit_head_dim=None if head_dim * heads == hidden else head_dim,
        qk_norm=kind == "qwen3", tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        **biases(raw, kind))


# ---- ModelConfig -> config.json ----------------------------------------------------------

def hf_config(c: ModelConfig, bos, eos, dtype: torch.dtype) -> dict:
    """What transformers needs to rebuild the model (``AutoModelForCausalLM``)."""
    config = {
        "architectures": [ARCHITECTURES[c.model_type]], "model_type": c.model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "hidden_act": "silu", "attention_bias": c.o_bias, "mlp_bias": c.mlp_bias,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": bos, "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if c.rope_scaling is not None:
        s = c.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    return config


# ---- a whole model in and out ----------------------------------------------------------

def save_pretrained(model: LlamaForServing, path: str | Path, tokenizer=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in Hugging Face format (Llama for
    our presets); the special ids come from ``tokenizer`` when given, else the config."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    bos, eos = ((tokenizer.bos_token_id, tokenizer.eos_token_id) if tokenizer is not None
                else (c.bos_token_id, c.eos_token_id))
    config = hf_config(c, bos, eos, model.lm_head.weight.dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        del tensors["lm_head.weight"]         # the same tensor as the embedding
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> LlamaForServing:
    """A checkpoint directory (Llama, Mistral, Qwen2, Qwen3) as a model in eval mode.

    The module is built on the meta device (shapes only: no memory), allocated
    once in ``dtype`` on ``device``, then filled tensor by tensor from the
    safetensors files: never a random-init copy next to the checkpoint's."""
    config = read_config(path)
    with torch.device("meta"):
        model = LlamaForServing(config)
    allocate_parameters(model, dtype, device)
    load_weights(model, path)
    return model.eval()


# ---- safetensors -> parameters -----------------------------------------------------------

def allocate_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give each (meta) parameter uninitialised memory in ``dtype`` on ``device``, keeping
    tied ones tied. Like ``Module.to_empty``, whose empty_like of a meta tensor imports
    sympy (~0.3 s, ~35 MB)."""
    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in allocated:
                allocated[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device))
            setattr(module, name, allocated[id(p)])


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of the index, or the one file."""
    path = Path(path)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / WEIGHTS_FILE).exists():
        return [path / WEIGHTS_FILE]
    raise ValueError(f"model: {path} has no {WEIGHTS_FILE} or {INDEX_FILE} "
                     "(only safetensors checkpoints are read)")


def open_safetensors(file: Path):
    """Read with pread(2) where safetensors offers it: with the default mmap every
    page read stays mapped (and counted resident) until the file is closed."""
    from safetensors import safe_open
    try:
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:                         # safetensors < 0.8: mmap only
        return safe_open(str(file), framework="pt")


def skipped(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that are not parameters here."""
    return (name.endswith("rotary_emb.inv_freq")          # old Llama checkpoints: recomputed
            or (name == "lm_head.weight" and config.tie_word_embeddings))


@torch.no_grad()
def load_weights(model: LlamaForServing, path: str | Path) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same name, one at
    a time (cast to the parameter's dtype and device); every parameter must be found."""
    params = dict(model.named_parameters())   # a tied lm_head is embed_tokens: listed once
    missing = set(params)
    for file in weight_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name not in params:
                    if skipped(name, model.config):
                        continue
                    raise ValueError(f"model: {file.name} holds {name!r}, which a "
                                     f"{model.config.model_type} model does not have")
                tensor = f.get_tensor(name)
                if tensor.shape != params[name].shape:
                    raise ValueError(f"model: {name} is {tuple(tensor.shape)} in {file.name}, "
                                     f"expected {tuple(params[name].shape)}")
                params[name].copy_(tensor)
                missing.discard(name)
                del tensor
    if missing:
        raise ValueError(f"model: {path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
