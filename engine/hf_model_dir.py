"""Writing a Hugging Face-style model directory from a transformers model (a converted GGUF).

:func:`engine.loader.convert_gguf` loads a GGUF through transformers, then writes what every
model directory has: ``model.safetensors`` (:func:`save_weights`; an LM head tied to the
embedding is not stored twice), ``config.json`` (:func:`save_config`: float32, without the
GGUF's quantization config) and ``generation_config.json`` (:func:`save_generation_config`,
whose eos ids include the tokenizer's). The loader reads eos ids with :func:`token_ids` too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

__all__ = ["WEIGHTS_FILE", "dtype_kwarg", "save_config", "save_generation_config",
           "save_weights", "token_ids"]

WEIGHTS_FILE = "model.safetensors"


def save_weights(model: Any, out_dir: Path) -> None:
    """Save the state dict as one safetensors file, dropping an lm_head tied to the embedding."""
    state = model.state_dict()
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and head is not None and embed is not None and head.data_ptr() == embed.data_ptr():
        del state["lm_head.weight"]
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def save_config(model: Any, out_dir: Path) -> None:
    """Write config.json without the GGUF quantization config, as float32."""
    data = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        data.pop(key, None)
    if not data.get("architectures"):
        data["architectures"] = [type(model).__name__]
    dtype_keys = [key for key in ("dtype", "torch_dtype") if key in data] or [dtype_kwarg()]
    for key in dtype_keys:
        data[key] = "float32"
    text = json.dumps(data, indent=2, sort_keys=True, default=_json_default)
    (out_dir / "config.json").write_text(text + "\n")


def save_generation_config(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Write generation_config.json whose eos ids include the tokenizer's eos token."""
    base = getattr(model, "generation_config", None)
    gen = copy.deepcopy(base) if base is not None else transformers.GenerationConfig()
    ids = token_ids(gen.eos_token_id) | token_ids(tokenizer.eos_token_id)
    if ids:
        gen.eos_token_id = min(ids) if len(ids) == 1 else sorted(ids)
    gen.save_pretrained(out_dir)


def dtype_kwarg() -> str:
    """transformers >= 4.56 calls the dtype argument ``dtype``; older ones ``torch_dtype``."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _json_default(value: Any) -> Any:
    """JSON fallback for config values (dtypes, enums) that ``json`` cannot encode."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return getattr(value, "value", str(value))


def token_ids(value: Any) -> set[int]:
    """Token ids from an ``int``, a list of ints or ``None``."""
    values = value if isinstance(value, list | tuple) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
