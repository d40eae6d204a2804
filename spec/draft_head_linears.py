"""The draft head's matrices on the target's kernels, and the weight lists of its native calls.

At serving time (:class:`spec.draft_head_runner.DraftHeadRunner`) the head multiplies the way
the target does (the kernel chosen by measurement at start-up, :mod:`engine.weight_format`):
:func:`put_on_target_kernels` swaps each of its six matrices for a :class:`HeadLinear` holding
a 4-bit copy where the target's layers run 4-bit. Where the target runs its layers in one
native call on q4q8 weights, :func:`native_layer_weights` and :func:`native_forward_weights`
give the weight lists of :func:`kernels.cpu_layer.head_layer` and
:func:`kernels.cpu_layer.head_stack`. Lossless whatever the kernel: drafts are verified.
"""

from __future__ import annotations

from typing import Any

import torch

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_layers import Linear
from quickdraft.engine.models.llama_weights import StackedWeight
from quickdraft.kernels import cpu_int4, cpu_layer, cpu_q4q8
from quickdraft.spec.draft_head import DraftHead

__all__ = ["HEAD_LINEARS", "INT4_MAX_ROWS", "HeadLinear", "native_forward_weights",
           "native_layer_weights", "put_on_target_kernels"]

HEAD_LINEARS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")
INT4_MAX_ROWS = 4  # torch's int4 CPU kernel costs ~a GEMV per row: dense beyond this
# (the q4q8 kernel unpacks each 4-bit block once for 8 rows: it takes every row count)


class HeadLinear(torch.nn.Module):
    """One of the head's matrices on the fastest kernel for the row count: its 4-bit copy
    for the few rows of drafting rounds, the dense weight (bf16 GEMV kernel or torch) for
    catch-ups after a prefill. Rows need not be batch-invariant here: drafts are verified."""

    def __init__(self, weight: torch.Tensor,
                 int4: cpu_int4.Int4Weight | cpu_q4q8.Q4Q8Weight | None, gemv: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.int4 = int4
        self.gemv = gemv  # (x, weight, bias) -> y, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if isinstance(self.int4, cpu_q4q8.Q4Q8Weight):
            return cpu_q4q8.linear(x, self.int4)
        if self.int4 is not None and x.shape[0] <= INT4_MAX_ROWS:
            return cpu_int4.linear(x, self.int4)
        if self.gemv is not None:
            return self.gemv(x, self.weight, None)
        return torch.nn.functional.linear(x, self.weight)


def put_on_target_kernels(head: DraftHead, target: LlamaForCausalLM) -> str:
    """Run ``head``'s matrices the way ``target`` runs its own: when the target's layers use
    4-bit weights, the head multiplies by 4-bit copies (rounded here, Q4_1-style: ~4 MB read
    a forward instead of ~15) on the same kernel: q4q8 for every row count, torch's int4
    kernel for drafting rounds (<= ``INT4_MAX_ROWS`` rows); other rows go through the bf16
    GEMV kernel when the target uses it, else plain torch. Replaces the head's six matrices
    with :class:`HeadLinear` s (none where it returns "torch"). Returns the kernel's name
    ("int4-q8", "int4", "gemv" or "torch")."""
    ref = next((m for m in target.layers.modules() if isinstance(m, Linear)), None)
    if ref is None or (not ref.use_int4 and ref.gemv is None):
        return "torch"
    q8 = ref.use_int4 and isinstance(ref.int4, (*cpu_q4q8.LAYER_WEIGHTS, StackedWeight))
    kind = ("int4-q8" if q8 else "int4") if ref.use_int4 else "gemv"
    module = cpu_q4q8 if q8 else cpu_int4
    for name in HEAD_LINEARS:
        weight = getattr(head, name).weight.detach()
        int4 = (module.pack(*cpu_int4.quantize(weight))
                if kind != "gemv" and module.supports(*weight.shape) else None)
        setattr(head, name, HeadLinear(weight, int4, ref.gemv))
    return kind


def _q4q8(linear: Any) -> cpu_q4q8.Q4Q8Weight | None:
    """``linear``'s q4q8 copy, if it is a :class:`HeadLinear` with one."""
    if isinstance(linear, HeadLinear) and isinstance(linear.int4, cpu_q4q8.Q4Q8Weight):
        return linear.int4
    return None


def native_layer_weights(head: DraftHead, kernel: str, target: LlamaForCausalLM,
                         ) -> list[torch.Tensor] | None:
    """The weight list of :func:`kernels.cpu_layer.head_layer`, when the target's layers
    run natively on q4q8 weights (bf16 on the CPU; ``kernel`` is
    :func:`put_on_target_kernels`' answer) and the head's four layer matrices have q4q8
    copies; else None. (Not on torch's int4 kernel: the native rounds recompute every fed
    node, and that kernel costs about a GEMV per row.)"""
    weights = [_q4q8(lin) for lin in (head.qkv, head.o, head.gate_up, head.down)]
    if kernel != "int4-q8" or not any(
            getattr(layer, "native", None) is not None for layer in target.layers):
        return None
    parts = [cpu_q4q8.native_parts(w) for w in weights if w is not None]
    if len(parts) != len(weights):
        return None
    return cpu_layer.head_layer_weights(head.input_norm.detach(), head.hidden_norm.detach(),
                                        parts[0], parts[1], head.post_norm.detach(),
                                        parts[2], parts[3])


def native_forward_weights(head: DraftHead, layer: list[torch.Tensor] | None,
                           ) -> list[torch.Tensor] | None:
    """:func:`kernels.cpu_layer.head_stack`'s weight list: the layer's (``layer``, from
    :func:`native_layer_weights`), the final norm, the LM head's q4q8 parts and fc's; None
    without the native layer or those copies."""
    lm_head, fc = _q4q8(head.lm_head), _q4q8(head.fc)
    if layer is None or lm_head is None or fc is None:
        return None
    return [*layer, head.norm.detach(), *cpu_q4q8.native_parts(lm_head),
            *cpu_q4q8.native_parts(fc)]
