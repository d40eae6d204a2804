"""Triton versions of the small per-layer ops: RMSNorm (+ residual add), neox RoPE in place,
SiLU(gate) * up.

Groundwork for the GPU path (nothing in the engine calls these yet). The semantics are those
of the torch references in :mod:`kernels.cpu_fused` (HF Llama op order), including where
torch rounds to the tensor dtype between ops:

* ``rms_norm``: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, output in
  ``promote(weight, x)``; ``add_rms_norm`` first rounds ``x + residual`` to its dtype and
  returns it as the new residual.
* ``rope_neox_``: ``x * cos + rotate_half(x) * sin`` with both products and the sum rounded
  to ``promote(x, cos, sin)``, written back into x (any row/head strides).
* ``silu_mul``: ``silu(gate)`` rounded to the dtype, times ``up``, rounded.

Only the order of the mean's sum and the exp/rsqrt implementations differ from torch, so the
results agree to the last bit almost everywhere and otherwise by one unit in the last place.

Grids: RMSNorm one program per row (the whole row in registers up to ``_MAX_NORM_BLOCK``
elements, otherwise two passes over ``_MAX_NORM_BLOCK`` chunks); RoPE one program per row
covering all its heads; SiLU*mul ``(rows, cdiv(inter, BLOCK))``.

Importing this module never fails: without triton, :func:`available` is False and the entry
points raise. ``TRITON_INTERPRET=1`` must be set before import to run on CPU tensors.
"""

# No ``from __future__ import annotations``: triton reads the ``tl.constexpr`` annotations.
import torch

from quickdraft.kernels.triton_common import (
    INTERPRET,
    available,
    jit,
    next_pow2,
    require,
    round_to,
    tl,
)

__all__ = ["add_rms_norm", "available", "rms_norm", "rope_neox_", "silu_mul"]

_MAX_NORM_BLOCK = 8192
_SILU_BLOCK = 1024
# The kernels reproduce torch's separate roundings: no contraction of a*b + c into an FMA.
_NO_FMA = {"enable_fp_fusion": False}


def _norm_warps(block: int) -> int:
    """Warps for a norm program over ``block`` elements (a guess; tune on a GPU)."""
    return min(16, max(4, block // 512))


def _tl_dtype(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    table = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


# ----------------------------------------------------------------------------------------------
# kernels


@jit
def _rn(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """Round fp32 x to DTYPE (nearest even) and widen it back: one torch op's rounding."""
    return round_to(x, DTYPE, INTERP).to(tl.float32)


@jit
def _x_plus_residual(x_row, res_row, c, mask, HAS_RESIDUAL: tl.constexpr, INTERP: tl.constexpr):
    """A chunk of ``x (+ residual)`` in fp32, the sum rounded to x's dtype like torch's add."""
    x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_row + c, mask=mask, other=0.0).to(tl.float32)
        x = _rn(x + res, x_row.dtype.element_ty, INTERP)
    return x


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, r_ptr, n, eps,
    stride_x, stride_res, stride_y, stride_r,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
    INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    y_row = y_ptr + row * stride_y
    r_row = r_ptr + row * stride_r
    x_ty = x_ptr.dtype.element_ty
    y_ty = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in registers
        mask = cols < n
        x = _x_plus_residual(x_row, res_row, cols, mask, HAS_RESIDUAL, INTERP)
        if HAS_RESIDUAL:
            tl.store(r_row + cols, round_to(x, x_ty, INTERP), mask=mask)
        # torch.rsqrt(mean + eps) as a correctly rounded 1 / sqrt (tl.sqrt and / are
        # approximate on GPUs)
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(x * x, 0), n * 1.0) + eps))
        normed = _rn(x * inv, x_ty, INTERP)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, round_to(w * normed, y_ty, INTERP), mask=mask)
    else:  # two passes over BLOCK-sized chunks
        sq = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            x = _x_plus_residual(x_row, res_row, c, mask, HAS_RESIDUAL, INTERP)
            if HAS_RESIDUAL:
                tl.store(r_row + c, round_to(x, x_ty, INTERP), mask=mask)
            sq += x * x
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(sq, 0), n * 1.0) + eps))
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            # recompute x + residual from the inputs rather than read r back (another thread
            # of the program may have stored that element)
            x = _x_plus_residual(x_row, res_row, c, mask, HAS_RESIDUAL, INTERP)
            normed = _rn(x * inv, x_ty, INTERP)
            w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c, round_to(w * normed, y_ty, INTERP), mask=mask)


