"""Fused bf16 CPU kernels for decode: RMSNorm (+ residual add), neox RoPE, SiLU(gate) * up.

At batch 1 each of these is a handful of torch ops on a few KB, so their cost is torch's
per-op overhead, not arithmetic; ``cpu_fused.c`` does each in one ctypes call. It is built
with gcc on first use into ``$QUICKDRAFT_CACHE/kernels`` (default ``~/.cache/quickdraft/
kernels``), keyed by a hash of the source and flags, and loaded with ctypes. Without gcc,
AVX2/FMA or on a failed build, :func:`available` is False and every function runs its
plain-torch twin in :mod:`kernels.torch_ops` instead.

Those twins define the semantics (plain torch, the op order of HF Llama). RoPE,
SiLU·up and the residual add reproduce them bit for bit on finite inputs on every CPU: SiLU
uses a port of SLEEF's ``expf`` (what ATen's vectorised exp calls) and libm's ``expf`` where
ATen's scalar tail loop would; RoPE and the adds only need the same roundings. RMSNorm sums
its squares in one fixed order on every machine, ATen's AVX2 order (8-lane cascade sum): it
equals the reference bit for bit where torch dispatches to AVX2 and is within one bf16 ulp of
it where torch uses its 16-lane AVX512 (or generic) sum. So a kernel result never depends on
the CPU kind or on which other rows are in the call (``tests/kernels/sum_order_oracle.py``
writes the order out in Python).

The fast functions are called ~120 times per decode step, so they check only what is cheap
(dtype, ``is_cpu``, contiguity, shapes; anything else runs the torch op). Not checked:
autograd (they are for inference: outputs have no ``grad_fn``) and, for the in-place
``rope_neox_``, overlap between x and cos/sin.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from quickdraft.kernels import cbuild, torch_ops

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_fused.c")
# -ffp-contract=off: the kernels emulate torch's separate roundings; no implicit FMAs.
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC",
           "-shared")
_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_BF16 = torch.bfloat16
# More rows than this: the small ops (norm, RoPE, SiLU) on torch's threads (OpenMP in the C);
# fewer: on the calling thread, no torch.get_num_threads() call. The native layer reads it
# too (native_entry_points). Whole SmolLM2 steps, 300 positions, this line at 16 against 3
# (2026-11-30, the 2-core AMX Xeon, in one process, arms alternating; /work/prof/s58/
# par_ab.py): 1 / 2 / 4 / 8 / 16 rows 1.02 / 0.99 / 0.98 / 0.975 / 0.92x the time, 8
# sequences of 2 rows 0.94x; a 2-thread region costs ~1 us, so 2-3 rows gain nothing.
_PAR_ROWS = 3

_vp = ctypes.c_void_p
_int = ctypes.c_int


class _Lib(NamedTuple):
    rms_norm: Callable[..., int]
    rope: Callable[..., int]
    silu_mul: Callable[..., int]
    argmax: Callable[..., int]
    top_log_softmax: Callable[..., int]
    vec_block: int  # elements per iteration of torch's vectorised unary loop (0: none)
    dll: ctypes.CDLL  # the library (the tests call its checking helpers)


def _cpu_supported() -> bool:
    return cbuild.cpu_has(_CPU_FLAGS)


def _build(source: bytes, cc: str) -> Path:
    return cbuild.build("cpu_fused", source, _CFLAGS, cc)


def _torch_vec_block() -> int:
    """bf16 elements per iteration of ATen's vectorised unary loop for the CPU capability
    torch dispatches to: which elements its SiLU computes with SLEEF's exp rather than libm's
    (0: none, the generic build computes every element with libm)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return 64
    if cap == "AVX2":
        return 32
    return 0


