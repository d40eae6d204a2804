"""The weight layouts of :mod:`kernels.cpu_q4q8` and how a GGUF file's blocks are packed into
them: pure torch, no native code (the kernel, its loops and which layout runs fastest on this
CPU are :mod:`kernels.cpu_q4q8`'s). The C source's header (``cpu_q4q8.c``) and the loops'
(``cpu_q4q8_wide.h``, ``cpu_q4q8_six.h``, ``cpu_q4q8_k.h``) describe the same layouts byte
by byte.

Every packer checks its shapes (ValueError, or None for :func:`pack_q4k` where the scales do
not factor as a Q4_K file's); codes are kept as they are and scales as fp16 (what that
rounds, per file format: :mod:`kernels.cpu_q4q8`'s docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
COLUMNS = 8  # output columns interleaved per block (one 32-bit lane each)


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
    ``cpu_q4q8_k.h``). Made by :func:`kernels.cpu_q4q8.pack_layer` where it pays."""

    codes: torch.Tensor  # [out/8, in/32, 4, 8, 4] uint8 (group, block, chunk j, column, byte)
    sm: torch.Tensor  # [out/8, in/32, 2, 8] uint8 (group, block, sc | mn, column)
    dd: torch.Tensor  # [out/8, in/256, 2, 8] fp16 (group, super-block, d | dm, column)
    out_features: int
    in_features: int


LAYER_WEIGHTS = (Q4Q8Weight, Q4KQ8Weight, Q6Q8Weight)  # what a model's layer matrix may be
WEIGHTS = (*LAYER_WEIGHTS, Q8Q8Weight)  # everything :func:`linear` takes



def supports(out_features: int, in_features: int) -> bool:
    """Shapes the kernel takes: ``out % 8 == 0`` and ``in % 32 == 0``."""
    return out_features > 0 and out_features % COLUMNS == 0 and in_features > 0 \
        and in_features % GROUP == 0


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, *, paired: bool) -> Q4Q8Weight:
    """From 4-bit codes ``q[out, in]`` (0..15) and per-32 ``d, m [out, in / 32]`` with
    ``w = d · q + m``; ``paired``: column groups in pairs (either layout gives the same
    results on either loop)."""
    out, k = q.shape
    if not supports(out, k) or d.shape != (out, k // GROUP) or m.shape != d.shape:
        raise ValueError(f"q4q8 weights need out % {COLUMNS} == 0, in % {GROUP} == 0 and "
                         f"[out, in/{GROUP}] scales; got q {tuple(q.shape)}, d "
                         f"{tuple(d.shape)}, m {tuple(m.shape)}")
    groups = k // GROUP
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


def pack_q6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, *, paired: bool) -> Q6Q8Weight:
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
    return Q6Q8Weight(_layout(codes, paired), _layout(scales, paired).view(cg, groups, 2, COLUMNS),
                      _layout(supers, paired), out, k, paired)
