"""The triton backend's batch-invariant mode: a token's logits do not depend on its batch.

Speculation promises exactly the tokens plain decoding would give. Plain decoding computes a
token in a 1-row step; verification computes it as one of ``1 + k`` rows, beside other
requests' rows and prefill chunks. On the CPU every kernel gives a row the same bits whatever
else is in the step. On a GPU three things did not (an H200 showed it: docs/benchmarks.md):

* cuBLAS picks its GEMM by the row count -> linear layers and the LM head go through
  :func:`kernels.triton_matmul.linear`, one fixed tile configuration;
* the attention kernel's query tile grows to 64 rows once a step's longest query needs it
  (a prefill chunk, a tree) -> here it is always :data:`BLOCK_M` rows (a row's dot
  products are the same instructions at any tile position; see below);
* split-KV (flash decoding) is chosen from the batch's shape -> never split here.

With these, a row at position ``p`` walks the same key tiles, aligned at position 0, as the
1-row decode of that token: its own tile lanes past ``p`` are masked in both (beyond the
context in one, causal in the other) and tiles wholly past ``p`` are exact no-ops. That holds
for chain drafts, whose tokens sit at consecutive positions. It does not hold for trees: a
tree node's ancestors sit at their node slots, not at consecutive positions, so its visible
keys fall on other tile lanes and sum in another order. The engine therefore verifies chains
only in this mode (each tree's best path: :attr:`engine.backend.KernelBackend.verify_trees`).

The module has the attention interface of :mod:`kernels.triton_attention` (``write_kv``,
``paged_attention``, ``choose_num_splits``) plus ``linear``. Costs, to be measured on a GPU:
prefill attention in 16-row tiles reloads each key tile 4x as often as 64-row ones; no
split-KV leaves SMs idle for long contexts in small batches; the GEMM is untuned.
"""

import torch

from quickdraft.kernels import triton_attention
from quickdraft.kernels.attention_metadata import AttentionMetadata
from quickdraft.kernels.triton_attention import available, interpreting, write_kv
from quickdraft.kernels.triton_matmul import linear

__all__ = ["BLOCK_M", "available", "choose_num_splits", "interpreting", "linear",
           "paged_attention", "write_kv"]

BLOCK_M = 16  # query rows (tokens x query heads of one kv head) per attention program


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      num_programs: int | None = None) -> int:
    """Never split the keys: a split's partial sums would change with the batch's shape."""
    return 1


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    **_: object,  # the tile and split choices are this module's, whatever a caller asks
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """:func:`kernels.triton_attention.paged_attention` with one query tile shape and no
    split-KV (the module docstring)."""
    return triton_attention.paged_attention(query, kv_cache, meta, scale, num_splits=1,
                                            block_m=BLOCK_M)
