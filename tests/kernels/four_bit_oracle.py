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


def random_q4k_weights(out: int, k: int, seed: int, top: int = 63,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``q [out, k]`` (0..15) and per-32 ``d, m [out, k / 32]`` as a GGUF Q4_K file's
    blocks give them (:mod:`engine.gguf_quant`): per 256 weights an fp16 ``d`` (either sign)
    and ``dmin``, per 32 integers ``sc, mn`` in 0..``top``; ``d · sc`` and ``−dmin · mn``
    exact in fp32 and, in general, not fp16 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    supers = (out, k // 256)
    d = (torch.randn(supers, generator=g) * 2e-3).half().float()
    dmin = (torch.rand(supers, generator=g) * 5e-3).half().float()
    sc = torch.randint(0, top + 1, (out, k // 32), generator=g).float()
    mn = torch.randint(0, top + 1, (out, k // 32), generator=g).float()
    return q, d.repeat_interleave(8, dim=1) * sc, -dmin.repeat_interleave(8, dim=1) * mn


def random_q4_k_blocks(rows: int, k: int, seed: int) -> Any:
    """``[rows, k / 256 * 144]`` uint8: a GGUF Q4_K matrix's raw super-blocks, random bytes
    (any 6-bit scales and mins, any codes) with finite fp16 ``d`` and ``dmin`` of either
    sign."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * k // 256, 144), dtype=np.uint8)
    b[:, :4] = (rng.standard_normal((b.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def random_q6_weights(out: int, k: int, seed: int) -> Any:
    """An :class:`engine.gguf_quant.Q6Weight`: codes over the whole 6-bit range and per-16
    scales ``d · sc`` as a Q6_K file has them (an fp16 ``d`` per 256 weights times an int8
    ``sc``, -128 included)."""
    from quickdraft.engine.gguf_quant import Q6Weight

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (out, k), generator=g, dtype=torch.int8)
    d = (torch.rand(out, -(-k // 256), generator=g) * 1e-3 + 1e-5).half().float()
    sc = torch.randint(-128, 128, (out, k // 16), generator=g, dtype=torch.int8)
    return Q6Weight(q, d, sc)


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


def assert_matches_q8_reference(y: torch.Tensor, x: torch.Tensor,
                                weight: torch.Tensor) -> None:
    """``y = linear(x, packed weight)`` against x rounded to 8 bits as the kernels do and the
    exact dense ``weight [out, k]`` in fp64: only fp32 accumulation and the output's bf16
    rounding are left; and within a few per cent of the unrounded product."""
    dense_w = weight.double()
    ref = q8_rounded(x) @ dense_w.t()
    magnitude = q8_rounded(x).abs() @ dense_w.abs().t()
    error = (y.double() - ref).abs()
    assert bool((error <= 2 ** -8 * ref.abs() + 1e-6 * magnitude).all())
    torch.testing.assert_close(y.double(), x.double() @ dense_w.t(), rtol=0.03,
                               atol=0.03 * float(ref.abs().max()))


def assert_rows_threads_and_isa_agree(linear: Callable[..., torch.Tensor], weight: Any,
                                      x: torch.Tensor, uses_vnni: bool,
                                      uses_amx: bool = False) -> None:
    """Each row of ``linear(x, weight)`` is computed alone: its bits do not depend on the
    other rows (1..len(x) of them, crossing the 16-row passes), the thread count, or the
    VNNI loop against the AVX2 one (``vnni=False``: the other CPU kind's) and the AMX loops
    (``amx_rows``, where ``uses_amx``)."""
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
    if uses_amx:  # every pass on AMX, and none (the loops the measured threshold mixes)
        for amx_rows in (1, 0):
            assert torch.equal(linear(x, weight, amx_rows=amx_rows), alone)
