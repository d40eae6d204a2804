"""Triton paged attention (varlen queries, one launch; optional split-KV) and the KV write.

The attention of the ``triton`` kernel backend (:mod:`engine.backend`). It has the module
interface of :mod:`kernels.torch_attention` (``write_kv``, ``paged_attention``) and reads
the same :class:`kernels.attention_metadata.AttentionMetadata`, built on the host and sent
to the device in one copy per step, or living in a CUDA graph's static buffers.

Layout as in :mod:`kernels.attention_metadata`: ``kv_cache[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (0 = K, 1 = V), position ``p`` of sequence ``s`` in block
``block_tables[s, p // block_size]`` at offset ``p % block_size``; flat queries
``[num_tokens, num_heads, head_dim]``, sequence ``s`` owning rows
``query_start_loc[s]:query_start_loc[s + 1]``, which sit at the last ``q_len`` positions of
its ``seq_lens[s]``-token context and attend causally, or, in a tree-verification step,
as ``tree_mask`` says: row ``i`` of a sequence (``base = seq_len - q_len``) with a nonzero
mask sees the context ``[0, base)`` and position ``base + j`` for each set bit ``j`` of its
int64 mask (read as the unsigned 64-bit pattern; 0 = a causal row).

Kernels (see docs/kernels.md for the blocking):

* ``_paged_attention_kernel``: grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads,
  num_splits)``. A program takes ``BLOCK_Q`` consecutive query tokens of one sequence and
  all ``G = num_heads // num_kv_heads`` query heads that share one kv head, i.e. a
  ``[BLOCK_M = BLOCK_Q * G (padded), head_dim]`` tile, finds its sequence by binary search
  over ``query_start_loc`` (so the grid depends only on ``num_tokens`` and ``num_seqs``, not
  on the query lengths), then walks the block table in ``BLOCK_N``-position tiles with an
  online softmax in fp32 (exp2, scale folded into log2 e). With ``num_splits > 1`` (flash
  decoding) split ``i`` takes the ``i``-th share of those tiles and writes an fp32 partial
  output and its log-sum-exp; ``_reduce_splits_kernel`` combines them.
  Tree masks (constexpr ``HAS_TREE``, set only when ``meta.tree_mask`` is not None: without
  one the kernel compiles to the causal one, the mask pointer a stand-in never read): each
  row loads its mask once; inside the query region ``[base, seq_len)`` a key at position
  ``p`` stays visible only if bit ``p - base`` is set (on top of the causal test, which a
  valid mask never widens). The key range, the tiles and the splits stay the causal ones: a
  tree row's own position bounds what it sees, and a tile or split it sees nothing of is an
  exact no-op (it always sees itself somewhere).
* the KV write (``write_kv``, re-exported from :mod:`kernels.triton_kv_write`): one program
  per new token scatters its K and V rows into ``slot_mapping[token]``.

Importing this module never fails: without triton, :func:`available` is False and the entry
points raise. Triton reads ``TRITON_INTERPRET`` when the kernels are *defined* (at import),
so the interpreter (CPU tensors) must be switched on before this module is imported.
"""

# No ``from __future__ import annotations`` in the kernel modules: triton reads the
# ``tl.constexpr`` annotations of the kernels' parameters.
import math

import torch

from quickdraft.kernels.attention_metadata import AttentionMetadata
from quickdraft.kernels.triton_common import (
    INTERPRET,
    available,
    dot,
    jit,
    next_pow2,
    on_device,
    require,
    round_to,
    tl,
)
from quickdraft.kernels.triton_kv_write import write_kv

__all__ = [
    "AttentionMetadata",
    "attention_config",
    "available",
    "choose_num_splits",
    "interpreting",
    "paged_attention",
    "paged_attention_varlen",
    "write_kv",
]

# Steps whose (query tokens per sequence) * (query heads per kv head) fit in this many rows
# use decode-sized query tiles; others use _PREFILL_BLOCK_M.
_DECODE_BLOCK_M = 16
_PREFILL_BLOCK_M = 64
_BLOCK_N = 32
_MAX_SPLITS = 16
# split-KV heuristic: only when each split still gets this many positions ...
_MIN_POSITIONS_PER_SPLIT = 256
# ... and the unsplit grid has fewer programs than this (about 2 waves on an H100's 132 SMs).
_SPLIT_BELOW_PROGRAMS = 256
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """Whether the kernels were defined under the Triton interpreter (they take CPU tensors)."""
    return INTERPRET


# ----------------------------------------------------------------------------------------------
# kernels


