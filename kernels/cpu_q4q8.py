"""Linear layers on 4-bit weights times 8-bit activations (llama.cpp's Q4_1 x Q8 scheme).

``cpu_q4q8.c`` computes ``x @ w.T`` for ``w[n, k] = d[n, g] · q[n, k] + m[n, g]`` (``g = k //
32``, a GGUF Q4_0/Q4_1/Q4_K block) after rounding each row of ``x`` to int8 in blocks of 32
(``x ≈ sx · xq``, ``sx = max|x| / 127``): every block's dot product is exact integer arithmetic
and each 4-bit block is unpacked once for all the rows of ``x`` in a pass (up to 16). So an
extra row costs a few integer instructions per block instead of another pass through
torch's int4 kernel: verifying drafts gets cheap. Rounding the activations costs about as
much accuracy as rounding the scales to bf16 does on the torch path (``tests/kernels/
test_cpu_q4q8.py`` states the tolerance; ``tests/engine/test_int4_weights.py`` the model-level
agreement).

The scales are kept as fp16 (exact for Q4_0/Q4_1, whose scales are fp16 in the file; Q4_K's
products of two scales are rounded to 11 bits, finer than the torch path's bf16). Every
output element is computed by the same instructions in the same order whatever the row
count, thread count and instruction set (AVX512-VNNI ``vpdpbusd`` or plain AVX2: the same
integers), so a request's result does not depend on its batch, on speculation or on the CPU
kind. Built with gcc on first use like the other C kernels (:mod:`kernels.cbuild`); without
gcc or AVX2/FMA/F16C :func:`available` is False.

Where the CPU has AMX-INT8 (Intel Sapphire Rapids and later) the VNNI loops hand passes of
many rows (a prefill's 16, a batch's verification) to AMX tile multiplies
(``cpu_q4q8_amx.h``; the same integers, so the same bits): from how many rows is measured
once per process at load (:func:`amx_rows`), where AMX beats the VNNI loop; fewer rows stay
on VNNI, whose per-block cost is lower (a block's tile work has a fixed latency).

Where the CPU has AVX512-VNNI, :func:`pack` and :func:`pack_q6` store the 4- and 6-bit
matrices' groups of 8 output columns in pairs, so that their loops take 16 columns a 512-bit
vector (``cpu_q4q8_wide.h``, ``cpu_q4q8_six.h``); elsewhere unpaired, which the AVX2 loops
read faster. Either layout gives the same bits on either loop (the weight's ``paired`` tells
the kernel which it reads).

LM heads run on the file's own 8-bit (``Q8_0``, :func:`pack_q8`) or 6-bit (``Q6_K``, codes
-32..31 with an int8 scale per 16 weights and an fp16 one per 256, :func:`pack_q6`) blocks
against the same 8-bit rows of ``x``, and so do Q6_K layer matrices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.kernels import cbuild, q4q8_layout
from quickdraft.kernels.q4q8_layout import (
    COLUMNS,
    GROUP,
    LAYER_WEIGHTS,
    WEIGHTS,
    Q4KQ8Weight,
    Q4Q8Weight,
    Q6Q8Weight,
    Q8Q8Weight,
    pack_q4k,
    pack_q8,
    supports,
)

# the layouts (kernels.q4q8_layout) are this module's public API too
__all__ = ["AMX_ROWS4_SHIFT", "AMX_ROWS8_SHIFT", "COLUMNS", "GROUP", "LAYER_WEIGHTS",
           "LOOP_AMX", "LOOP_VNNI", "PAIRED", "WEIGHTS", "Q4KQ8Weight", "Q4Q8Weight",
           "Q6Q8Weight", "Q8Q8Weight", "amx_rows", "available", "linear", "native_entry_points",
           "native_flags", "native_parts", "pack", "pack_layer", "pack_q4k", "pack_q6",
           "pack_q8", "pairs_columns", "scratch_bytes", "supports", "uses_amx", "uses_vnni"]

LOOP_VNNI, PAIRED, LOOP_AMX = 1, 2, 4  # the kernel's flags (cpu_q4q8.c): loop, layout, AMX
AMX_ROWS4_SHIFT, AMX_ROWS8_SHIFT = 8, 13  # with LOOP_AMX: fewest rows on AMX (4-bit, Q8_0)

_SOURCE = Path(__file__).with_name("cpu_q4q8.c")
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC",
           "-shared")
_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
_VNNI_FLAGS = frozenset({"avx512f", "avx512vl", "avx512_vnni"})
_AMX_FLAGS = _VNNI_FLAGS | {"avx512bw", "amx_tile", "amx_int8"}
_AMX_TRIAL_ROWS = (4, 6, 8, 10, 12, 16)  # pass sizes timed at load, AMX against VNNI
log = logging.getLogger(__name__)
_BF16 = torch.bfloat16


@dataclass(frozen=True)
class _Kernels:
    q4: Any  # ctypes qd_q4q8_linear
    q8: Any  # ctypes qd_q8q8_linear
    q6: Any  # ctypes qd_q6q8_linear
    q4k: Any  # ctypes qd_q4kq8_linear
    vnni: int  # whether to run the VNNI loops
    q8_f32: Any  # ctypes qd_q8q8_linear_f32
    q6_f32: Any  # ctypes qd_q6q8_linear_f32
    amx_ok: bool  # the CPU has AMX-INT8 and Linux lets this process use it
    amx: tuple[int, int]  # fewest rows a pass runs on AMX: 4-bit, Q8_0 weights (0: never)


@functools.lru_cache(maxsize=1)
def _kernel() -> _Kernels | None:
    """The library's entry points, whether to use their VNNI loops, and whether and from how
    many rows their AMX loops run (measured here once: :func:`_amx_thresholds`)."""
    lib = cbuild.load("cpu_q4q8", _SOURCE, _CFLAGS, _CPU_FLAGS)
    if lib is None:
        return None
    # (x, codes, d, [m,] y) pointers, then rows, n, k, threads, flags, then scratch
    for fn, pointers in ((lib.qd_q4q8_linear, 5), (lib.qd_q8q8_linear, 4),
                         (lib.qd_q6q8_linear, 5), (lib.qd_q4kq8_linear, 5)):
        fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int] * 5 + [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    # the same with an fp32 copy of y after it
    for fn, pointers in ((lib.qd_q8q8_linear_f32, 5), (lib.qd_q6q8_linear_f32, 6)):
        fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int] * 5 + [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    kernels = _Kernels(lib.qd_q4q8_linear, lib.qd_q8q8_linear, lib.qd_q6q8_linear,
                       lib.qd_q4kq8_linear, int(cbuild.cpu_has(_VNNI_FLAGS)),
                       lib.qd_q8q8_linear_f32, lib.qd_q6q8_linear_f32, False, (0, 0))
    if not (kernels.vnni and cbuild.cpu_has(_AMX_FLAGS)) or not lib.qd_amx_enable():
        return kernels
    return dataclasses.replace(kernels, amx_ok=True, amx=_amx_thresholds(kernels))


def _amx_thresholds(kernels: _Kernels) -> tuple[int, int]:
    """From how many rows a pass runs on AMX, for 4-bit and Q8_0 weights: ``QUICKDRAFT_AMX``
    (``off``, or a row count for both) if set, else measured here: a SmolLM2-sized matrix of
    each kind timed on both loops at each of _AMX_TRIAL_ROWS (arms alternating, the fastest
    of 5), the fewest rows from which AMX is at least 3 % faster at every size timed (~40 ms
    at load, once per process)."""
    forced = os.environ.get("QUICKDRAFT_AMX", "").strip().lower()
    if forced in ("off", "0"):
        return 0, 0
    if forced.isdigit():
        rows = min(int(forced), 16)
        return rows, rows
    if forced:
        log.warning("QUICKDRAFT_AMX=%s is neither off nor a row count; ignored", forced)
    g = torch.Generator().manual_seed(0)
    q4 = pack(torch.randint(0, 16, (1536, 576), generator=g), torch.rand(1536, 18, generator=g),
              torch.rand(1536, 18, generator=g), paired=True)
    q8 = pack_q8(torch.randint(-127, 128, (4096, 576), generator=g),
                 torch.rand(4096, 18, generator=g))
    found = []
    for weight, shift in ((q4, AMX_ROWS4_SHIFT), (q8, AMX_ROWS8_SHIFT)):
        wins = []
        for rows in _AMX_TRIAL_ROWS:
            x = torch.randn(rows, 576, generator=g).bfloat16()
            best = [float("inf"), float("inf")]
            for _ in range(5):
                for arm, flags in enumerate((0, LOOP_AMX | 1 << shift)):
                    start = time.perf_counter()
                    _call(kernels, x, weight, _flags(1, weight is q4) | flags)
                    best[arm] = min(best[arm], time.perf_counter() - start)
            wins.append(best[1] < 0.97 * best[0])
        first = next((i for i in range(len(wins)) if all(wins[i:])), None)
        found.append(0 if first is None else _AMX_TRIAL_ROWS[first])
    log.info("AMX loops from %d rows (4-bit) and %d rows (Q8_0); 0: never", *found)
    return found[0], found[1]


def available() -> bool:
    """True when the kernel is built and loaded. Never raises."""
    try:
        return _kernel() is not None
    except Exception:
        return False


def uses_vnni() -> bool:
    """Whether the kernel's inner loop is AVX512-VNNI here (else AVX2; same results)."""
    kernel = _kernel()
    return bool(kernel and kernel.vnni)


