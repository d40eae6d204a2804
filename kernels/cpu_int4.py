"""Linear layers on 4-bit weights (group 32) with torch's CPU int4 kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes
``x @ w.T`` for ``w[n, k] = scale[g, n] · (q[n, k] − 8) + zero[g, n]`` (``g = k // 32``),
which is exactly a GGUF Q4_1 / Q4_0 block (``w = d · q + m``) with ``scale = d`` and
``zero = m + 8 d``. Its fast path takes bf16 activations with bf16 scales (fp32 inputs run a
scalar reference about 30x slower), so the scale and offset are rounded to bf16 once here:
the weights the kernel uses differ from the dequantized fp32 ones by at most about 2^-9 of a
block's range, the same size as rounding the dequantized weights to bf16 (the dense bf16
path). Each output row is computed the same way whatever the other rows are (tested), so a
request's result does not depend on its batch.

Measured on a 2-core EPYC with AVX512-BF16, 30 SmolLM2 layers' matrices streamed from memory
(not cached), batch 1: 3.97 ms against 6.41 ms for the bf16 GEMV kernel; on AVX2 machines it
was found about 3x slower, so the engine times both at start-up before using it
(``engine.model_runner``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
_BF16 = torch.bfloat16


@dataclass(frozen=True)
class Int4Weight:
    """A ``[out, in]`` matrix packed for the int4 kernel."""

    packed: torch.Tensor  # [out, in / 2] uint8 (the kernel's layout)
    scales_and_zeros: torch.Tensor  # [in / 32, out, 2] bf16
    out_features: int
    in_features: int


def available() -> bool:
    """True when this torch build has the CPU int4 ops."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def supports(out_features: int, in_features: int) -> bool:
    """Shapes the kernel packs: ``out % 16 == 0`` and ``in % 32 == 0``."""
    return out_features % 16 == 0 and in_features % GROUP == 0 and out_features > 0


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4Weight:
    """From 4-bit codes ``q[out, in]`` (0..15) and per-32 ``d, m [out, in / 32]`` (fp32) with
    ``w = d · q + m``."""
    out, k = q.shape
    if not supports(out, k) or d.shape != (out, k // GROUP) or m.shape != d.shape:
        raise ValueError(f"int4 weights need out % 16 == 0, in % {GROUP} == 0 and "
                         f"[out, in/{GROUP}] scales; got q {tuple(q.shape)}, d "
                         f"{tuple(d.shape)}, m {tuple(m.shape)}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    zero = m + 8.0 * d
    scales_and_zeros = torch.stack([d.t(), zero.t()], dim=-1).to(_BF16).contiguous()
    return Int4Weight(packed, scales_and_zeros, out, k)


def linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """``x @ w.T``: x ``[rows, in]`` (any float dtype; computed in bf16) -> ``[rows, out]`` in
    x's dtype."""
    xb = x if x.dtype is _BF16 else x.to(_BF16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), weight.packed, GROUP,
                                                   weight.scales_and_zeros)
    return y if y.dtype is x.dtype else y.to(x.dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round a dense ``[out, in]`` matrix to 4 bits per weight in groups of 32 (GGUF Q4_1's
    scheme: per group ``d = (max − min) / 15``, ``m = min``, ``q = round((w − m) / d)``), so
    every weight moves by at most ``d / 2``. Returns ``(q [out, in] uint8, d, m
    [out, in / 32] fp32)`` for :func:`pack`."""
    out, k = weight.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
    groups = weight.detach().float().reshape(out, k // GROUP, GROUP)
    low = groups.amin(dim=-1)  # [out, in / 32]
    d = (groups.amax(dim=-1) - low) / 15.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(out, k), d, low
