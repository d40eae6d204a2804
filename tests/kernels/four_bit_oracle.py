"""Random 4-bit block weights and their dense form, for the 4-bit kernels' reference tests."""

from __future__ import annotations

import torch


def random_q4_weights(out: int, k: int, seed: int,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``q [out, k]`` (0..15) and per-32 ``d, m [out, k / 32]`` (fp16 values, as a
    GGUF Q4_1 block stores them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(out, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(out, k // 32, generator=g) * 0.1).half().float()
    return q, d, m


def dense(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w = d · q + m`` as a dense ``[out, k]`` matrix in ``dtype``."""
    out, k = q.shape
    return (d.to(dtype)[..., None] * q.reshape(out, k // 32, 32).to(dtype)
            + m.to(dtype)[..., None]).view(out, k)
