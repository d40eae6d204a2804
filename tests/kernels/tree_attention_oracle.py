"""Tree attention's reference for the Triton kernel's tests (CPU interpreter and GPU): the
ancestor bitmasks of a tree given by its parents, random trees, and the attention oracle's
semantics (fp32 softmax on the host) with those masks."""

import torch


def tree_masks(parents):
    """Ancestor bitmasks (attention_metadata's tree_mask) of a tree given as ``parents[i] <
    i`` (``-1``: a root): row ``i`` sees itself and its ancestors."""
    masks: list[int] = []
    for i, parent in enumerate(parents):
        assert parent < i
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return masks


def random_tree(n, rng):
    """A random tree of ``n`` rows rooted at row 0 (the pending token)."""
    return tree_masks([-1] + [rng.randrange(i) for i in range(1, n)])


def masked_reference(query, kv_cache, meta, scale, masks=None):
    """The oracle's semantics (fp32 softmax on the host, rounded to query.dtype) with tree
    masks: ``masks`` one int per row (None: all causal). A row with mask 0 sees positions
    ``[0, base + i]``; else ``[0, base)`` and ``base + j`` for every set bit ``j``."""
    query, kv_cache = query.cpu(), kv_cache.cpu()
    qsl, lens, tables = meta.host_query_start_loc(), meta.host_seq_lens(), meta.host_block_tables()
    block_size, group = kv_cache.shape[2], query.shape[1] // kv_cache.shape[3]
    out = torch.zeros_like(query)
    for s, ctx in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        q_len, base = end - start, ctx - (end - start)
        if not q_len:
            continue
        pos = torch.arange(ctx)
        blocks = tables[s].long()[pos // block_size]
        k, v = (kv_cache[i, blocks, pos % block_size].float().repeat_interleave(group, 1)
                for i in (0, 1))  # [ctx, heads, head_dim]
        visible = torch.zeros(q_len, ctx, dtype=torch.bool)
        for i in range(q_len):
            bits = (masks[start + i] if masks else 0) & ((1 << 64) - 1)
            if bits == 0:
                visible[i, : base + i + 1] = True
                continue
            visible[i, :base] = True
            for j in range(q_len):
                visible[i, base + j] = bool(bits >> j & 1)
        scores = torch.einsum("thd,khd->htk", query[start:end].float(), k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("htk,khd->thd", probs, v).to(out.dtype)
    return out