@functools.lru_cache(maxsize=1)
def _lib() -> _Lib | None:
    """Build (if needed) and load the kernels; None, with one warning, when impossible."""
    lib = cbuild.load("cpu_fused", _SOURCE, _CFLAGS, _CPU_FLAGS)
    if lib is None:
        return None
    rms = lib.qd_rms_norm_bf16
    rms.argtypes = [_vp] * 5 + [_int, _int, ctypes.c_float, _int]
    rms.restype = _int
    rope = lib.qd_rope_neox_bf16
    rope.argtypes = [_vp] * 3 + [_int] * 3 + [ctypes.c_longlong] * 2 + [_int]
    rope.restype = _int
    silu = lib.qd_silu_mul_bf16
    silu.argtypes = [_vp, _vp, _int, _int, _int, _int]
    silu.restype = _int
    argmax = lib.qd_argmax_f32
    argmax.argtypes = [_vp, _vp, _int, ctypes.c_longlong, _int]
    argmax.restype = _int
    top = lib.qd_top_log_softmax_f32
    top.argtypes = [_vp, _vp, _vp, _int, ctypes.c_longlong, _int]
    top.restype = _int
    return _Lib(rms, rope, silu, argmax, top, _torch_vec_block(), lib)


def available() -> bool:
    """True when the kernels are built, loaded and the CPU can run them. Never raises."""
    try:
        return _lib() is not None
    except Exception:
        return False


def native_entry_points() -> dict[str, int] | None:
    """For native callers (:mod:`kernels.cpu_layer`): the kernels' addresses, the SiLU
    ``vec_block`` and the row count above which the ops use threads; None when not built."""
    lib = _lib() if available() else None
    if lib is None:
        return None
    def address(fn: Any) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value or 0

    return {"rms_norm": address(lib.rms_norm), "rope": address(lib.rope),
            "silu_mul": address(lib.silu_mul), "vec_block": lib.vec_block,
            "parallel_rows": _PAR_ROWS}


# ----------------------------------------------------------------------------------------------
# fast paths


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`kernels.torch_ops.rms_norm` in one call. x ``[..., hidden]`` and weight
    ``[hidden]``: CPU bf16, contiguous (otherwise the torch op runs)."""
    lib = _lib()
    if (lib is None or x.dtype is not _BF16 or weight.dtype is not _BF16
            or not (x.is_cpu and weight.is_cpu)
            or not x.is_contiguous() or not weight.is_contiguous()):
        return torch_ops.rms_norm(x, weight, eps)
    n = weight.numel()
    if n == 0 or x.shape[-1] != n:
        return torch_ops.rms_norm(x, weight, eps)
    rows = x.numel() // n
    y = torch.empty_like(x)  # contiguous, like x (faster than torch.empty(shape))
    rc = lib.rms_norm(x.data_ptr(), None, weight.data_ptr(), y.data_ptr(), None, rows, n, eps,
                      torch.get_num_threads() if rows > _PAR_ROWS else 1)
    if rc != 0:
        return torch_ops.rms_norm(x, weight, eps)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.torch_ops.add_rms_norm` in one call: ``(rms_norm(x + residual),
    x + residual)``. x, residual ``[..., hidden]`` of the same shape and weight ``[hidden]``:
    CPU bf16, contiguous (otherwise the torch op runs)."""
    lib = _lib()
    if (lib is None or x.dtype is not _BF16 or residual.dtype is not _BF16
            or weight.dtype is not _BF16 or not (x.is_cpu and residual.is_cpu and weight.is_cpu)
            or not x.is_contiguous() or not residual.is_contiguous()
            or not weight.is_contiguous()):
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    n = weight.numel()
    if n == 0 or x.shape[-1] != n or residual.shape != x.shape:
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    rows = x.numel() // n
    y = torch.empty_like(x)
    r = torch.empty_like(x)
    rc = lib.rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), y.data_ptr(),
                      r.data_ptr(), rows, n, eps,
                      torch.get_num_threads() if rows > _PAR_ROWS else 1)
    if rc != 0:
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    return y, r