@jit
def _rope_neox_kernel(
    x_ptr, cos_ptr, sin_ptr, heads,
    stride_xr, stride_xh, stride_xd, stride_cr, stride_cd, stride_sr, stride_sd,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    ROUND: tl.constexpr,  # the dtype of torch's result: promote(x, cos, sin)
    INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    mask = (h[:, None] < heads) & j_ok[None, :]
    lo = x_ptr + row * stride_xr + h[:, None] * stride_xh + j[None, :] * stride_xd
    hi = lo + HALF * stride_xd
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(hi, mask=mask, other=0.0).to(tl.float32)
    c_row = cos_ptr + row * stride_cr
    s_row = sin_ptr + row * stride_sr
    c1 = tl.load(c_row + j * stride_cd, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + (j + HALF) * stride_cd, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + j * stride_sd, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + (j + HALF) * stride_sd, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    # x * cos + cat(-x2, x1) * sin: out[:half] = x1 c1 - x2 s1, out[half:] = x2 c2 + x1 s2,
    # each product and the sum rounded like torch's separate ops (x, cos and sin are loaded
    # before anything is stored: in place is safe)
    out1 = _rn(_rn(x1 * c1, ROUND, INTERP) - _rn(x2 * s1, ROUND, INTERP), ROUND, INTERP)
    out2 = _rn(_rn(x2 * c2, ROUND, INTERP) + _rn(x1 * s2, ROUND, INTERP), ROUND, INTERP)
    out_ty = x_ptr.dtype.element_ty
    tl.store(lo, round_to(out1, out_ty, INTERP), mask=mask)
    tl.store(hi, round_to(out2, out_ty, INTERP), mask=mask)


@jit
def _silu_mul_kernel(
    gu_ptr, y_ptr, inter, stride_g, stride_y, BLOCK: tl.constexpr, INTERP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter
    ty = y_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + inter + c, mask=mask, other=0.0).to(tl.float32)
    s = _rn(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ty, INTERP)  # F.silu, rounded
    tl.store(y_ptr + row * stride_y + c, round_to(s * u, ty, INTERP), mask=mask)


# ----------------------------------------------------------------------------------------------
# entry points


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as ``[rows, n]`` with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(1) == 1 or n == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    require("quickdraft.kernels.triton_ops")
    n = weight.numel()
    if x.shape[-1] != n or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, weight {n}")
    _tl_dtype(x.dtype)
    x2 = _rows(x, n)
    rows = x2.shape[0]
    y = torch.empty(rows, n, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    r = None
    res2 = x2
    if residual is not None:
        res2 = _rows(residual, n)
        r = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows and n:
        single = next_pow2(n) <= _MAX_NORM_BLOCK
        block = next_pow2(n) if single else _MAX_NORM_BLOCK
        r_arg = r if r is not None else y
        _rms_norm_kernel[(rows,)](
            x2, res2, weight.contiguous(), y, r_arg, n, eps,
            x2.stride(0), res2.stride(0), y.stride(0), r_arg.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, SINGLE=single,
            INTERP=INTERPRET, num_warps=_norm_warps(block), **_NO_FMA)
    y = y.view(x.shape)
    return y, (r.view(x.shape) if r is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`kernels.torch_ops.rms_norm`: x ``[..., hidden]``, weight ``[hidden]``."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.torch_ops.add_rms_norm`: ``(rms_norm(x + residual), x + residual)``
    for x, residual of the same shape and dtype."""
    if residual.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype}, residual {residual.dtype}")
    y, r = _norm(x, residual, weight, eps)
    assert r is not None
    return y, r


def rope_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.torch_ops.rope_neox` in place on x; returns x.

    x ``[rows, heads, d]`` with any strides (e.g. the q|k columns of a fused qkv output);
    cos, sin ``[rows, d]`` or ``[rows, 1, d]``, shared by all heads."""
    require("quickdraft.kernels.triton_ops")
    rows, heads, d = x.shape
    if d % 2 or cos.numel() != rows * d or sin.numel() != rows * d:
        raise ValueError(f"x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    round_dt = _tl_dtype(torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype))
    _tl_dtype(x.dtype)
    if rows == 0 or heads == 0:
        return x
    cos2, sin2 = cos.reshape(rows, d), sin.reshape(rows, d)
    _rope_neox_kernel[(rows,)](
        x, cos2, sin2, heads, *x.stride(), *cos2.stride(), *sin2.stride(),
        HALF=d // 2, HEADS_PAD=next_pow2(heads), HALF_PAD=next_pow2(d // 2), ROUND=round_dt,
        INTERP=INTERPRET, **_NO_FMA)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.torch_ops.silu_mul`: gate_up ``[..., 2 * inter]`` -> ``[..., inter]``."""
    require("quickdraft.kernels.triton_ops")
    two_inter = gate_up.shape[-1]
    if two_inter % 2:
        raise ValueError(f"last dim {two_inter} is odd")
    _tl_dtype(gate_up.dtype)
    inter = two_inter // 2
    g2 = _rows(gate_up, two_inter)
    rows = g2.shape[0]
    y = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        block = min(_SILU_BLOCK, next_pow2(inter))
        _silu_mul_kernel[(rows, -(-inter // block))](
            g2, y, inter, g2.stride(0), y.stride(0), BLOCK=block, INTERP=INTERPRET,
            **_NO_FMA)
    return y.view(*gate_up.shape[:-1], inter)
