"""The summation order of the CPU RMSNorm kernel, written out in plain Python/numpy.

The kernel (``kernels/cpu_fused.c``: ``torch_sumsq``) sums squares in ATen's AVX2 order on
every machine: 8-lane fp32 vectors, four interleaved accumulators, a three-level cascade that
is flushed every ``step`` iterations, then the scalar tail and the lanes in order; below 8
elements, ATen's scalar cascade. Each ``+`` here is one fp32 rounding, as on the CPU, so
the oracle is the order itself, independent of the CPU it runs on. Slow (a Python loop over
vectors); for tests only.
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


def _cascade(items: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    """ATen's row_sum over ``items[size, width]`` seen as rows of 4: returns the 4-way
    accumulators ``[4, width]`` after the cascade and the number of items they hold."""
    size_ilp = items.shape[0] // 4
    lp = max(4, _ceil_log2(size_ilp) // 4)
    step, mask = 1 << lp, (1 << lp) - 1
    acc = np.zeros((4, 4, width), dtype=F32)
    i = 0
    while i + step <= size_ilp:
        for _ in range(step):
            acc[0] = acc[0] + items[4 * i:4 * i + 4]
            i += 1
        for level in range(1, 4):
            acc[level] = acc[level] + acc[level - 1]
            acc[level - 1] = 0
            if i & (mask << (level * lp)):
                break
    while i < size_ilp:
        acc[0] = acc[0] + items[4 * i:4 * i + 4]
        i += 1
    for level in range(1, 4):
        acc[0] = acc[0] + acc[level]
    return acc[0], size_ilp * 4


def sum_of_squares(x: torch.Tensor) -> float:
    """Sum of ``x[i]**2`` (fp32 1-D) in the kernel's order, as an fp32 value."""
    xf = x.detach().to(torch.float32).contiguous().numpy()
    sq = (xf * xf).astype(F32)  # each square rounded to fp32
    n = sq.shape[0]
    if n < 8:  # scalar cascade over 4 accumulators, then the tail into the first
        acc, done = _cascade(sq[: n // 4 * 4].reshape(-1, 1), 1)
        acc = acc[:, 0].copy()
        for t in range(done, n):
            acc[0] = F32(acc[0] + sq[t])
        total = acc[0]
        for k in range(1, 4):
            total = F32(total + acc[k])
        return float(total)
    vec_size = n // 8
    vecs = sq[: vec_size * 8].reshape(vec_size, 8)
    acc, done = _cascade(vecs, 8)
    first = acc[0].copy()
    for r in range(done, vec_size):  # whole vectors left over after the rows of 4
        first = (first + vecs[r]).astype(F32)
    for k in range(1, 4):
        first = (first + acc[k]).astype(F32)
    total = F32(0)
    for t in range(vec_size * 8, n):  # scalar tail first, then the lanes in order
        total = F32(total + sq[t])
    for lane in first:
        total = F32(total + lane)
    return float(total)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's RMSNorm on bf16 ``x[..., n]`` (+ residual): ``(y, x + residual)``, with
    the mean of squares in the kernel's order and every other rounding as HF Llama's."""
    r = x if residual is None else x + residual
    rows = r.reshape(-1, r.shape[-1]).float()
    n = rows.shape[-1]
    inv = torch.empty(rows.shape[0], 1)
    for i, row in enumerate(rows):
        var = F32(F32(sum_of_squares(row)) / F32(n))
        inv[i, 0] = float(F32(1.0) / np.sqrt(F32(var + F32(eps)), dtype=F32))
    y = weight * (rows * inv).to(x.dtype)
    return y.reshape(r.shape), r
