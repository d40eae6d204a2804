"""The layers of our Llama-family decoder (:mod:`engine.models.llama`): the config numbers the
runtime needs (:class:`ModelShape`), the small per-layer ops (torch references or fused CPU
kernels), and the modules of one decoder layer: :class:`Linear` with its batch-invariant
fast paths and 4-bit copies, :class:`RMSNorm`, :class:`Attention` over the paged KV cache,
:class:`MLP`, and :class:`DecoderLayer`, which runs in one native call where it can.

Shapes are per step: ``[num_tokens, ...]`` over the flat batch of every sequence's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.engine.models.llama_weights import (
    FourBitWeight,
    StackedWeight,
    four_bit_linear,
    native_parts,
)
from quickdraft.kernels import cpu_fused, cpu_layer, cpu_q4q8, torch_ops
from quickdraft.kernels.attention_metadata import AttentionMetadata
from quickdraft.kernels.cpu_int4 import Int4Weight
from quickdraft.kernels.cpu_q4q8 import Q6Q8Weight, Q8Q8Weight


@dataclass(frozen=True)
class LayerOps:
    """The small per-layer ops: the torch references (HF op order, used for fp32 and as the
    fallback) or the fused CPU kernels, which are bit-equal to them in bf16 (RMSNorm: up to
    its summation order, fixed in the kernel, per CPU kind in torch; see kernels/cpu_fused)."""

    rms_norm: Any  # (x, weight, eps) -> y
    add_rms_norm: Any  # (x, residual, weight, eps) -> (y, x + residual)
    rope: Any  # (x [rows, heads, d] (may be a strided view), cos, sin) -> rotated x
    silu_mul: Any  # (gate_up [rows, 2 * inter]) -> silu(gate) * up


TORCH_OPS = LayerOps(torch_ops.rms_norm, torch_ops.add_rms_norm,
                     torch_ops.rope_neox, torch_ops.silu_mul)
FUSED_CPU_OPS = LayerOps(cpu_fused.rms_norm, cpu_fused.add_rms_norm, cpu_fused.rope_neox_,
                         cpu_fused.silu_mul)


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


def frozen_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter that takes no gradient (weights are loaded, not trained)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with batch-invariant fast paths (CPU bf16, and the GPU's GEMM:
    :meth:`LlamaForCausalLM.use_linear_kernel`).

    torch's bf16 GEMM on CPUs without native bf16 (AVX2) costs about one GEMV per row, and
    its result for a row depends on how many rows it is given. After
    :meth:`LlamaForCausalLM.enable_cpu_fast_path` every row count goes through the bf16 GEMV
    kernel (``kernels.cpu_gemv``: 8 rows per pass over the weights, cache-sized weight tiles for
    more; accumulates in fp32 and rounds once to bf16, like torch's bf16 linear, and gives a
    row the same bits whatever the other rows). With 4-bit weights attached and enabled
    (:meth:`LlamaForCausalLM.attach_int4_weights`), their kernel runs instead (torch's int4
    or ``kernels.cpu_q4q8``; both give a row the same bits whatever the other rows).
    """

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype,
                 weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None \
            else frozen_param(out_features, in_features, dtype=dtype)
        self.bias = frozen_param(out_features, dtype=dtype) if bias else None
        self.gemv: Any = None  # (x [rows, in], weight, bias) -> y
        self.int4: FourBitWeight | None = None  # 4-bit copy of the weight (FOUR_BIT_KERNELS)
        self.use_int4 = False  # multiply by it instead of the dense weight

    def use_matmul(self, gemv: Any) -> None:
        """Multiply with ``gemv(x, weight, bias)`` instead of ``F.linear`` (4-bit copies,
        where enabled, still take precedence)."""
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.use_int4 and self.int4 is not None:  # every row count: batch-invariant
            y = four_bit_linear(x, self.int4)
            return y if self.bias is None else y + self.bias
        if self.gemv is None:
            return F.linear(x, self.weight, self.bias)
        return self.gemv(x, self.weight, self.bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> fp32 [rows, out]
        """``forward(x).float()``, the same values; an 8- or 6-bit LM head's kernel writes
        them as fp32 itself (no separate conversion pass over the logits)."""
        if self.use_int4 and self.bias is None \
                and isinstance(self.int4, Q8Q8Weight | Q6Q8Weight):
            return cpu_q4q8.linear(x, self.int4, float_out=True)
        return self.forward(x).float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = frozen_param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops: LayerOps,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with no residual yet, ``(norm(x), x)``."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        y, residual = ops.add_rms_norm(x, residual, self.weight, self.eps)
        return y, residual


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, backend: ModuleType) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv = Linear(self.q_size + 2 * self.kv_size, shape.hidden_size, shape.qkv_bias,
                          dtype)
        self.o = Linear(shape.hidden_size, self.q_size, shape.o_bias, dtype)
        self.scale = self.head_dim**-0.5
        self.backend = backend
        # the backend's fused KV write + attention, where it has one (returns None to decline)
        self.write_kv_and_attend = getattr(backend, "write_kv_and_attend", None)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        ops: LayerOps,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        qkv = self.qkv.forward(x)  # [num_tokens, q + 2 kv]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are adjacent columns: rotate both heads sets in one pass
        qk = ops.rope(qk.view(-1, self.heads + self.kv_heads, self.head_dim), *cos_sin)
        if self.write_kv_and_attend is not None and qk.data_ptr() == qkv.data_ptr():
            # RoPE ran in place: qkv holds rotated q, k; KV write + attention in one call
            out = self.write_kv_and_attend(qkv, self.heads, self.kv_heads, kv_cache, meta,
                                           self.scale)
            if out is not None:
                return self.o.forward(out.view(-1, self.q_size))
        q, k = qk.split([self.heads, self.kv_heads], dim=1)  # [T, H, D], [T, KVH, D]
        self.backend.write_kv(k, v.view(-1, self.kv_heads, self.head_dim), kv_cache,
                              meta.slot_mapping)
        out = self.backend.paged_attention(q, kv_cache, meta, self.scale)  # [T, H, D]
        return self.o.forward(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        super().__init__()
        inter = shape.intermediate_size
        self.gate_up = Linear(2 * inter, shape.hidden_size, shape.mlp_bias, dtype)
        self.down = Linear(shape.hidden_size, inter, shape.mlp_bias, dtype)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:  # [num_tokens, hidden]
        return self.down.forward(ops.silu_mul(self.gate_up.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, dtype: torch.dtype, backend: ModuleType) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.self_attn = Attention(shape, dtype, backend)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.mlp = MLP(shape, dtype)
        # the layer's weights for kernels.cpu_layer when it runs this layer in one native
        # call (bf16 int4 on the CPU); None: the Python layer below
        self.native: list[torch.Tensor] | None = None

    def bind_native(self, enabled: bool) -> None:
        """Run this layer natively (:mod:`kernels.cpu_layer`) when ``enabled`` and all four
        matrices multiply by 4-bit weights of one kernel (torch's int4, or q4q8's 4- and
        6-bit loops, qkv maybe as two such matrices side by side) with no bias but qkv's;
        else the Python layer."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv, attn.o, mlp.gate_up, mlp.down)
        self.native = None
        weights = [lin.int4 for lin in linears]
        q4q8 = all(isinstance(w, cpu_q4q8.LAYER_WEIGHTS) for w in weights[1:]) and (
            isinstance(weights[0], cpu_q4q8.LAYER_WEIGHTS)
            or (isinstance(weights[0], StackedWeight) and len(weights[0].parts) == 2))
        if enabled and all(lin.use_int4 for lin in linears) \
                and (all(isinstance(w, Int4Weight) for w in weights)
                     or (q4q8 and cpu_layer.takes_q4q8())) \
                and attn.o.bias is None and mlp.gate_up.bias is None and mlp.down.bias is None:
            pairs = [native_parts(lin.int4) for lin in linears if lin.int4 is not None]
            self.native = cpu_layer.layer_weights(
                self.input_layernorm.weight, pairs[0], pairs[1],
                self.post_attention_layernorm.weight, pairs[2], pairs[3], attn.qkv.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous sub-layer's output, not yet added to ``residual`` (so each
        add fuses into the next norm); same sums in the same order as HF."""
        if self.native is not None:
            attn = self.self_attn
            out = cpu_layer.decoder_layer(x, residual, self.native, cos_sin, kv_cache, meta,
                                          attn.heads, attn.kv_heads, self.input_layernorm.eps,
                                          attn.scale)
            if out is not None:
                return out
        # .forward(): nn.Module.__call__ costs ~3 us a call, ~1 ms a decode step in all (2-core
        # EPYC with AVX512-BF16)
        h, residual = self.input_layernorm.forward(x, residual, ops)
        h = self.self_attn.forward(h, cos_sin, kv_cache, meta, ops)
        h, residual = self.post_attention_layernorm.forward(h, residual, ops)
        return self.mlp.forward(h, ops), residual
