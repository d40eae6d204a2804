"""The small per-layer ops in plain torch, in HF Llama's op order: the semantics the fused
CPU kernels (:mod:`kernels.cpu_fused`) and the Triton ops (:mod:`kernels.triton_ops`)
reproduce, and the torch backend's own ops (fp32, the HF-exact oracle, and any device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (rounded to x.dtype), then ``(rms_norm(r), r)``."""
    r = x + residual
    return rms_norm(r, weight, eps), r


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x ``[rows, heads, d]`` and cos/sin ``[rows, d]``
    (or ``[rows, 1, d]``), shared by all heads; a new tensor."""
    rows, d = x.shape[0], x.shape[-1]
    cos, sin = cos.reshape(rows, 1, d), sin.reshape(rows, 1, d)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
