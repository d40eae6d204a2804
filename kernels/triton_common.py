"""What the Triton kernel modules share: the optional import of triton, rounding helpers,
moving a tensor to a device.

Importing this module never fails: without triton, :data:`triton` is None, :data:`tl` is a
stub with just enough of ``triton.language`` to *define* the kernels (their annotations), and
:data:`jit` leaves functions as they are.

Triton decides at decoration time whether a kernel runs compiled or in its interpreter
(``TRITON_INTERPRET=1``, CPU tensors): the variable must be set before the kernel modules are
imported. :data:`INTERPRET` records the mode the kernels were defined in.
"""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

try:  # triton is optional: the CPU engine never needs it
    import triton
    import triton.language as tl

    jit: Callable[..., Any] = triton.jit
    try:
        INTERPRET = bool(triton.knobs.runtime.interpret)
    except AttributeError:  # triton < 3.4: no knobs, the variable is read as it is here
        INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    INTERPRET = False

    class _TlStub:
        """Just enough of ``triton.language`` for kernel signatures to be defined."""

        constexpr = object

    tl = _TlStub()  # type: ignore[assignment]

    def jit(fn: Any = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda f: f)


def on_device(t: "torch.Tensor", device: "torch.device") -> "torch.Tensor":
    """``t`` on ``device`` (copied without blocking the host where it is elsewhere)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def available() -> bool:
    """True when triton imported. Running the kernels also needs a GPU, or
    ``TRITON_INTERPRET=1`` set before the kernel modules were imported (then they run on CPU
    tensors, slowly). Never raises."""
    return triton is not None


def require(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install triton)")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jit
def round_to(x, DTYPE: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in DTYPE (as torch and the GPU's ``cvt.rn`` do).

    EMULATE_RTNE: the interpreter of triton 3.x truncates fp32 -> bf16 conversions (it only
    handles fp16 through numpy), so under it bf16 is rounded with integer operations. Finite
    values only (NaN payloads may become inf). Compiled kernels pass False."""
    if EMULATE_RTNE and DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr, not Yoda)
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@jit
def dot(a, b, INTERP: tl.constexpr, PRECISION: tl.constexpr):
    """``a [M, K] @ b [K, N]`` accumulated in fp32.

    INTERP (the interpreter): an explicit product and a sum over ``k``, in fp32. The
    interpreter's ``tl.dot`` is numpy's matmul, whose BLAS kernels give a row different bits
    at different positions of the tile on some CPUs (OpenBLAS's Haswell kernels, which the
    AVX2-only EPYCs run: a row alone and the same row 8th of a 16-row tile differed in the
    last bit), so the batch invariance that the interpreted tests check would be the BLAS's,
    not the kernel's. Here every (row, column) gets the same operations in the same order
    (numpy reduces a middle axis slice by slice). bf16 operands are widened first: triton
    3.x's interpreter multiplies bf16 tiles as their raw uint16 bits (bf16 x bf16 products
    are exact in fp32). Compiled kernels pass False and use the tensor cores' ``tl.dot``."""
    if INTERP:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision=PRECISION)
