"""Fast bf16 ``F.linear`` for small batches on x86 CPUs (decode-time GEMV).

At batch 1 a linear layer is a matrix-vector product that streams the whole weight matrix
from memory once; torch's bf16 path leaves a good part of the memory bandwidth unused.
``cpu_gemv.c`` is a small AVX2/FMA kernel for up to :data:`MAX_ROWS` rows of ``x``; it is
built with gcc on first use into ``$QUICKDRAFT_CACHE/kernels`` (default
``~/.cache/quickdraft/kernels``), keyed by a hash of the source and flags, and loaded with
ctypes. Without gcc, AVX2/FMA/F16C or on a failed build, :func:`available` is False and
:func:`linear_bf16` is plain ``F.linear``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Most rows of x the kernel takes; more go to F.linear (compute-bound GEMM territory).
MAX_ROWS = 8

_SOURCE = Path(__file__).with_name("cpu_gemv.c")
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_BF16 = torch.bfloat16


def cache_dir() -> Path:
    """Built kernels: ``$QUICKDRAFT_CACHE/kernels``, else ``~/.cache/quickdraft/kernels``."""
    root = os.environ.get("QUICKDRAFT_CACHE") or Path.home() / ".cache" / "quickdraft"
    return Path(root) / "kernels"


def _cpu_supported() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split()) >= _CPU_FLAGS
    return False


def _build(source: bytes, cc: str) -> Path:
    digest = hashlib.sha256(source + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"cpu_gemv-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_gemv-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        # The source goes through stdin so that what is built is exactly what was hashed.
        subprocess.run([cc, *_CFLAGS, "-o", tmp, "-x", "c", "-"], input=source, check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for stale in out_dir.glob("cpu_gemv-*.so"):  # builds of older sources (unlinking is safe
        if stale != target:                      # even if another process has one loaded)
            with contextlib.suppress(OSError):
                stale.unlink()
    return target


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[..., int] | None:
    """Build (if needed) and load the kernel: the ctypes function ``qd_linear_bf16``; None,
    with one warning, when that is impossible."""
    try:
        if not _cpu_supported():
            log.warning("cpu_gemv: CPU lacks AVX2/FMA/F16C; using F.linear")
            return None
        cc = shutil.which("gcc")
        if cc is None:
            log.warning("cpu_gemv: gcc not found; using F.linear")
            return None
        path = _build(_SOURCE.read_bytes(), cc)
        # CDLL (not PyDLL): the GIL is released during the call. torch is already imported,
        # so the library's libgomp.so.1 resolves to torch's and both share one thread pool.
        lib = ctypes.CDLL(str(path))
        fn = lib.qd_linear_bf16
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        fn.restype = ctypes.c_int
        return fn
    except subprocess.CalledProcessError as e:
        log.warning("cpu_gemv: build failed, using F.linear:\n%s",
                    e.stderr.decode(errors="replace"))
    except Exception as e:
        log.warning("cpu_gemv: unavailable (%s: %s); using F.linear", type(e).__name__, e)
    return None


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
