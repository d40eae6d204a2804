"""Obviously-correct attention over a paged KV cache: the oracles the attention kernels of
every backend (CPU C kernel, torch path, Triton) are tested against. Test code only.

Semantics: token ``i`` of sequence ``s`` (rows ``query_start_loc[s] .. query_start_loc[s+1]
- 1``, ``q_len`` of them) and head ``h`` (kv head ``h // (heads // kv_heads)``) get
``softmax(scale * q K^T) V`` over positions ``[0, seq_lens[s] - q_len + i]`` in fp32,
returned in ``query.dtype``. Tree verification (``tree_mask``, one int64 per row, rules in
:mod:`kernels.attention_metadata`): a row with a nonzero mask sees ``[0, base)`` (``base =
seq_lens[s] - q_len``) plus ``base + j`` for each set bit ``j`` (read as uint64) instead.
"""

from __future__ import annotations

import torch

from quickdraft.kernels.attention_metadata import AttentionMetadata


def _context_kv(kv_cache: torch.Tensor, table: torch.Tensor, ctx: int,
                group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K and V of positions ``[0, ctx)``, each kv head repeated for its query heads:
    ``[ctx, heads, head_dim]`` each. Slots spelled out position by position."""
    block_size = kv_cache.shape[2]
    rows = [(int(table[p // block_size]), p % block_size) for p in range(ctx)]
    k = torch.stack([kv_cache[0, b, o] for b, o in rows]).float()  # [ctx, kv_heads, d]
    v = torch.stack([kv_cache[1, b, o] for b, o in rows]).float()
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def ragged_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    scale: float,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64; None: every row causal
) -> torch.Tensor:  # [num_tokens, heads, head_dim], query.dtype
    """The semantics above, one token and head at a time, on the host."""
    query, kv_cache = query.cpu(), kv_cache.cpu()
    qsl, lens = [int(x) for x in query_start_loc], [int(x) for x in seq_lens]
    masks = [0] * qsl[-1] if tree_mask is None else [int(m) % 2**64 for m in tree_mask]
    group = query.shape[1] // kv_cache.shape[3]
    out = torch.zeros_like(query)
    for s in range(len(lens)):
        start, end = qsl[s], qsl[s + 1]
        if end <= start:
            continue
        k, v = _context_kv(kv_cache, block_tables[s].cpu(), lens[s], group)
        base = lens[s] - (end - start)
        for t in range(start, end):
            visible = list(range(base + t - start + 1))  # causal: [0, base + i]
            if masks[t]:  # tree row: [0, base) and the new rows whose bits are set
                visible = [*range(base), *(base + j for j in range(64) if masks[t] >> j & 1)]
            scores = torch.einsum("hd,khd->hk", query[t].float(), k[visible]) * scale
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[visible]).to(out.dtype)
    return out


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`ragged_attention` with one new token per sequence."""
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return ragged_attention(query, kv_cache, block_tables, seq_lens, qsl, scale)


def naive_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """:func:`ragged_attention` of a step's metadata (read from its host side), tree rows
    included."""
    mask = None if meta.tree_mask is None else meta.tree_mask.cpu()
    return ragged_attention(query, kv_cache, meta.host_block_tables(),
                            torch.tensor(meta.host_seq_lens()),
                            torch.tensor(meta.host_query_start_loc()), scale, mask)