def rope_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.torch_ops.rope_neox` in place on x; returns x.

    x ``[rows, heads, d]`` CPU bf16 with ``stride(2) == 1`` and any row/head strides (e.g.
    ``qkv[:, :q + k].view(rows, heads, d)`` of a ``[rows, q + 2 kv]`` matrix); cos and sin
    ``[rows, d]`` or ``[rows, 1, d]``, contiguous bf16. Other layouts/dtypes are computed
    with the reference and copied back."""
    lib = _lib()
    if lib is not None and x.dtype is _BF16 and cos.dtype is _BF16 and sin.dtype is _BF16 \
            and x.is_cpu and cos.is_cpu and sin.is_cpu and x.dim() == 3 \
            and cos.is_contiguous() and sin.is_contiguous():
        rows, heads, d = x.shape
        s_row, s_head, s_el = x.stride()
        if s_el == 1 and cos.numel() == rows * d and sin.numel() == rows * d:
            rc = lib.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, d, s_row,
                          s_head, torch.get_num_threads() if rows > _PAR_ROWS else 1)
            if rc == 0:
                return x
    return x.copy_(torch_ops.rope_neox(x, cos, sin))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.torch_ops.silu_mul` in one call. gate_up ``[..., 2 * inter]``: CPU bf16,
    contiguous (otherwise the torch op runs); returns ``[..., inter]``."""
    lib = _lib()
    if (lib is None or gate_up.dtype is not _BF16 or not gate_up.is_cpu
            or not gate_up.is_contiguous()):
        return torch_ops.silu_mul(gate_up)
    shape = gate_up.shape
    inter = shape[-1] // 2
    if inter == 0 or shape[-1] & 1:
        return torch_ops.silu_mul(gate_up)
    rows = gate_up.numel() // (2 * inter)
    y = torch.empty(rows, inter, dtype=_BF16)
    rc = lib.silu_mul(gate_up.data_ptr(), y.data_ptr(), rows, inter, lib.vec_block,
                      torch.get_num_threads() if rows > _PAR_ROWS else 1)
    if rc != 0:
        return torch_ops.silu_mul(gate_up)
    return y if len(shape) == 2 else y.view(*shape[:-1], inter)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x [rows, n]`` (ties to the first index, NaN the largest, as
    torch), in one call: CPU fp32 contiguous rows; anything else runs torch's argmax.
    Several rows use the threads."""
    lib = _lib()
    if (lib is None or x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu
            or not x.is_contiguous() or x.shape[1] == 0):
        return x.argmax(dim=-1)
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64)
    rc = lib.argmax(x.data_ptr(), out.data_ptr(), rows, x.shape[1],
                    torch.get_num_threads() if rows > 1 else 1)
    if rc != 0:
        return x.argmax(dim=-1)
    return out


def top_log_softmax(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``x [rows, n]`` as ``(log_softmax(x) values
    [rows, k] fp32, indices [rows, k] int64)``, largest first (a NaN above any number, ties
    to the smaller index), in one call without the full ``[rows, n]`` log-softmax: CPU fp32
    contiguous rows; anything else (e.g. CUDA) runs torch's ``log_softmax`` then ``topk``.
    A draft head's candidates: on 4096-entry rows torch's pair took 24 / 52 / 115 us for
    1 / 3 / 8 rows, this 13 / 23 / 46 us (the 2-core AVX2-only EPYC, 2026-11-27)."""
    lib = _lib()
    if (lib is None or x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu
            or not x.is_contiguous() or not 0 < k <= x.shape[1]):
        top = torch.topk(torch.log_softmax(x.float(), dim=-1), k)
        return top.values, top.indices
    rows = x.shape[0]
    values = torch.empty(rows, k, dtype=torch.float32)
    indices = torch.empty(rows, k, dtype=torch.int64)
    if rows and lib.top_log_softmax(x.data_ptr(), values.data_ptr(), indices.data_ptr(),
                                    rows, x.shape[1], k) != 0:
        raise ValueError(f"top_log_softmax rejected x {tuple(x.shape)}, k={k}")
    return values, indices