def pairs_columns() -> bool:
    """Whether :func:`pack` stores 4-bit column groups in pairs by default here: where the
    VNNI loops run, whose 16-column loop reads pairs (an AVX2-only CPU's 8-column loop reads
    unpaired weights 12-30 % faster, measured by running that loop on the AVX512-BF16 EPYC,
    so there they stay unpaired)."""
    return uses_vnni()


def uses_amx() -> bool:
    """Whether the AMX loops can run here (AMX-INT8, and Linux grants the tile state)."""
    kernel = _kernel()
    return bool(kernel and kernel.amx_ok)


def amx_rows() -> tuple[int, int]:
    """From how many rows a pass runs on AMX here, for 4-bit and for Q8_0 weights (0: never;
    (0, 0) where :func:`uses_amx` is False)."""
    kernel = _kernel()
    return kernel.amx if kernel else (0, 0)


def _flags(vnni: int, paired: bool, amx: tuple[int, int] = (0, 0)) -> int:
    flags = vnni * LOOP_VNNI | (PAIRED if paired else 0)
    if vnni and any(amx):
        flags |= LOOP_AMX | amx[0] << AMX_ROWS4_SHIFT | amx[1] << AMX_ROWS8_SHIFT
    return flags


def native_entry_points() -> tuple[int, int, int] | None:
    """For :mod:`kernels.cpu_layer`: the 4-bit, 6-bit and Q4_K entry points' addresses (the
    same arguments: x, codes, two scale tensors, y, rows, n, k, threads, flags, scratch)."""
    kernel = _kernel()
    if kernel is None:
        return None
    q4, q6, q4k = (ctypes.cast(fn, ctypes.c_void_p).value or 0
                   for fn in (kernel.q4, kernel.q6, kernel.q4k))
    return q4, q6, q4k


