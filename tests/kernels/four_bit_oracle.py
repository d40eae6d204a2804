"""Random 4-bit block weights and their dense form, and activations rounded to 8 bits as
llama.cpp's Q8 scheme does: the references of the 4-bit and 8-bit CPU kernels' tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the q4q8/q8q8 kernels round it: per block of 32, sx = max|x| / 127
    (fp32), xq = round-half-even(x · 127 / max|x|) (fp32 product); returned as sx · xq in
    fp64."""
    rows, k = x.shape
    xf = x.float().view(rows, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # (a true division: ``127.0 / tensor`` is reciprocal-then-multiply in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).clamp(-127, 127)
    return (xq.double() * (amax / 127.0).double()).view(rows, k)


def assert_rows_threads_and_isa_agree(linear: Callable[..., torch.Tensor], weight: Any,
                                      x: torch.Tensor, uses_vnni: bool) -> None:
    """Each row of ``linear(x, weight)`` is computed alone: its bits do not depend on the
    other rows (1..len(x) of them, crossing the 16-row passes), the thread count, or the
    VNNI loop against the AVX2 one (``vnni=False``: the other CPU kind's)."""
    alone = torch.cat([linear(x[i:i + 1], weight) for i in range(len(x))])
    for rows in sorted({2, 8, 9, 16, min(17, len(x)), len(x)}):
        assert torch.equal(linear(x[:rows], weight), alone[:rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, weight), alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(linear(x, weight, vnni=False), alone)
    if uses_vnni:
        assert torch.equal(linear(x, weight, vnni=True), alone)