@jit
def _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain ``q_block_id``. Sequence ``s`` owns blocks
    ``[qsl[s] // BLOCK_Q + s, ...)``: that start is strictly increasing in ``s`` and leaves
    room for ``cdiv(q_len, BLOCK_Q)`` blocks, so the owner is the last ``s`` whose start is
    ``<= q_block_id``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    tree_mask_ptr,  # [num_tokens] int64 ancestor bitmasks; read only when HAS_TREE
    qk_scale,  # softmax scale * log2(e)
    num_seqs, num_splits, block_size,
    stride_qt, stride_qh, stride_qd,
    stride_kv, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_ot, stride_oh, stride_os, stride_od,  # stride_os: the split axis (partials only)
    stride_lt, stride_lh, stride_ls,
    stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_TREE: tl.constexpr, INTERP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    prefix = ctx - q_len  # positions cached before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    q_tok = rows // G
    head = kv_head * G + rows % G
    q_local = q_block * BLOCK_Q + q_tok
    row_ok = (q_tok < BLOCK_Q) & (q_local < q_len)
    q_pos = prefix + q_local  # absolute position: sees keys at positions <= q_pos
    token = (q_start + q_local).to(tl.int64)

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_TREE:
        # 0: a causal row (also every padding row); else bit j = query row j is visible
        tree = tl.load(tree_mask_ptr + token, mask=row_ok, other=0)  # [BLOCK_M] int64
        tree_row = tree != 0

    # keys visible to the last query of this block, as whole BLOCK_N tiles
    kv_end = tl.minimum(ctx, prefix + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        per_split = tl.cdiv(n_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    else:
        tile_lo = 0
        tile_hi = n_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + cols
        pos_ok = pos < kv_end
        block = tl.load(bt_row + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
        base = block * stride_kb + (pos % block_size) * stride_ks + kv_head_off
        kv_mask = pos_ok[None, :] & d_ok[:, None]
        k = tl.load(kv_ptr + base[None, :] + d[:, None] * stride_kd, mask=kv_mask,
                    other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :] * stride_kd,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = dot(q, k, INTERP, PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if HAS_TREE:
            # a tree row sees [0, prefix) and the query rows whose bits it has; its mask has
            # no bit above its own row, so that is a subset of the causal set kept above.
            # The shift is clamped to [0, 63] (sign extension of bit 63 never reaches bit 0)
            rel = pos - prefix
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            bit = ((tree[:, None] >> shift[None, :]) & 1) != 0
            visible = visible & (~tree_row[:, None] | (rel < 0)[None, :] | bit)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key yet (possible in a split) keeps m = -inf:
        # subtract 0 instead so that exp2 gives 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(round_to(p, v.dtype, INTERP), v, INTERP, PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    if SPLIT:
        empty = l_i == 0.0  # no visible key in this split
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(out_ptr + o_offs + split * stride_os, acc, mask=out_mask)
        # log-sum-exp in the log2 domain; -inf for an empty split (weight 0 in the reduce)
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split * stride_ls, lse,
                 mask=row_ok)
    else:
        # a row that sees no key at all (only a CUDA graph's padding rows) gives 0, not NaN
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + o_offs, round_to(acc, out_ptr.dtype.element_ty, INTERP),
                 mask=out_mask)


@jit
def _reduce_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_pd,
    stride_lt, stride_lh, stride_ls,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One (token, head): ``sum_i w_i o_i / sum_i w_i`` with ``w_i = 2^(lse_i - max lse)``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < num_splits
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + sp * stride_ls, mask=sp_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    part = tl.load(part_ptr + token * stride_pt + head * stride_ph + sp[:, None] * stride_ps
                   + d[None, :] * stride_pd, mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # no key at all: 0
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
             round_to(o, out_ptr.dtype.element_ty, INTERP), mask=d_ok)


# ----------------------------------------------------------------------------------------------
# entry points


def attention_config(dtype: torch.dtype, head_dim: int, group: int, max_query_len: int,
                     block_m: int | None = None, block_n: int | None = None) -> dict:
    """The compile-time parameters of ``_paged_attention_kernel`` (and launch options) for a
    step: ``BLOCK_M`` query rows (``BLOCK_Q`` tokens x ``group`` heads) per program, decode-
    sized when the longest query fits, ``BLOCK_N`` positions per KV tile.

    Chosen from register counts of the compiled kernel (sm_80/sm_90 with triton 3.9, no
    spills), not from timings: fp32 (exact fp32 dots, no tensor cores: a correctness path)
    keeps 16-row tiles, and large tiles get 8 warps. To be autotuned on a GPU."""
    group_pad = next_pow2(group)
    if block_m is None:
        small = max_query_len * group <= _DECODE_BLOCK_M or dtype == torch.float32
        block_m = _DECODE_BLOCK_M if small else _PREFILL_BLOCK_M
    block_m = max(block_m, group_pad, 16)
    block_n = block_n or _BLOCK_N
    head_pad = max(16, next_pow2(head_dim))
    big = block_m * head_pad >= 64 * 128 or (dtype == torch.float32 and head_pad >= 128)
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_pad, G=group, BLOCK_M=block_m,
                BLOCK_Q=block_m // group, BLOCK_N=block_n, INTERP=INTERPRET,
                PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=8 if big else 4, num_stages=2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_programs: int | None = None) -> int:
    """Split-KV only pays when the unsplit grid is too small to fill the GPU (few sequences,
    decode-sized queries) and the contexts are long. A first guess, not tuned on hardware."""
    programs = num_programs if num_programs is not None else num_seqs * num_kv_heads
    if max_query_len > _DECODE_BLOCK_M or programs >= _SPLIT_BELOW_PROGRAMS:
        return 1
    by_length = max_seq_len // _MIN_POSITIONS_PER_SPLIT
    by_grid = _SPLIT_BELOW_PROGRAMS // max(programs, 1)
    return max(1, min(_MAX_SPLITS, by_length, by_grid))


def paged_attention_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], any strides
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    *,
    max_query_len: int,
    num_splits: int = 1,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64 ancestor bitmasks
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query's dtype
    """Tensor-level entry point; all tensors on the same device. ``max_query_len`` only picks
    the query tile (any upper bound of the longest query is correct). ``tree_mask``: the
    rows' ancestor bitmasks as :mod:`kernels.attention_metadata` defines them (not checked
    here: :func:`kernels.attention_metadata.check_tree_mask`); None compiles and runs the
    plain causal kernel."""
    require("quickdraft.kernels.triton_attention")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache "
                         f"{tuple(kv_cache.shape)}")
    if query.dtype != kv_cache.dtype or query.dtype not in _DTYPES:
        raise TypeError(f"query {query.dtype} and kv_cache {kv_cache.dtype}: expected one of "
                        f"{sorted(map(str, _DTYPES))} for both")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if tree_mask is not None:
        if tree_mask.dtype != torch.int64 or tuple(tree_mask.shape) != (num_tokens,):
            raise ValueError(f"tree_mask {tree_mask.dtype} {tuple(tree_mask.shape)}: expected "
                             f"int64 [{num_tokens}]")
        tree_mask = on_device(tree_mask, query.device)
        if tree_mask.stride(0) != 1:
            tree_mask = tree_mask.contiguous()
    # the mask pointer is never read without HAS_TREE: any tensor stands in for it
    mask_arg = tree_mask if tree_mask is not None else seq_lens
    has_tree = tree_mask is not None
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    common = attention_config(query.dtype, head_dim, group, max_query_len, block_m, block_n)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype,
                          device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    grid = (num_tokens // common["BLOCK_Q"] + num_seqs, num_kv_heads, max(1, num_splits))
    qk_scale = scale * math.log2(math.e)
    if num_splits <= 1:
        _paged_attention_kernel[grid](
            query, kv_cache, out, out, block_tables, seq_lens, query_start_loc, mask_arg,
            qk_scale, num_seqs, 1, kv_cache.shape[2],
            *query.stride(), *kv_cache.stride(),
            out.stride(0), out.stride(1), 0, out.stride(2),
            0, 0, 0, block_tables.stride(0), SPLIT=False, HAS_TREE=has_tree, **common)
        return out
    part = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                       device=query.device)
    lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                      device=query.device)
    _paged_attention_kernel[grid](
        query, kv_cache, part, lse, block_tables, seq_lens, query_start_loc, mask_arg,
        qk_scale, num_seqs, num_splits, kv_cache.shape[2],
        *query.stride(), *kv_cache.stride(),
        part.stride(0), part.stride(1), part.stride(2), part.stride(3),
        *lse.stride(), block_tables.stride(0), SPLIT=True, HAS_TREE=has_tree, **common)
    _reduce_splits_kernel[(num_tokens, num_heads)](
        part, lse, out, num_splits, *part.stride(), *lse.stride(), *out.stride(),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        SPLITS_PAD=max(2, next_pow2(num_splits)), INTERP=INTERPRET)
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,  # its tensors on the query's device
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """:func:`kernels.torch_attention.paged_attention` in one launch (two with split-KV),
    honouring ``meta.tree_mask``. ``num_splits``: None takes ``meta.num_splits``, else picks
    with :func:`choose_num_splits`; 1 = no split."""
    if num_splits is None:
        num_splits = meta.num_splits
    if num_splits is None:
        num_splits = choose_num_splits(meta.num_seqs, kv_cache.shape[3], meta.max_query_len,
                                       meta.max_seq_len)
    return paged_attention_varlen(
        query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        max_query_len=meta.max_query_len, num_splits=num_splits, block_m=block_m,
        block_n=block_n, tree_mask=meta.tree_mask)
