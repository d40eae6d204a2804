"""The torch attention backend: attention over a paged KV cache in plain torch, or the C
kernel for bf16 on a CPU.

One call serves a whole step (:class:`kernels.attention_metadata.AttentionMetadata`, the
layout and slot rule are there): every sequence brings its own number of new query tokens
(a prefill chunk, one decode token, or k+1 verification tokens) and attends, causally within
those new tokens, to everything cached before them plus themselves. With a ``meta.tree_mask``
(tree verification), a row with a nonzero mask sees the context before the new tokens plus
only the new rows whose bits it sets (its ancestors and itself), on every path below.

Every bf16 step on the CPU goes to the C kernel (:mod:`kernels.cpu_attention`; prefill,
verification and decode rows alike), which computes each token exactly as a lone decode
query: a token's result never depends on its batch, and that step never plans groups. The
torch path serves fp32 (the HF-exact oracle) and the rest: its per-step work (which tokens
attend to which slots, the masks) is planned once per step, on first use, by
:func:`plan_attention` on the host, and reused by every layer; each layer then does one
gather of K/V and one ``scaled_dot_product_attention`` per group of sequences. A sequence
with tree rows is planned like any other; only its rows of the group's boolean mask change
(read from the mask's host copy, once per step), so a step without a tree mask plans exactly
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quickdraft.kernels import cpu_attention
from quickdraft.kernels.attention_metadata import AttentionMetadata, slots_of

__all__ = ["AttentionMetadata", "paged_attention", "plan_attention", "write_kv",
           "write_kv_and_attend"]

# Sequences with at most this many new tokens are padded into one batched group;
# longer ones (prefill chunks) are attended one by one.
SMALL_QUERY_MAX = 16
# bf16 decode over at least this many cached tokens uses explicit fp32 math (see _attend_fn).
LONG_CONTEXT = 384


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together by one SDPA call."""

    token_rows: torch.Tensor | None  # [b, max_q] int64 rows of the step's tokens; None = contiguous
    first_row: int  # when contiguous: the group's tokens are rows [first_row, first_row + b*max_q)
    valid_rows: torch.Tensor | None  # [n_valid] positions in the flattened [b*max_q] that are real
    kv_slots: torch.Tensor  # [b, max_ctx] int64 cache slots (padded with 0)
    mask: torch.Tensor | None  # [b, 1, max_q, max_ctx] bool, True = attend; None = no mask needed
    is_causal: bool  # fresh prefill of one sequence: SDPA may use its own causal mask instead
    batch: int
    max_q: int


