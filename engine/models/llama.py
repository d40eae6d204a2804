"""Our own Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style, Qwen2) over a paged KV cache.

The whole step is one flat batch of ``num_tokens`` tokens from many sequences; only attention
needs to know which sequence a token belongs to, and it learns that from ``AttentionMetadata``.
q/k/v and gate/up projections are fused into one matmul each; the op order of every numerically
relevant piece (RMSNorm, RoPE, residuals) follows HF transformers so fp32 results agree.
The layers are in :mod:`engine.models.llama_layers`, the checkpoint-name mapping and the 4-bit
packing in :mod:`engine.models.llama_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.engine.gguf_quant import LM_HEAD, HeadWeight, Q4Weight
from quickdraft.engine.models.llama_layers import (
    FUSED_CPU_OPS,
    TORCH_OPS,
    DecoderLayer,
    LayerOps,
    Linear,
    ModelShape,
    RMSNorm,
    frozen_param,
)
from quickdraft.engine.models.llama_weights import (
    FOUR_BIT_KERNELS,
    fused_parts,
    map_weight,
    onto_huge_pages,
    pack_fused,
    pack_head,
)
from quickdraft.engine.models.rope import RotaryEmbedding
from quickdraft.kernels import cpu_fused, cpu_int4, cpu_layer, cpu_q4q8
from quickdraft.kernels.attention_metadata import AttentionMetadata


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; logits only where asked."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int,
                 backend: ModuleType) -> None:
        super().__init__()
        self.shape = shape = ModelShape.from_config(config)
        self.dtype = dtype
        self.embed_tokens = frozen_param(shape.vocab_size, shape.hidden_size, dtype=dtype)
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
            for target, parts in fused_parts(self.shape).items():
                linear = layer.get_submodule(target)
                assert isinstance(linear, Linear)
                shape = tuple(linear.weight.shape)
                linear.int4 = pack_fused([f"{prefix}{part}.weight" for part in parts], weights,
                                         shape, kernel) if module.supports(*shape) else None
                linear.use_int4 = linear.use_int4 and linear.int4 is not None
                count += linear.int4 is not None
        self.lm_head.int4, self.lm_head.use_int4 = None, False
        if kernel == "q8":
            self.lm_head.int4 = pack_head(weights.get(LM_HEAD), LM_HEAD,
                                          tuple(self.lm_head.weight.shape))
        onto_huge_pages([m for m in self.modules() if isinstance(m, Linear)])
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
            target, rows = map_weight(name, self.shape)
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

