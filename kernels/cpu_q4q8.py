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

from quickdraft.kernels import cbuild

GROUP = 32
COLUMNS = 8  # output columns interleaved per block (one 32-bit lane each)
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
class Q4Q8Weight:
    """A ``[out, in]`` matrix in the kernel's layout: per group of 8 output columns and block
    of 32 inputs, 4 chunks of [8 columns][4 bytes] codes and 8 scales; ``paired``: groups 2p
    and 2p + 1 stored side by side chunk by chunk (:func:`_pair_groups`), the tensors'
    shapes counting groups and blocks while their memory follows the paired order."""

    codes: torch.Tensor  # [out/8, in/32, 4, 8, 4] uint8 (group, block, chunk j, column, byte)
    d: torch.Tensor  # [out/8, in/32, 8] fp16 (column-interleaved block scales)
    m: torch.Tensor  # [out/8, in/32, 8] fp16 (block offsets)
    out_features: int
    in_features: int
    paired: bool  # column groups stored in pairs (else each alone)


@dataclass(frozen=True)
class Q8Q8Weight:
    """A ``[out, in]`` Q8_0 matrix (``w = d · q``, ``q`` int8) in the kernel's layout
    (:class:`Q4Q8Weight`'s with 8 chunks a block, groups never paired)."""

    codes: torch.Tensor  # [out/8, in/32, 8, 8, 4] int8 (group, block, chunk j, column, byte)
    d: torch.Tensor  # [out/8, in/32, 8] fp16 (column-interleaved block scales)
    out_features: int
    in_features: int


@dataclass(frozen=True)
class Q6Q8Weight:
    """A ``[out, in]`` matrix ``w = d · sc · q`` (a GGUF ``Q6_K`` matrix: ``q`` in -32..31, an
    int8 ``sc`` per 16 inputs, an fp16 ``d`` per 256) in the kernel's layout:
    codes ``u = q + 32`` (0..63, unsigned for ``vpmaddubsw``) in 6 bits: per block of a
    column group 4 chunks of low nibbles (as :class:`Q4Q8Weight`'s) and 2 of top bit pairs
    (the layout in ``cpu_q4q8_six.h``), per block the 8 columns' ``sc`` of its
    first 16 inputs, then of its last 16, and per 8 blocks the 8 columns' ``d``."""

    codes: torch.Tensor  # [out/8, in/32, 6, 8, 4] uint8 (group, block, chunk, col, byte)
    sc: torch.Tensor  # [out/8, in/32, 2, 8] int8 (group, block, half, column)
    d: torch.Tensor  # [out/8, ceil(in/256), 8] fp16 (group, super-block, column)
    out_features: int
    in_features: int
    paired: bool  # column groups stored in pairs, as Q4Q8Weight's (else each alone)


@dataclass(frozen=True)
class Q4KQ8Weight:
    """A ``[out, in]`` 4-bit matrix ``w = (d · sc) · q + (dm · mn)`` with a GGUF ``Q4_K``
    file's own scales: a 6-bit ``sc`` and ``mn`` per 32 inputs (bytes here), an fp16 ``d`` and
    ``dm`` (= −dmin) per 256; :class:`Q4Q8Weight`'s codes, unpaired (the layout in
    ``cpu_q4q8_k.h``). Made by :func:`pack_layer` where it pays."""

    codes: torch.Tensor  # [out/8, in/32, 4, 8, 4] uint8 (group, block, chunk j, column, byte)
    sm: torch.Tensor  # [out/8, in/32, 2, 8] uint8 (group, block, sc | mn, column)
    dd: torch.Tensor  # [out/8, in/256, 2, 8] fp16 (group, super-block, d | dm, column)
    out_features: int
    in_features: int


LAYER_WEIGHTS = (Q4Q8Weight, Q4KQ8Weight, Q6Q8Weight)  # what a model's layer matrix may be
WEIGHTS = (*LAYER_WEIGHTS, Q8Q8Weight)  # everything :func:`linear` takes


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


