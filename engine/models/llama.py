"""Our own Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style, Qwen2) over a paged KV cache.

The whole step is one flat batch of ``num_tokens`` tokens from many sequences; only attention
needs to know which sequence a token belongs to, and it learns that from ``AttentionMetadata``.
q/k/v and gate/up projections are fused into one matmul each; the op order of every numerically
relevant piece (RMSNorm, RoPE, residuals) follows HF transformers so fp32 results agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rope import RotaryEmbedding, apply_rotary
from kernels.paged_attention_ref import AttentionMetadata


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a config that the runtime needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, backend: ModuleType) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_weight = _param(qkv_rows, shape.hidden_size, dtype=dtype)
        self.qkv_bias = _param(qkv_rows, dtype=dtype) if shape.qkv_bias else None
        self.o_weight = _param(shape.hidden_size, self.q_size, dtype=dtype)
        self.o_bias = _param(shape.hidden_size, dtype=dtype) if shape.o_bias else None
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [num_tokens, q + 2 kv]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are adjacent columns: rotate both heads sets in one pass
        qk = apply_rotary(qk.view(-1, self.heads + self.kv_heads, self.head_dim), *cos_sin)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        self.backend.write_kv(k, v.view(-1, self.kv_heads, self.head_dim), kv_cache,
                              meta.slot_mapping)
        out = self.backend.paged_attention(q, kv_cache, meta, self.scale)  # [T, H, D]
        return F.linear(out.reshape(-1, self.q_size), self.o_weight, self.o_bias)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        super().__init__()
        inter = shape.intermediate_size
        self.gate_up_weight = _param(2 * inter, shape.hidden_size, dtype=dtype)
        self.gate_up_bias = _param(2 * inter, dtype=dtype) if shape.mlp_bias else None
        self.down_weight = _param(shape.hidden_size, inter, dtype=dtype)
        self.down_bias = _param(shape.hidden_size, dtype=dtype) if shape.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_weight, self.down_bias)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, backend: ModuleType) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.self_attn = Attention(shape, dtype, backend)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.mlp = MLP(shape, dtype)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; logits only where asked."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int,
                 backend: ModuleType) -> None:
        super().__init__()
        self.shape = shape = ModelShape.from_config(config)
        self.dtype = dtype
        self.embed_tokens = _param(shape.vocab_size, shape.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(shape, dtype, backend) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.lm_head = (self.embed_tokens if shape.tie_word_embeddings
                        else _param(shape.vocab_size, shape.hidden_size, dtype=dtype))
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rotary.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return F.linear(hidden, self.lm_head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            target, rows = _map_weight(name, self.shape)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            dest = params[target].data
            if rows is not None:
                dest = dest[rows[0] : rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            rows_filled[target] += dest.shape[0]
        missing = [n for n, filled in rows_filled.items() if filled != params[n].shape[0]]
        if missing:
            raise ValueError(f"weights missing for {missing[:5]}")


def _slices(shape: ModelShape) -> dict[str, tuple[str, tuple[int, int]]]:
    q, kv, inter = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up", (inter, 2 * inter)),
    }


def _map_weight(name: str, shape: ModelShape) -> tuple[str | None, tuple[int, int] | None]:
    """HF tensor name -> (our parameter name, row range inside a fused parameter)."""
    if "rotary_emb" in name:
        return None, None
    if name == "lm_head.weight":
        return (None, None) if shape.tie_word_embeddings else ("lm_head", None)
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "norm.weight"):
        return name.removesuffix(".weight") if name.startswith("embed") else name, None
    rest = name.removeprefix("layers.")  # "N.self_attn.q_proj.weight"
    index, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")  # "self_attn.q_proj", "weight"
    base = f"layers.{index}."
    if module in _slices(shape):
        target, rows = _slices(shape)[module]
        return f"{base}{target}_{kind}", rows
    if module in ("self_attn.o_proj", "mlp.down_proj"):
        return f"{base}{module.replace('_proj', '')}_{kind}", None
    return f"{base}{rest}", None
