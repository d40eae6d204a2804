"""kernels.cpu_attention: decode attention over a paged bf16 KV cache (one C call per batch)
against ``decode_attention_ref`` (fp32 from the same bf16 inputs) and, on one case, the
engine's reference ``paged_attention_ref.naive_attention``."""

from __future__ import annotations

import itertools
import math
import shutil

import pytest
import torch

from kernels import cpu_attention, paged_attention_ref

needs_kernel = pytest.mark.skipif(
    shutil.which("gcc") is None or not cpu_attention._cpu_supported(),
    reason="needs gcc and an AVX2/FMA CPU")

BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


def _case(num_seqs: int, seq_lens: list[int], block_size: int, heads: int, kv_heads: int,
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


def _lens(num_seqs: int, block_size: int) -> list[int]:
    base = [1, block_size, 2 * block_size + 1, 517, 3, 64, 700, block_size + 1]
    return base[:num_seqs]


@needs_kernel
def test_available() -> None:
    assert cpu_attention.available()


@needs_kernel
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_matches_reference(num_seqs: int, block_size: int, heads: int, kv_heads: int,
                           dim: int) -> None:
    lens = _lens(num_seqs, block_size)
    if num_seqs == 1:
        lens = [517]  # > 500, not a multiple of any block size
    q, kv, bt, sl, _ = _case(num_seqs, lens, block_size, heads, kv_heads, dim,
                             seed=num_seqs * 1000 + block_size * 10 + dim + heads)
    scale = 1 / math.sqrt(dim)
    got = cpu_attention.decode_attention(q, kv, bt, sl, scale)
    want = cpu_attention.decode_attention_ref(q, kv, bt, sl, scale)
    assert got.dtype == BF16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 31, 32, 33, 40, 513])
def test_lengths_around_chunk_and_block_edges(seq_len: int) -> None:
    q, kv, bt, sl, _ = _case(2, [seq_len, 5], 16, 8, 2, 64, seed=seq_len)
    got = cpu_attention.decode_attention(q, kv, bt, sl, 0.125)
    torch.testing.assert_close(got.float(),
                               cpu_attention.decode_attention_ref(q, kv, bt, sl, 0.125).float(),
                               **TOL)


@needs_kernel
def test_peaked_scores_and_threads() -> None:
    """Large scores (softmax near one-hot, max found late) and the OpenMP path."""
    q, kv, bt, sl, _ = _case(8, [300, 1, 900, 257, 64, 33, 600, 2], 16, 9, 3, 64, seed=7)
    for scale in (0.125, 2.0):
        want = cpu_attention.decode_attention_ref(q, kv, bt, sl, scale).float()
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = cpu_attention.decode_attention(q, kv, bt, sl, scale)
            finally:
                torch.set_num_threads(old)
            torch.testing.assert_close(got.float(), want, **TOL)


@needs_kernel
def test_agrees_with_naive_attention() -> None:
    """The engine's reference (decode: one new token per sequence, K/V written by write_kv)."""
    block_size, heads, kv_heads, dim = 16, 9, 3, 64
    lens = [1, 16, 517]
    q, kv, _, sl, tables = _case(3, lens, block_size, heads, kv_heads, dim, seed=11)
    meta = paged_attention_ref.build_metadata(list(range(4)), lens, tables, block_size)
    g = torch.Generator().manual_seed(12)
    new_k = torch.randn(3, kv_heads, dim, generator=g).to(BF16)
    new_v = torch.randn(3, kv_heads, dim, generator=g).to(BF16)
    paged_attention_ref.write_kv(new_k, new_v, kv, meta.slot_mapping)
    scale = dim ** -0.5
    want = paged_attention_ref.naive_attention(q, kv, meta, scale)
    got = cpu_attention.decode_attention(q, kv, meta.block_tables, sl, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL)


def test_reference_matches_naive_attention() -> None:
    q, kv, bt, sl, tables = _case(3, [5, 1, 40], 5, 4, 2, 64, seed=3)
    meta = paged_attention_ref.build_metadata(list(range(4)), [5, 1, 40], tables, 5)
    want = paged_attention_ref.naive_attention(q, kv, meta, 0.1)
    got = cpu_attention.decode_attention_ref(q, kv, bt, sl, 0.1)
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@pytest.mark.parametrize("variant", ["float32", "strided_query", "int64_tables", "dim_12"])
def test_fallbacks(variant: str) -> None:
    """Inputs the kernel does not take run the reference (same results)."""
    dim = 12 if variant == "dim_12" else 64
    q, kv, bt, sl, _ = _case(3, [4, 20, 9], 4, 4, 2, dim, seed=5)
    if variant == "float32":
        q, kv = q.float(), kv.float()
    elif variant == "strided_query":
        q = torch.cat([q, q], dim=-1)[..., :dim]
        assert not q.is_contiguous()
    elif variant == "int64_tables":
        bt, sl = bt.long(), sl.long()
    got = cpu_attention.decode_attention(q, kv, bt, sl, 0.2)
    want = cpu_attention.decode_attention_ref(q, kv, bt, sl, 0.2)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
def test_bad_block_id_falls_back_to_reference() -> None:
    """The C side rejects out-of-range block ids; the reference then raises."""
    q, kv, bt, sl, _ = _case(2, [20, 3], 16, 4, 4, 64, seed=9)
    bt[0, 1] = kv.shape[1] + 5
    with pytest.raises(IndexError):
        cpu_attention.decode_attention(q, kv, bt, sl, 0.125)


@needs_kernel
def test_all_groupings_small() -> None:
    """Every (heads, kv_heads) grouping up to 8 heads at a short context."""
    for heads, kv_heads in itertools.product(range(1, 9), range(1, 9)):
        if heads % kv_heads:
            continue
        q, kv, bt, sl, _ = _case(2, [7, 12], 5, heads, kv_heads, 64, seed=heads * 10 + kv_heads)
        torch.testing.assert_close(
            cpu_attention.decode_attention(q, kv, bt, sl, 0.125).float(),
            cpu_attention.decode_attention_ref(q, kv, bt, sl, 0.125).float(), **TOL)
