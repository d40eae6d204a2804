"""The torch attention backend equals the naive per-token oracle."""

import random

import pytest
import torch

from quickdraft.kernels.attention_metadata import build_metadata
from quickdraft.kernels.torch_attention import paged_attention, write_kv
from tests.kernels.attention_oracle import naive_attention


def _random_step(q_lens, ctx_lens, block_size, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks of a sequence are not contiguous
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = build_metadata(qsl, list(ctx_lens), tables, block_size)
    query = torch.randn(qsl[-1], heads, dim, generator=gen)
    new_k = torch.randn(qsl[-1], kv_heads, dim, generator=gen)
    new_v = torch.randn(qsl[-1], kv_heads, dim, generator=gen)
    write_kv(new_k, new_v, kv_cache, meta.slot_mapping)
    return query, kv_cache, meta


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1], [1]),
        ([7], [7]),  # fresh prefill
        ([1, 1, 1], [9, 3, 20]),  # ragged decode
        ([4, 1, 30, 3], [10, 17, 45, 3]),  # verification + decode + prefill chunk + fresh
        ([20, 20], [20, 33]),  # two long chunks
        ([2, 2], [5, 5]),  # uniform small queries
    ],
)
def test_matches_naive(block_size, q_lens, ctx_lens):
    query, kv_cache, meta = _random_step(q_lens, ctx_lens, block_size)
    scale = 8**-0.5
    got = paged_attention(query, kv_cache, meta, scale)
    want = naive_attention(query, kv_cache, meta, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_write_kv_places_tokens_in_their_slots():
    _, _, meta = _random_step([3], [5], block_size=2)
    table = meta.block_tables[0].tolist()
    for i, pos in enumerate(range(2, 5)):
        slot = meta.slot_mapping[i].item()
        assert slot == table[pos // 2] * 2 + pos % 2


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [([1], [40]), ([1], [400]), ([7], [7]), ([4, 1, 30, 3], [10, 17, 45, 3]),
     ([1, 1], [9, 70])],
)
def test_bf16_fp32_math_path_matches_naive(block_size, q_lens, ctx_lens):
    query, kv_cache, meta = _random_step(q_lens, ctx_lens, block_size, heads=6, kv_heads=2)
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    got = paged_attention(query, kv_cache, meta, 8**-0.5)
    want = naive_attention(query, kv_cache, meta, 8**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