def supports(out_features: int, in_features: int) -> bool:
    """Shapes the kernel takes: ``out % 8 == 0`` and ``in % 32 == 0``."""
    return out_features > 0 and out_features % COLUMNS == 0 and in_features > 0 \
        and in_features % GROUP == 0


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, *,
         paired: bool | None = None) -> Q4Q8Weight:
    """From 4-bit codes ``q[out, in]`` (0..15) and per-32 ``d, m [out, in / 32]`` with
    ``w = d · q + m``; ``paired`` None: :func:`pairs_columns` (either layout gives the same
    results on either loop)."""
    out, k = q.shape
    if not supports(out, k) or d.shape != (out, k // GROUP) or m.shape != d.shape:
        raise ValueError(f"q4q8 weights need out % {COLUMNS} == 0, in % {GROUP} == 0 and "
                         f"[out, in/{GROUP}] scales; got q {tuple(q.shape)}, d "
                         f"{tuple(d.shape)}, m {tuple(m.shape)}")
    groups = k // GROUP
    paired = pairs_columns() if paired is None else paired
    return Q4Q8Weight(_layout(_codes4(q), paired), _scales(d, out, groups, paired),
                      _scales(m, out, groups, paired), out, k, paired)


def _codes4(q: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` codes 0..15 -> ``[out/8, in/32, 4, 8, 4]`` (group, block, chunk, col,
    byte): low nibbles k = 32g + 4j .. +3, high nibbles k = 32g + 16 + 4j .. +3."""
    out, k = q.shape
    # [col group, column, block, half (k 0-15 | 16-31), chunk j, byte b]
    q6 = q.to(torch.uint8).reshape(out // COLUMNS, COLUMNS, k // GROUP, 2, 4, 4)
    byte = q6[:, :, :, 0] | (q6[:, :, :, 1] << 4)  # [cg, col, g, j, b]
    return byte.permute(0, 2, 3, 1, 4).contiguous()  # [cg, g, j, col, b]


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


def pack_q4k(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4KQ8Weight | None:
    """From codes ``q[out, in]`` (0..15) and per-32 ``d, m [out, in / 32]`` (``w = d · q + m``)
    whose every 8 blocks' ``d`` are one fp16 times integers 0..63, and their ``m`` likewise
    (a Q4_K file's ``d · sc`` and ``−dmin · mn``, :mod:`engine.gguf_quant`): the Q4_K layout,
    the same weights exactly. None when the scales do not factor so or ``in % 256 != 0``."""
    out, k = q.shape
    if not supports(out, k) or k % 256 or d.shape != (out, k // GROUP) or m.shape != d.shape:
        return None
    d_factors, m_factors = _factor_scales(d.float()), _factor_scales(m.float())
    if d_factors is None or m_factors is None:
        return None
    (dd, sc), (dm, mn) = d_factors, m_factors
    cg = out // COLUMNS
    # [out, blocks] -> [cg, blocks, col]; [out, supers] -> [cg, supers, col]
    by_block = [t.reshape(cg, COLUMNS, -1).permute(0, 2, 1) for t in (sc, mn)]
    by_super = [t.reshape(cg, COLUMNS, -1).permute(0, 2, 1) for t in (dd, dm)]
    return Q4KQ8Weight(_codes4(q), torch.stack(by_block, dim=2).to(torch.uint8).contiguous(),
                       torch.stack(by_super, dim=2).to(torch.float16).contiguous(), out, k)


def _factor_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``s [out, blocks]`` as ``D [out, blocks / 8]`` (fp16 values) times ``c [out, blocks]``
    (integers 0..63), exactly, per 8 blocks; None if some 8 do not factor so. Tries ``D =
    s_top / c_top`` (s_top: the 8 blocks' largest magnitude) for c_top = 63 down to 1: a Q4_K
    file's own D and c are among the candidates, and any exact factor gives the same
    products."""
    out, blocks = s.shape
    sb = s.reshape(out, blocks // 8, 8)
    top = sb.gather(-1, sb.abs().argmax(-1, keepdim=True))  # [out, supers, 1]
    found = top == 0  # all-zero super-blocks: D = 0, c = 0
    big_d = torch.zeros_like(top)
    c = torch.zeros_like(sb)
    for c_top in range(63, 0, -1):
        if bool(found.all()):
            break
        cand = top / c_top
        ratio = torch.round(sb / cand)
        ok = (cand.half().float() == cand) & ((ratio >= 0) & (ratio <= 63)
                                              & (ratio * cand == sb)).all(-1, keepdim=True)
        take = ok & ~found
        big_d = torch.where(take, cand, big_d)
        c = torch.where(take, ratio, c)
        found |= take
    if not bool(found.all()):
        return None
    return big_d.reshape(out, -1), c.reshape(out, blocks)


def _scales(s: torch.Tensor, out: int, groups: int, paired: bool) -> torch.Tensor:
    """``[out, in/32]`` -> ``[out/8, in/32, 8]`` fp16, column-interleaved (and paired)."""
    return _layout(s.to(torch.float16).reshape(out // COLUMNS, COLUMNS, groups)
                   .permute(0, 2, 1), paired)


def _layout(t: torch.Tensor, paired: bool) -> torch.Tensor:
    return _pair_groups(t) if paired else t.contiguous()


def _pair_groups(t: torch.Tensor) -> torch.Tensor:
    """``t [col groups, blocks, (chunks,) 8 columns, (bytes)]`` (codes or scales) in the
    kernel's memory order: groups 2p and 2p + 1 side by side per block and chunk, i.e. pair
    p as ``[blocks, (chunks,) 2, 8, (bytes)]``, so that one 64-byte load reads a chunk of 16
    columns (cpu_q4q8_wide.h); an odd last group stays alone. Same shape as ``t``: group
    cg's data still starts at ``cg`` groups' worth."""
    col_axis = t.dim() - 2 if t.dim() > 3 else t.dim() - 1
    pairs = t.shape[0] // 2
    paired = t[:2 * pairs].reshape(pairs, 2, *t.shape[1:]).movedim(1, col_axis)
    return torch.cat([paired.reshape(-1), t[2 * pairs:].reshape(-1)]).view(t.shape)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> Q8Q8Weight:
    """From Q8_0 codes ``q[out, in]`` (int8) and per-32 scales ``d [out, in / 32]`` with
    ``w = d · q``."""
    out, k = q.shape
    if not supports(out, k) or d.shape != (out, k // GROUP):
        raise ValueError(f"q8q8 weights need out % {COLUMNS} == 0, in % {GROUP} == 0 and "
                         f"[out, in/{GROUP}] scales; got q {tuple(q.shape)}, d "
                         f"{tuple(d.shape)}")
    groups = k // GROUP
    # [col group, column, block, chunk j, byte b] -> [cg, g, j, col, b]
    q5 = q.to(torch.int8).reshape(out // COLUMNS, COLUMNS, groups, 8, 4)
    codes = q5.permute(0, 2, 3, 1, 4).contiguous()
    return Q8Q8Weight(codes, _scales(d, out, groups, paired=False), out, k)


def pack_q6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, *,
            paired: bool | None = None) -> Q6Q8Weight:
    """From Q6_K codes ``q[out, in]`` (-32..31), per-256 ``d [out, ceil(in / 256)]`` (fp16
    values) and per-16 int8 ``sc [out, in / 16]`` with ``w = d · sc · q``
    (:class:`engine.gguf_quant.Q6Weight`); ``paired`` as :func:`pack`'s."""
    out, k = q.shape
    if not supports(out, k) or sc.shape != (out, k // 16) or d.shape != (out, -(-k // 256)):
        raise ValueError(f"q6q8 weights need out % {COLUMNS} == 0, in % {GROUP} == 0, "
                         f"[out, in/16] sc and [out, ceil(in/256)] d; got q {tuple(q.shape)}, "
                         f"sc {tuple(sc.shape)}, d {tuple(d.shape)}")
    if q.numel() and (int(q.min()) < -32 or int(q.max()) > 31):
        raise ValueError("q6q8 codes must be in -32..31")
    groups, cg = k // GROUP, out // COLUMNS
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(cg, COLUMNS, groups, 8, 4)
    u = u.permute(0, 2, 3, 1, 4)  # [cg, g, j, col, b]: k = 32 g + 4 j + b
    low, top = u & 15, u >> 4
    nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)  # [cg, g, 4, col, b]
    top_bits = torch.stack([top[:, :, 4 * h] | (top[:, :, 4 * h + 1] << 2)
                            | (top[:, :, 4 * h + 2] << 4) | (top[:, :, 4 * h + 3] << 6)
                            for h in range(2)], dim=2)  # [cg, g, 2, col, b]
    codes = torch.cat([nibbles, top_bits], dim=2)  # [cg, g, 6, col, b]
    # [cg, col, g, half] -> [cg, g, half, col, 1] (the 1: _pair_groups's byte axis)
    scales = sc.to(torch.int8).reshape(cg, COLUMNS, groups, 2, 1).permute(0, 2, 3, 1, 4)
    supers = d.to(torch.float16).reshape(cg, COLUMNS, -1).permute(0, 2, 1)  # [cg, sb, col]
    paired = pairs_columns() if paired is None else paired
    return Q6Q8Weight(_layout(codes, paired), _layout(scales, paired).view(cg, groups, 2, COLUMNS),
                      _layout(supers, paired), out, k, paired)


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
