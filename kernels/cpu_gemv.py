"""Fast bf16 ``F.linear`` for small batches on x86 CPUs (decode-time GEMV).

At batch 1 a linear layer is a matrix-vector product that streams the whole weight matrix
from memory once; torch's bf16 path leaves a good part of the memory bandwidth unused.
``cpu_gemv.c`` is a small AVX2/FMA kernel for up to :data:`MAX_ROWS` rows of ``x`` (8 rows
per pass over the weights; more rows walk cache-sized weight tiles, so a prefill chunk still
reads the weights once, and every output element is computed the same way whatever the row
count: row-invariant, unlike switching to a GEMM for large batches); it is
built with gcc on first use into ``$QUICKDRAFT_CACHE/kernels`` (default
``~/.cache/quickdraft/kernels``), keyed by a hash of the source and flags, and loaded with
ctypes. Without gcc, AVX2/FMA/F16C or on a failed build, :func:`available` is False and
:func:`linear_bf16` is plain ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.kernels import cbuild

log = logging.getLogger(__name__)

# Most rows of x the kernel takes in one call (more go to F.linear): any prefill chunk.
MAX_ROWS = 1 << 16
ROWS_PER_PASS = 8  # rows of x per pass over the weights (or over one cached weight tile)

_SOURCE = Path(__file__).with_name("cpu_gemv.c")
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_BF16 = torch.bfloat16


def _cpu_supported() -> bool:
    return cbuild.cpu_has(_CPU_FLAGS)


def _build(source: bytes, cc: str) -> Path:
    return cbuild.build("cpu_gemv", source, _CFLAGS, cc)


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[..., int] | None:
    """The ctypes function ``qd_linear_bf16``, or None when the kernel cannot be had."""
    lib = cbuild.load("cpu_gemv", _SOURCE, _CFLAGS, _CPU_FLAGS)
    if lib is None:
        return None
    fn = lib.qd_linear_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """True when the kernel is built, loaded and the CPU can run it. Never raises."""
    try:
        return _kernel() is not None
    except Exception:
        return False


def reference_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch reference (and fallback)."""
    return F.linear(x, weight, bias)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 CPU tensors with at most :data:`MAX_ROWS` rows.

    ``x`` is ``[..., k]``, ``weight`` ``[n, k]`` (contiguous), ``bias`` ``[n]`` or None; the
    result is ``[..., n]`` bf16, each element the fp32 sum rounded once to bf16. Anything else
    (other dtypes or devices, more rows, autograd, non-contiguous weight) goes to F.linear.
    """
    # This runs ~120 times per decode step: cheap checks only (x.device is slow, is_cpu not).
    kernel = _kernel()
    if (kernel is None or x.dtype is not _BF16 or weight.dtype is not _BF16
            or not (x.is_cpu and weight.is_cpu) or weight.dim() != 2
            or not weight.is_contiguous() or x.dim() == 0):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    if x.shape[-1] != k or n == 0 or k == 0:
        return F.linear(x, weight, bias)
    rows = x.numel() // k
    if not 1 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    if bias is not None and (bias.dtype is not _BF16 or not bias.is_cpu or bias.shape != (n,)):
        return F.linear(x, weight, bias)
    if (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)) \
            and torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(rows, k).contiguous()
    b = bias.contiguous() if bias is not None else None  # keep alive across the call
    out = torch.empty(rows, n, dtype=_BF16)
    rc = kernel(x2.data_ptr(), weight.data_ptr(), b.data_ptr() if b is not None else None,
                out.data_ptr(), rows, n, k, torch.get_num_threads())
    if rc != 0:
        return F.linear(x, weight, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
