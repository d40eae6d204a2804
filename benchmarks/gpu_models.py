"""The models ``benchmarks/gpu.py`` measures and the bandwidth floor's arithmetic: their HF
configs (the default checkpoint, the Llama 3.2 1B / 3.1 8B shapes, a tiny CPU model), the
weight and KV bytes a decode step reads, and the floor those bytes put on a step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quickdraft.engine import loader
from quickdraft.engine.models.llama_layers import ModelShape

MODEL_NAMES = ("default", "llama-1b", "llama-8b", "tiny")


# ---------------------------------------------------------------------- models


def llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def model_config(name: str) -> tuple[Any, Path | None]:
    """``(hf_config, model_dir)``; ``model_dir`` None means random weights."""
    if name == "default":
        model_dir = loader.resolve_model(None)
        return loader.load_config(model_dir), model_dir
    if name == "llama-1b":  # Llama 3.2 1B
        return llama_config(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=_llama3_rope(32.0),
            max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
            eos_token_id=128001), None
    if name == "llama-8b":  # Llama 3.1 8B
        return llama_config(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=_llama3_rope(8.0),
            max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
            eos_token_id=128001), None
    if name == "tiny":  # CPU smoke runs
        return llama_config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2), None
    raise ValueError(f"unknown model {name!r}; known: {list(MODEL_NAMES)}")


# ---------------------------------------------------------------------- bytes and floor


def weight_bytes_per_step(shape: ModelShape, itemsize: int) -> dict[str, Any]:
    """Parameters of the model and the bytes of them one decode step reads.

    Every linear layer, norm and bias is read once per step; the LM head is read whole; the
    input embedding only one row per token, so an untied embedding table is left out (a tied
    one is the LM head, counted once)."""
    h, inter, layers = shape.hidden_size, shape.intermediate_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = ((q + 2 * kv) * h + (q + 2 * kv if shape.qkv_bias else 0)  # qkv
                 + q * h + (h if shape.o_bias else 0)  # o
                 + 2 * inter * h + inter * h + (3 * inter + h if shape.mlp_bias else 0)  # mlp
                 + 2 * h)  # two RMSNorms
    lm_head = shape.vocab_size * h
    read = layers * per_layer + h + lm_head  # + final norm
    num_parameters = read + (0 if shape.tie_word_embeddings else shape.vocab_size * h)
    return {"num_parameters": num_parameters, "parameter_bytes": num_parameters * itemsize,
            "num_parameters_per_step": read, "bytes_per_step": read * itemsize,
            "tied_embedding": shape.tie_word_embeddings, "itemsize": itemsize}


def kv_bytes_per_step(shape: ModelShape, batch: int, context: int, width: int,
                      itemsize: int) -> int:
    """K and V bytes a step reads: every sequence's ``context + width`` positions, all
    layers."""
    return (batch * (context + width) * shape.num_layers * 2 * shape.num_kv_heads
            * shape.head_dim * itemsize)


def floor_seconds(weight_bytes: int, kv_bytes: int, bandwidth_gbs: float) -> float:
    return (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)