def native_parts(weight: Q4Q8Weight | Q6Q8Weight | Q4KQ8Weight,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For :mod:`kernels.cpu_layer`: (codes, d, m) of a 4-bit weight or (codes, sc, d) of a
    6-bit one, packed the default way (the layout :func:`native_flags` tells the op), or
    (codes, sm, dd) of a Q4_K one (the op tells them apart by the second tensor's dtype:
    fp16, int8, uint8)."""
    if isinstance(weight, Q4KQ8Weight):
        return weight.codes, weight.sm, weight.dd
    if weight.paired != pairs_columns():
        raise ValueError("the native layer takes q4q8 weights packed the default way")
    if isinstance(weight, Q6Q8Weight):
        return weight.codes, weight.sc, weight.d
    return weight.codes, weight.d, weight.m


def native_flags(vnni: bool | None = None) -> int:
    """For :mod:`kernels.cpu_layer`: the kernel's flags for weights packed the default way
    (:func:`pairs_columns`), on this CPU's loop (None) or the AVX2 one (False)."""
    kernel = _kernel()
    if kernel is None:
        return 0
    return _flags(kernel.vnni if vnni is None else int(vnni), pairs_columns(), kernel.amx)


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, *,
         paired: bool | None = None) -> Q4Q8Weight:
    """:func:`kernels.q4q8_layout.pack`; ``paired`` None: :func:`pairs_columns` (either layout
    gives the same results on either loop)."""
    return q4q8_layout.pack(q, d, m, paired=pairs_columns() if paired is None else paired)


def pack_q6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, *,
            paired: bool | None = None) -> Q6Q8Weight:
    """:func:`kernels.q4q8_layout.pack_q6`; ``paired`` as :func:`pack`'s."""
    return q4q8_layout.pack_q6(q, d, sc, paired=pairs_columns() if paired is None else paired)