def _context_slots(block_table: torch.Tensor, ctx: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``[0, ctx)`` given a host ``[max_blocks]`` int32 block table."""
    slots = slots_of(block_table.numpy().astype(np.int64), np.arange(ctx), block_size)
    return torch.from_numpy(slots)


def _tree_visibility(masks: list[int] | None, start: int, q_len: int,
                     ctx: int) -> torch.Tensor | None:  # [q_len, ctx] bool, True = attend
    """Which positions each of a sequence's rows sees when some row carries a nonzero tree
    mask (rows with 0 stay causal); None when none does. Raises ValueError for masks that
    break the rules of :mod:`kernels.attention_metadata`."""
    if masks is None or q_len <= 1 or not any(masks[start:start + q_len]):
        return None  # a lone row's only valid masks, 0 and 1, are both causal
    if q_len > 64:
        raise ValueError(f"tree mask on a sequence of {q_len} > 64 new tokens")
    bits = np.array(masks[start:start + q_len], dtype=np.int64).view(np.uint64)  # [q]
    rows = np.arange(q_len, dtype=np.uint64)
    if np.any((bits != 0) & (bits >> rows != 1)):
        raise ValueError(f"bad tree mask {[hex(int(b)) for b in bits]}")
    causal = rows[None, :] <= rows[:, None]  # [q, q]
    new = np.where(bits[:, None] == 0, causal, (bits[:, None] >> rows[None, :]) & 1 == 1)
    vis = torch.ones(q_len, ctx, dtype=torch.bool)
    vis[:, ctx - q_len:] = torch.from_numpy(new)
    return vis


def _plan_single(seq: int, meta_args: tuple, block_tables: torch.Tensor) -> AttentionGroup:
    query_start_loc, seq_lens, block_size, masks = meta_args
    start, end = query_start_loc[seq], query_start_loc[seq + 1]
    q_len, ctx = end - start, seq_lens[seq]
    slots = _context_slots(block_tables[seq], ctx, block_size)[None]  # [1, ctx]
    tree = _tree_visibility(masks, start, q_len, ctx)  # [q, ctx] or None
    fresh = ctx == q_len and tree is None
    mask = None
    if tree is not None:
        mask = tree[None, None]  # [1, 1, q, ctx]
    elif q_len > 1:
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]  # [q, 1]
        mask = (torch.arange(ctx)[None, :] <= q_pos)[None, None]  # [1, 1, q, ctx]
    return AttentionGroup(None, start, None, slots, mask, fresh and q_len > 1, 1, q_len)


def _plan_padded(seqs: list[int], meta_args: tuple, block_tables: torch.Tensor) -> AttentionGroup:
    query_start_loc, seq_lens, block_size, masks = meta_args
    starts = [query_start_loc[s] for s in seqs]
    q_lens = [query_start_loc[s + 1] - query_start_loc[s] for s in seqs]
    ctxs = [seq_lens[s] for s in seqs]
    b, max_q, max_ctx = len(seqs), max(q_lens), max(ctxs)
    kv_slots = torch.zeros(b, max_ctx, dtype=torch.int64)
    for i, s in enumerate(seqs):
        kv_slots[i, : ctxs[i]] = _context_slots(block_tables[s], ctxs[i], block_size)
    q_off = torch.arange(max_q)
    rows = torch.tensor(starts)[:, None] + q_off  # [b, max_q]
    q_len_t = torch.tensor(q_lens)[:, None]
    real = q_off[None, :] < q_len_t  # [b, max_q]
    contiguous = all(q == max_q for q in q_lens) and starts == [
        starts[0] + i * max_q for i in range(b)
    ]
    uniform_ctx = all(c == max_ctx for c in ctxs)
    mask = None
    if not (max_q == 1 and uniform_ctx):
        # query i of sequence r sits at position ctx_r - q_len_r + i and sees keys <= it.
        q_pos = torch.tensor(ctxs)[:, None] - q_len_t + q_off  # [b, max_q]
        mask = torch.arange(max_ctx)[None, None, :] <= q_pos[:, :, None]  # [b, max_q, ctx]
        mask = (mask | ~real[:, :, None])[:, None]  # padded queries attend (and are dropped)
        for i in range(b):  # tree sequences: their rows see their ancestors only
            tree = _tree_visibility(masks, starts[i], q_lens[i], ctxs[i])  # [q, ctx] or None
            if tree is not None:
                mask[i, 0, : q_lens[i], : ctxs[i]] = tree
    if contiguous:
        return AttentionGroup(None, starts[0], None, kv_slots, mask, False, b, max_q)
    valid = real.reshape(-1).nonzero().squeeze(1)
    return AttentionGroup(rows.clamp(max=query_start_loc[-1] - 1), 0, valid, kv_slots, mask,
                          False, b, max_q)


def plan_attention(meta: AttentionMetadata) -> tuple[AttentionGroup, ...]:
    """Group the step's sequences, on the host: short queries padded together, long ones
    alone; tree rows (``meta.tree_mask``) get their ancestor masks."""
    query_start_loc, seq_lens = meta.host_query_start_loc(), meta.host_seq_lens()
    block_tables = meta.host_block_tables()
    masks = None if meta.tree_mask is None else meta.tree_mask.cpu().tolist()
    args = (query_start_loc, seq_lens, meta.block_size, masks)
    num_seqs = len(seq_lens)
    small = [s for s in range(num_seqs)
             if query_start_loc[s + 1] - query_start_loc[s] <= SMALL_QUERY_MAX]
    groups = [_plan_single(s, args, block_tables) for s in range(num_seqs) if s not in small]
    if len(small) == 1:
        groups.append(_plan_single(small[0], args, block_tables))
    elif small:
        groups.append(_plan_padded(small, args, block_tables))
    return tuple(groups)


def _groups(meta: AttentionMetadata, device: torch.device) -> tuple[AttentionGroup, ...]:
    """The step's plan: made on the first layer's call, kept in ``meta.plans`` (written
    here only), on ``device``."""
    groups = meta.plans.get("torch")
    if groups is None:
        def move(t: torch.Tensor | None) -> Any:
            return None if t is None else t.to(device, non_blocking=True)

        groups = plan_attention(meta)
        if device.type != "cpu":
            groups = tuple(replace(g, token_rows=move(g.token_rows),
                                   valid_rows=move(g.valid_rows), kv_slots=move(g.kv_slots),
                                   mask=move(g.mask)) for g in groups)
        meta.plans["torch"] = groups
    return groups


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32, every slot real (eager steps)
) -> None:
    """Scatter the new tokens' K/V into their cache slots. The torch backend runs eager
    steps only, whose slots are all real (-1, a CUDA graph's padding, is Triton's)."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, kv_heads, head_dim]
    flat[0][slot_mapping] = key
    flat[1][slot_mapping] = value


def _group_queries(query: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's query rows as ``[b, max_q, H, D]``."""
    if group.token_rows is None:
        n = group.batch * group.max_q
        q = query[group.first_row : group.first_row + n]
    else:
        q = query[group.token_rows.reshape(-1)]
    return q.view(group.batch, group.max_q, query.shape[1], query.shape[2])


def _attend_group_sdpa(
    query: torch.Tensor, kv_flat: torch.Tensor, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """fp32: torch's SDPA, the same kernel HF uses (keeps greedy output bit-comparable)."""
    heads, dim = query.shape[1], query.shape[2]
    q = _group_queries(query, group).transpose(1, 2)  # [b, H, q, D]
    kv = kv_flat[:, group.kv_slots]  # [2, b, ctx, KVH, D]: K and V in one gather
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, KVH, ctx, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if group.is_causal else group.mask,
        is_causal=group.is_causal, scale=scale, enable_gqa=heads != k.shape[1],
    )  # [b, H, q, D]
    return out.transpose(1, 2).reshape(group.batch * group.max_q, heads, dim)


def _attend_group_fp32_math(
    query: torch.Tensor, kv_flat: torch.Tensor, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """bf16/fp16: explicit fp32 matmuls. On CPUs without native bf16, SDPA's bf16 kernels are
    3-10x slower than this for decode and verification over long contexts."""
    b, max_q, heads, dim = group.batch, group.max_q, query.shape[1], query.shape[2]
    kv_heads = kv_flat.shape[2]
    q = _group_queries(query, group).float()  # [b, q, H, D]
    q = q.view(b, max_q, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    kv = kv_flat[:, group.kv_slots].float()  # [2, b, ctx, KVH, D]
    k = kv[0].permute(0, 2, 3, 1).unsqueeze(2)  # [b, KVH, 1, D, ctx]
    v = kv[1].permute(0, 2, 1, 3).unsqueeze(2)  # [b, KVH, 1, ctx, D]
    scores = torch.matmul(q, k).mul_(scale)  # [b, KVH, G, q, ctx]
    if group.mask is not None:
        scores.masked_fill_(~group.mask.unsqueeze(1), float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [b, KVH, G, q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b * max_q, heads, dim).to(query.dtype)


def _attend_fn(dtype: torch.dtype, group: AttentionGroup) -> Callable[..., torch.Tensor]:
    """fp32 always uses SDPA (HF's kernel). For bf16, SDPA wins on prefill chunks and short
    single-sequence decode; explicit fp32 math wins on batched or long-context decode."""
    if dtype == torch.float32:
        return _attend_group_sdpa
    single = group.batch == 1
    if single and (group.max_q > SMALL_QUERY_MAX or group.kv_slots.shape[1] < LONG_CONTEXT):
        return _attend_group_sdpa
    return _attend_group_fp32_math


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its cached context (their K/V written),
    tree rows (``meta.tree_mask``) over the context before the new tokens and their
    ancestors."""
    if query.dtype == torch.bfloat16 and query.device.type == "cpu":
        # Every bf16 row on CPU, prefill included: the kernel computes each (token, kv head)
        # like a lone decode query, so a token's result never depends on its batch or on how
        # its prompt was chunked (batch invariance), and it is also faster than the torch
        # path for prefill (236 tokens: 0.97 against 1.27 ms a layer on a 2-core EPYC with
        # AVX512-BF16). None: the kernel declined (not built, or shapes it does not take).
        # query is a strided view into the fused qkv output: the kernel wants it packed
        out = cpu_attention.ragged_attention(query.contiguous(), kv_cache, meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc, scale,
                                             meta.tree_mask)
        if out is not None:
            return out
    kv_flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, kv_heads, head_dim]
    groups = _groups(meta, query.device)
    if len(groups) == 1 and groups[0].token_rows is None:
        return _attend_fn(query.dtype, groups[0])(query, kv_flat, groups[0], scale)
    out = torch.empty_like(query)
    for group in groups:
        result = _attend_fn(query.dtype, group)(query, kv_flat, group, scale)
        if group.token_rows is None:
            out[group.first_row : group.first_row + result.shape[0]] = result
        else:
            assert group.valid_rows is not None
            rows = group.token_rows.reshape(-1)[group.valid_rows]
            out.index_copy_(0, rows, result[group.valid_rows])
    return out


def write_kv_and_attend(
    qkv: torch.Tensor,  # [num_tokens, (heads + 2 kv_heads) * head_dim], RoPE applied
    heads: int,
    kv_heads: int,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:  # [num_tokens, heads, head_dim]
    """:func:`write_kv` of qkv's k/v columns, then :func:`paged_attention` of its q columns,
    in one C call where the CPU bf16 kernel runs (None elsewhere: the caller runs the two)."""
    if qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu":
        return None
    return cpu_attention.write_kv_and_attend(qkv, heads, kv_heads, kv_cache, meta.slot_mapping,
                                             meta.block_tables, meta.seq_lens,
                                             meta.query_start_loc, scale, meta.tree_mask)
