"""A batch-invariant linear layer for the GPU path: ``y = x @ w^T (+ b)`` in one Triton kernel.

Why: cuBLAS (``F.linear``) picks its algorithm by the row count: a decode step of 1 row, a
verification step of ``1 + k`` rows and a step that mixes in a prefill chunk reduce a row's
dot products in different orders (tile shapes, split-K), so a token's logits depend on what
else was in its batch. In bf16 that flips greedy choices between near-tied logits: on an H200
speculation's output differed from plain decoding's (docs/benchmarks.md, "Speculation on an
H200"). The CPU kernels are batch-invariant by construction; this is the GPU's counterpart.

One fixed configuration for every call (no autotuning, no split-K, the row count a runtime
value that is never specialised): program ``(i, j)`` computes output tile
``[BLOCK_M rows, BLOCK_N columns]`` by walking ``k`` in ``BLOCK_K`` chunks in increasing
order, accumulating ``tl.dot`` products in fp32, adding the bias in fp32 and rounding once to
the output dtype. A row's result depends only on that row: the same instructions in the same
order whatever ``M`` is and wherever the row sits in the tile (rows never mix in a dot).
fp32 inputs use exact fp32 products (``ieee``), never TF32.

Importing this module never fails: without triton, :func:`available` is False and
:func:`linear` raises. ``TRITON_INTERPRET=1`` must be set before import to run on CPU
tensors (slowly: the tests do, on small shapes).
"""

# No ``from __future__ import annotations``: triton reads the ``tl.constexpr`` annotations.
import torch

from quickdraft.kernels.triton_common import (
    INTERPRET,
    available,
    dot,
    jit,
    require,
    round_to,
    tl,
    triton,
)

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "available", "linear"]

# The one configuration (a guess sized for decode and short verification batches of small
# models: 16 rows is the smallest tensor-core tile; to be tuned on a GPU, never per call).
BLOCK_M = 16
# (the interpreter runs each program in Python: there, wider column tiles, fewer programs; a
# column tile's width never changes an output's sum, which runs over k)
BLOCK_N = 256 if INTERPRET else 64
BLOCK_K = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _jit_kwargs() -> dict:
    # ``M`` (the row count) must not be specialised (triton would compile M == 1 and M % 16 == 0
    # variants, with other load vectorisation): one compiled kernel serves every row count
    return {"do_not_specialize": ["M"]} if triton is not None else {}


@jit(**_jit_kwargs())
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INTERP: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
        acc += dot(a, b, INTERP, PRECISION)  # [BM, BN] fp32
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = round_to(acc, y_ptr.dtype.element_ty, INTERP)  # once, to nearest even
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, out,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor,  # [M, K]
           weight: torch.Tensor,  # [N, K]
           bias: torch.Tensor | None = None,  # [N]
           ) -> torch.Tensor:  # [M, N], x's dtype
    """``F.linear(x, weight, bias)`` with a row's result independent of the other rows (the
    module docstring). All on one device, one of fp32 / fp16 / bf16, the same for x and
    weight."""
    require("quickdraft.kernels.triton_matmul")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        raise TypeError(f"x {x.dtype} and weight {weight.dtype}: expected one of "
                        f"{sorted(map(str, _DTYPES))} for both")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        INTERP=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y
