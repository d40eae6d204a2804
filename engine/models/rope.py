"""Rotary position embeddings with the scaling variants found in Llama/Mistral/Qwen2 configs.

``inv_freq`` and the cos/sin table are always computed in float32 (as HF does), then cast to
the model dtype when applied; casting the frequencies themselves would change greedy output.
Supported ``rope_type``: default, linear, dynamic (static within ``max_position_embeddings``,
where HF's dynamic NTK equals the default), llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3", "yarn"})


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a HF config, for transformers 5 (`rope_parameters`) or 4."""
    params = getattr(config, "rope_parameters", None)
    if params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type", out.get("type", "default"))
    if out["rope_type"] in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return out


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(p: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, orig = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention)


def compute_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_scaling)`` for a HF config."""
    p = rope_parameters(config)
    rope_type = p["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: "
                         f"{sorted(SUPPORTED_ROPE_TYPES)}")
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    if rope_type in ("default", "dynamic"):
        return _default_inv_freq(p["rope_theta"], dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(p["rope_theta"], dim) / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(p, dim), 1.0
    return _yarn_inv_freq(p, dim, config.max_position_embeddings)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin per position; applied to q and k in the neox (rotate-half) layout."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, dim]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[num_tokens, 1, head_dim]``, shared by all layers of a step.
        (Gathered as embeddings, the same rows: once a model step has evicted the
        dispatcher's code, ``table[positions]`` took ~64 us for both and this ~36 us on the
        AVX2-only Zen 4.)"""
        return (F.embedding(positions, self.cos).unsqueeze(1),
                F.embedding(positions, self.sin).unsqueeze(1))