def pack_layer(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Q8Weight | Q4KQ8Weight:
    """A model's 4-bit layer matrix in the layout that runs fastest here: where the 4-bit
    weights are not paired (AVX2-only CPUs) and the scales are a Q4_K file's (every 8 blocks'
    ``d`` an fp16 times integers 0..63, and ``m`` likewise: :func:`pack_q4k`), the Q4_K
    layout (0.578 bytes a weight, products exact); else :func:`pack`'s (paired for the
    16-column VNNI loop where it runs; Q4_0/Q4_1 files)."""
    if not pairs_columns():
        k_weight = pack_q4k(q, d, m)
        if k_weight is not None:
            return k_weight
    return pack(q, d, m)



def scratch_bytes(rows: int, in_features: int) -> int:
    """Bytes of scratch the kernel needs for ``rows`` rows (int8 x, block scales, sums)."""
    return rows * (in_features + 8 * (in_features // GROUP))


def linear(x: torch.Tensor, weight: Q4Q8Weight | Q8Q8Weight | Q6Q8Weight | Q4KQ8Weight, *,
           vnni: bool | None = None, amx_rows: int | None = None,
           float_out: bool = False) -> torch.Tensor:
    """``x @ w.T``: x ``[rows, in]`` (any float dtype; read as bf16) -> ``[rows, out]`` in
    x's dtype. ``vnni`` forces the inner loop (None: VNNI where the CPU has it; False runs
    the AVX2 loop of the other CPU kind; Q4_K weights have one loop, AVX2, which takes the
    VNNI flag on any CPU). ``amx_rows`` (with the VNNI loop): from how many rows a
    pass runs on AMX (None: :func:`amx_rows`; 0: never). ``float_out``: fp32 instead, the
    same values as the bf16 result's ``.float()`` (an LM head's logits), converted by the
    kernel's threads as they finish each column range (Q8_0 and Q6_K weights; others
    convert afterwards). Raises RuntimeError when the kernel is unavailable (check
    :func:`available`)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the q4q8 kernel is not available: "
                           f"{cbuild.status().get('cpu_q4q8', 'not loaded')}")
    if vnni and not kernel.vnni and not isinstance(weight, Q4KQ8Weight):
        raise RuntimeError("this CPU has no AVX512-VNNI")
    if amx_rows and not kernel.amx_ok:
        raise RuntimeError("this CPU (or its Linux) has no AMX-INT8")
    use_vnni = kernel.vnni if vnni is None else int(vnni)
    amx = kernel.amx if amx_rows is None else (amx_rows, amx_rows)
    xb = (x if x.dtype is _BF16 else x.to(_BF16)).contiguous()
    if xb.shape[-1] != weight.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a [{weight.out_features}, "
                         f"{weight.in_features}] weight")
    paired = isinstance(weight, Q4Q8Weight | Q6Q8Weight) and weight.paired
    y = _call(kernel, xb.view(-1, weight.in_features), weight,
              _flags(use_vnni, paired, amx), float_out)
    y = y if x.dim() == 2 else y.view(*x.shape[:-1], weight.out_features)
    out_dtype = torch.float32 if float_out else x.dtype
    return y if y.dtype is out_dtype else y.to(out_dtype)


def _call(kernel: _Kernels, xb: torch.Tensor,
          weight: Q4Q8Weight | Q8Q8Weight | Q6Q8Weight | Q4KQ8Weight, flags: int,
          float_out: bool = False) -> torch.Tensor:
    """The kernel on bf16 ``xb [rows, in]`` (contiguous) with ``flags``: bf16 ``[rows, out]``,
    or fp32 with ``float_out`` for Q8_0 and Q6_K weights (others: bf16 still)."""
    rows = xb.shape[0]
    y = torch.empty(rows, weight.out_features, dtype=_BF16)
    if rows == 0:  # (a step that samples no row: the LM head gets none)
        return y
    scratch = torch.empty(scratch_bytes(rows, weight.in_features), dtype=torch.uint8)
    shape = (rows, weight.out_features, weight.in_features, torch.get_num_threads(), flags)
    yf: torch.Tensor | None = None
    if float_out and isinstance(weight, Q8Q8Weight | Q6Q8Weight):
        yf = torch.empty(rows, weight.out_features, dtype=torch.float32)
        if isinstance(weight, Q8Q8Weight):
            rc = kernel.q8_f32(xb.data_ptr(), weight.codes.data_ptr(), weight.d.data_ptr(),
                               y.data_ptr(), yf.data_ptr(), *shape, scratch.data_ptr())
        else:
            rc = kernel.q6_f32(xb.data_ptr(), weight.codes.data_ptr(), weight.sc.data_ptr(),
                               weight.d.data_ptr(), y.data_ptr(), yf.data_ptr(), *shape,
                               scratch.data_ptr())
    elif isinstance(weight, Q8Q8Weight):
        rc = kernel.q8(xb.data_ptr(), weight.codes.data_ptr(), weight.d.data_ptr(),
                       y.data_ptr(), *shape, scratch.data_ptr())
    elif isinstance(weight, Q6Q8Weight):
        rc = kernel.q6(xb.data_ptr(), weight.codes.data_ptr(), weight.sc.data_ptr(),
                       weight.d.data_ptr(), y.data_ptr(), *shape, scratch.data_ptr())
    elif isinstance(weight, Q4KQ8Weight):
        rc = kernel.q4k(xb.data_ptr(), weight.codes.data_ptr(), weight.sm.data_ptr(),
                        weight.dd.data_ptr(), y.data_ptr(), *shape, scratch.data_ptr())
    else:
        rc = kernel.q4(xb.data_ptr(), weight.codes.data_ptr(), weight.d.data_ptr(),
                       weight.m.data_ptr(), y.data_ptr(), *shape, scratch.data_ptr())
    if rc != 0:
        raise ValueError(f"q4q8 kernel rejected shapes rows={rows} out="
                         f"{weight.out_features} in={weight.in_features}")
    return y if yf is None else yf
