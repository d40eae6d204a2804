"""Our own Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style, Qwen2) over a paged KV cache.

The whole step is one flat batch of ``num_tokens`` tokens from many sequences; only attention
needs to know which sequence a token belongs to, and it learns that from ``AttentionMetadata``.
q/k/v and gate/up projections are fused into one matmul each; the op order of every numerically
relevant piece (RMSNorm, RoPE, residuals) follows HF transformers so fp32 results agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.engine.gguf_quant import LM_HEAD, HeadWeight, Q4Weight, Q6Weight, Q8Weight
from quickdraft.engine.models.rope import RotaryEmbedding
from quickdraft.kernels import cpu_fused, cpu_int4, cpu_layer, cpu_q4q8, huge_pages, torch_ops
from quickdraft.kernels.attention_metadata import AttentionMetadata
from quickdraft.kernels.cpu_int4 import Int4Weight
from quickdraft.kernels.cpu_q4q8 import Q4KQ8Weight, Q4Q8Weight, Q6Q8Weight, Q8Q8Weight

# A linear layer's 4-bit copy, by kernel: "torch" (ATen's int4 kernel, bf16 activations) or
# "q8" (kernels.cpu_q4q8: activations rounded to 8 bits, cheap extra rows; with it the LM
# head runs on the file's Q8_0 or Q6_K blocks where it has them).
FOUR_BIT_KERNELS = ("torch", "q8")


@dataclass(frozen=True)
class StackedWeight:
    """A fused matrix whose parts the file stores in different formats (Qwen's qkv with a
    Q6_K ``v_proj`` and Q4_K ``q_proj``/``k_proj``): each part on its own loop of
    :mod:`kernels.cpu_q4q8`, the outputs side by side (each row still computed alone)."""

    parts: tuple[Q4Q8Weight | Q4KQ8Weight | Q6Q8Weight, ...]


FourBitWeight = Int4Weight | Q4Q8Weight | Q4KQ8Weight | Q8Q8Weight | Q6Q8Weight | StackedWeight


def _four_bit_linear(x: torch.Tensor, weight: FourBitWeight) -> torch.Tensor:
    if isinstance(weight, cpu_q4q8.WEIGHTS):
        return cpu_q4q8.linear(x, weight)
    if isinstance(weight, StackedWeight):
        return torch.cat([cpu_q4q8.linear(x, part) for part in weight.parts], dim=-1)
    return cpu_int4.linear(x, weight)


def _q4(weight: Q4Weight | HeadWeight) -> Q4Weight:
    assert isinstance(weight, Q4Weight), "the layers' matrices are 4-bit"
    return weight


def _pack_mixed(names: list[str], parts: list[Any],
                shape: tuple[int, ...]) -> Q6Q8Weight | StackedWeight:
    """A matrix with Q6_K parts (and maybe 4-bit ones) for :mod:`kernels.cpu_q4q8`: a lone
    Q6_K matrix packed as it is, else the parts one by one (adjacent 4-bit parts fused)."""
    runs: list[list[Any]] = []
    for part in parts:
        if runs and isinstance(part, Q4Weight) and isinstance(runs[-1][0], Q4Weight):
            runs[-1].append(part)
        else:
            runs.append([part])
    packed = [cpu_q4q8.pack_q6(run[0].q, run[0].d, run[0].sc) if isinstance(run[0], Q6Weight)
              else cpu_q4q8.pack_layer(*_cat_q4(run)) for run in runs]
    rows = sum(p.out_features for p in packed)
    if (rows, packed[0].in_features) != shape:
        raise ValueError(f"{names[0]}: Q6_K/4-bit parts of shape {(rows, packed[0].in_features)}"
                         f", expected {shape}")
    return packed[0] if len(packed) == 1 and isinstance(packed[0], Q6Q8Weight) \
        else StackedWeight(tuple(packed))


def _cat_q4(run: list[Q4Weight]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q4 = Q4Weight.cat(run)
    return q4.q, q4.d, q4.m


def _onto_huge_pages(linears: list[Linear]) -> None:
    """Move the linears' 4-bit weights into one buffer on 2 MiB pages (every decode step
    streams them all: :mod:`kernels.huge_pages`); the same values."""
    weights = [(lin, lin.int4) for lin in linears if lin.int4 is not None]
    names = [[f.name for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
             for _, w in weights]
    copies = iter(huge_pages.copy_to_huge_pages(
        [getattr(w, n) for (_, w), ns in zip(weights, names, strict=True) for n in ns]))
    for (lin, w), ns in zip(weights, names, strict=True):
        moved: dict[str, Any] = {n: next(copies) for n in ns}
        lin.int4 = dataclasses.replace(w, **moved)


def _native_parts(weight: FourBitWeight) -> tuple[torch.Tensor, ...]:
    """The tensors :func:`kernels.cpu_layer.layer_weights` takes for one matrix (a stacked
    one's parts in turn)."""
    assert not isinstance(weight, Q8Q8Weight), "the layers' matrices are 4- or 6-bit"
    if isinstance(weight, StackedWeight):
        return tuple(t for part in weight.parts for t in cpu_q4q8.native_parts(part))
    if isinstance(weight, cpu_q4q8.LAYER_WEIGHTS):
        return cpu_q4q8.native_parts(weight)
    return weight.packed, weight.scales_and_zeros


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


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
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
        self.weight = weight if weight is not None else _param(out_features, in_features,
                                                               dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.gemv: Any = None  # (x [rows, in], weight, bias) -> y
        self.int4: FourBitWeight | None = None  # 4-bit copy of the weight (FOUR_BIT_KERNELS)
        self.use_int4 = False  # multiply by it instead of the dense weight

    def use_matmul(self, gemv: Any) -> None:
        """Multiply with ``gemv(x, weight, bias)`` instead of ``F.linear`` (4-bit copies,
        where enabled, still take precedence)."""
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if self.use_int4 and self.int4 is not None:  # every row count: batch-invariant
            y = _four_bit_linear(x, self.int4)
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
        self.weight = _param(size, dtype=dtype)
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
            pairs = [_native_parts(lin.int4) for lin in linears if lin.int4 is not None]
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
        self.lm_head = Linear(shape.vocab_size, shape.hidden_size, False, dtype,
                              weight=self.embed_tokens if shape.tie_word_embeddings else None)
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_positions, dtype)
        self.ops = TORCH_OPS
        self.native_layers = True  # allow kernels.cpu_layer where it applies
        self._stack: tuple[list[torch.Tensor], Any] | None = None  # see _native_stack

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.forward_with_aux(input_ids, positions, kv_caches, meta, ())[0]

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states ``[num_tokens, hidden]`` and, when ``aux_layers`` is not
        empty, the residual stream after each of those many layers (HF's
        ``hidden_states[i]``; 0 = the embeddings) concatenated: ``[num_tokens,
        len(aux_layers) * hidden]`` (a draft head's input features), else None."""
        residual: torch.Tensor | None = None
        aux: dict[int, torch.Tensor] = {}
        after = sorted(set(aux_layers))
        in_model = not after or after[-1] <= len(self.layers)  # (else: the loop's KeyError)
        stack = self._native_stack(kv_caches) if in_model else None
        # every layer and the final norm in one native call, the embedding and RoPE rows
        # gathered inside it (no torch call before it), the aux streams side by side in
        # ascending order; declined: the Python loop, which raises any bad id's error
        out = None if stack is None else cpu_layer.run_stack_normed_ids(
            stack, input_ids, positions, self.embed_tokens, (self.rotary.cos, self.rotary.sin),
            meta, after, self.norm.weight, self.norm.eps)
        if out is not None:
            hidden, streams = out
            if streams is None or list(aux_layers) == after:  # (a shipped head's order)
                return hidden, streams
            aux.update(zip(after, streams.split(hidden.shape[-1], dim=-1), strict=True))
        else:
            x = F.embedding(input_ids, self.embed_tokens)
            cos_sin = self.rotary.cos_sin(positions)
            if 0 in aux_layers:
                aux[0] = x
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer.forward(x, residual, cos_sin, kv_cache, meta, self.ops)
                if index + 1 in aux_layers:
                    aux[index + 1] = x + residual if residual is not None else x
            hidden = self.norm.forward(x, residual, self.ops)[0]
        if not aux_layers:
            return hidden, None
        return hidden, torch.cat([aux[i] for i in aux_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head.forward_float(hidden)

    def enable_cpu_fast_path(self, gemv: Any) -> None:
        """Route bf16 matmuls through the CPU GEMV kernel (see :class:`Linear`)
        and the small ops through the fused CPU kernels."""
        if self.dtype == torch.bfloat16 and cpu_fused.available():
            self.ops = FUSED_CPU_OPS
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_matmul(gemv)
        self._bind_native_layers()

    def use_linear_kernel(self, linear: Any) -> None:
        """Every linear layer (the LM head too) multiplies with ``linear(x, weight, bias)``,
        e.g. the GPU's batch-invariant GEMM (:mod:`kernels.triton_invariant`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_matmul(linear)

    def use_native_layers(self, enabled: bool) -> None:
        """Allow (default) or forbid whole layers in one native call (:mod:`kernels.cpu_layer`;
        the results are bit-identical either way)."""
        self.native_layers = enabled
        self._bind_native_layers()

    def _bind_native_layers(self) -> None:
        enabled = (self.native_layers and self.ops is FUSED_CPU_OPS
                   and self.embed_tokens.device.type == "cpu" and cpu_layer.available())
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.bind_native(enabled)
        self._stack = None  # rebuilt from the layers' new weight lists on the next step

    def _native_stack(self, kv_caches: list[torch.Tensor]) -> Any:
        """Every layer bound for one native call (:func:`kernels.cpu_layer.run_stack`) when
        they all run natively; made once for ``kv_caches`` (the runner's list), None
        otherwise."""
        if self._stack is not None and self._stack[0] is kv_caches:
            return self._stack[1]
        weights = [layer.native for layer in self.layers if isinstance(layer, DecoderLayer)]
        if not weights or len(weights) != len(kv_caches) or None in weights:
            return None
        first = self.layers[0]  # (every layer has the model's heads, scale and eps)
        assert isinstance(first, DecoderLayer)
        attn = first.self_attn
        stack = cpu_layer.layer_stack([w for w in weights if w is not None], kv_caches,
                                      attn.heads, attn.kv_heads, first.input_layernorm.eps,
                                      attn.scale)
        self._stack = (kv_caches, stack)
        return stack

    def attach_int4_weights(self, weights: Mapping[str, Q4Weight | HeadWeight],
                            kernel: str = "torch") -> int:
        """Give the layers 4-bit copies of their weights from ``weights`` (HF names, e.g. a
        GGUF's Q4_1 matrices), packed for ``kernel`` (one of :data:`FOUR_BIT_KERNELS`); a
        fused matrix (qkv, gate_up) only when all its parts are there. With the ``"q8"``
        kernel the LM head gets the Q8_0 or Q6_K copy under ``gguf_quant.LM_HEAD`` when there
        is one, and a layer matrix stored as Q6_K (Qwen's ``down_proj`` and ``v_proj`` in
        some layers) runs on the 6-bit loop, a fused one with such a part as a
        :class:`StackedWeight` (the native layer takes both); with ``"torch"`` a fused
        matrix needs all its parts 4-bit and Q6_K ones stay dense. Returns how many
        decoder-layer linear layers have one (an empty dict drops them all, the head's
        too)."""
        if kernel not in FOUR_BIT_KERNELS:
            raise ValueError(f"4-bit kernel {kernel!r} is not one of {FOUR_BIT_KERNELS}")
        module = cpu_q4q8 if kernel == "q8" else cpu_int4
        count = 0
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            for target, parts in _fused_parts(self.shape).items():
                linear = layer.get_submodule(target)
                assert isinstance(linear, Linear)
                names = [f"{prefix}{part}.weight" for part in parts]
                if not module.supports(*linear.weight.shape):
                    linear.int4, linear.use_int4 = None, False
                    continue
                found = [weights.get(n) for n in names]
                if kernel == "q8" and any(isinstance(w, Q6Weight) for w in found) \
                        and all(isinstance(w, Q4Weight | Q6Weight) for w in found):
                    linear.int4 = _pack_mixed(names, found, tuple(linear.weight.shape))
                    count += 1
                elif weights and all(isinstance(w, Q4Weight) for w in found):
                    q4 = Q4Weight.cat([_q4(weights[n]) for n in names])
                    if q4.shape != tuple(linear.weight.shape):
                        raise ValueError(f"{names[0]}: 4-bit shape {q4.shape}, expected "
                                         f"{tuple(linear.weight.shape)}")
                    linear.int4 = (cpu_q4q8.pack_layer(q4.q, q4.d, q4.m) if kernel == "q8"
                                   else cpu_int4.pack(q4.q, q4.d, q4.m))
                    count += 1
                else:
                    linear.int4, linear.use_int4 = None, False
        head = weights.get(LM_HEAD)
        self.lm_head.int4, self.lm_head.use_int4 = None, False
        if kernel == "q8" and isinstance(head, Q8Weight | Q6Weight):
            if head.shape != tuple(self.lm_head.weight.shape):
                raise ValueError(f"{LM_HEAD}: {type(head).__name__} shape {head.shape}, "
                                 f"expected {tuple(self.lm_head.weight.shape)}")
            if cpu_q4q8.supports(*head.shape):
                self.lm_head.int4 = (cpu_q4q8.pack_q8(head.q, head.d)
                                     if isinstance(head, Q8Weight)
                                     else cpu_q4q8.pack_q6(head.q, head.d, head.sc))
        _onto_huge_pages([m for m in self.modules() if isinstance(m, Linear)])
        self._bind_native_layers()
        return count

    def use_int4(self, enabled: bool) -> None:
        """Multiply by the attached 4-bit weights (where a layer has them) or the dense ones."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_int4 = enabled and module.int4 is not None
        self._bind_native_layers()

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Run the small per-layer ops with ``ops`` (e.g. the Triton kernels)."""
        self.ops = ops
        self._bind_native_layers()

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights (for speed benchmarks of model shapes we have no checkpoint for):
        normal(0, std) matrices and embeddings, unit norms, zero biases."""
        generator = torch.Generator(self.embed_tokens.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)

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


def _slices(shape: ModelShape) -> dict[str, tuple[str, tuple[int, int] | None]]:
    q, kv, inter = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up", (inter, 2 * inter)),
        "self_attn.o_proj": ("self_attn.o", None),
        "mlp.down_proj": ("mlp.down", None),
    }


def _fused_parts(shape: ModelShape) -> dict[str, list[str]]:
    """Our linear layers -> the HF matrices stacked in them, in row order."""
    parts: dict[str, list[str]] = {}
    for hf, (target, _rows) in _slices(shape).items():
        parts.setdefault(target, []).append(hf)
    return parts


def _map_weight(name: str, shape: ModelShape) -> tuple[str | None, tuple[int, int] | None]:
    """HF tensor name -> (our parameter name, row range inside a fused parameter)."""
    if "rotary_emb" in name:
        return None, None
    if name == "lm_head.weight":
        return (None, None) if shape.tie_word_embeddings else ("lm_head.weight", None)
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "norm.weight"):
        return name.removesuffix(".weight") if name.startswith("embed") else name, None
    rest = name.removeprefix("layers.")  # "N.self_attn.q_proj.weight"
    index, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")  # "self_attn.q_proj", "weight"
    base = f"layers.{index}."
    fused = _slices(shape)
    if module in fused:
        target, rows = fused[module]
        return f"{base}{target}.{kind}", rows
    return f"{base}{rest}", None
