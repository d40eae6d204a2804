"""Random paged-attention cases shared by the CPU attention kernel's tests: a query and a
bf16 KV cache whose sequences own shuffled (non-contiguous) blocks, ragged query rows, and a
call under a given thread count."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable

import pytest
import torch

from quickdraft.kernels import cpu_attention

needs_kernel = pytest.mark.skipif(
    shutil.which("gcc") is None or not cpu_attention._cpu_supported(),
    reason="needs gcc and an AVX2/FMA CPU")

BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


def paged_case(num_seqs: int, seq_lens: list[int], block_size: int, heads: int, kv_heads: int,
          dim: int, seed: int = 0, *, spare_blocks: int = 3
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random q and cache; each sequence owns a shuffled (non-contiguous) set of blocks."""
    assert len(seq_lens) == num_seqs
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    max_blocks = max(need) + 1  # padded with 0, like the engine's tables
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_tables[s, :len(t)] = torch.tensor(t, dtype=torch.int32)
    query = torch.randn(num_seqs, heads, dim, generator=g).to(BF16)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(BF16)
    return query, kv_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), tables


def context_lens(num_seqs: int, block_size: int) -> list[int]:
    base = [1, block_size, 2 * block_size + 1, 517, 3, 64, 700, block_size + 1]
    return base[:num_seqs]



def ragged_case(q_lens: list[int], seq_lens: list[int], block_size: int, heads: int,
                 kv_heads: int, dim: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, list[list[int]]]:
    """As :func:`paged_case`, with ``sum(q_lens)`` query rows and their ``query_start_loc``."""
    _, kv, bt, sl, tables = paged_case(len(seq_lens), seq_lens, block_size, heads, kv_heads, dim,
                                       seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(BF16)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return query, kv, bt, sl, qsl, tables



def with_threads(threads: int, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``fn(*args)`` under ``torch.set_num_threads(threads)`` (restored afterwards)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(old)
