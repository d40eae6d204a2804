"""The Triton kernels compiled on a real GPU, at shapes too large for the interpreter.

Marked ``cuda``: skipped without a CUDA GPU (the interpreter tests in
test_triton_attention.py / test_triton_ops.py / test_triton_rejection.py cover the same code
on CPU in CI). Run on a GPU machine with ``TRITON_INTERPRET=0 pytest -m cuda tests/kernels``.
"""

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA GPU and compiled Triton kernels"),
]

triton = pytest.importorskip("triton")

from quickdraft.kernels.attention_metadata import build_metadata  # noqa: E402
from tests.kernels.attention_oracle import naive_attention  # noqa: E402

BF16 = torch.bfloat16


def _random_step(q_lens, ctx_lens, block_size, heads, kv_heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], heads, dim, generator=gen).to(dtype)
    return query.cuda(), kv_cache.cuda(), qsl, list(ctx_lens), tables


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (32, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("splits", [1, None])
def test_large_mixed_steps(block_size, heads, kv_heads, dim, splits):
    from quickdraft.kernels import triton_attention as ta

    rng = random.Random(block_size + heads)
    q_lens = [1] * 24 + [5] * 8 + [rng.randint(20, 300) for _ in range(3)]
    ctx = [rng.randint(q, 4000) for q in q_lens]
    query, kv_cache, qsl, ctx, tables = _random_step(q_lens, ctx, block_size, heads,
                                                     kv_heads, dim, BF16)
    meta = build_metadata(qsl, ctx, tables, block_size, "cuda")
    got = ta.paged_attention(query, kv_cache, meta, dim**-0.5, num_splits=splits)
    want = naive_attention(query.cpu(), kv_cache.cpu(), meta, dim**-0.5)
    assert torch.isfinite(got).all()
    assert (got.cpu().float() - want.float()).abs().max().item() <= 1.6e-2


def test_long_context_split_kv_at_batch_one():
    from quickdraft.kernels import triton_attention as ta

    query, kv_cache, qsl, ctx, tables = _random_step([1], [16000], 16, 32, 8, 128, BF16)
    meta = build_metadata(qsl, ctx, tables, 16, "cuda")
    assert ta.choose_num_splits(1, 8, 1, 16000) > 1
    split = ta.paged_attention(query, kv_cache, meta, 128**-0.5)
    whole = ta.paged_attention(query, kv_cache, meta, 128**-0.5, num_splits=1)
    assert (split.float() - whole.float()).abs().max().item() <= 1.6e-2


def test_write_kv_and_small_ops_match_their_references():
    from quickdraft.kernels import torch_attention, torch_ops, triton_ops
    from quickdraft.kernels import triton_attention as ta

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(257, 4096, generator=gen).to(BF16).cuda()
    res = torch.randn(257, 4096, generator=gen).to(BF16).cuda()
    w = torch.randn(4096, generator=gen).to(BF16).cuda()
    y, r = triton_ops.add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = torch_ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, r_ref)
    assert (y.float() - y_ref.float()).abs().max().item() <= 0.05
    gate_up = torch.randn(257, 2 * 14336, generator=gen).to(BF16).cuda()
    diff = triton_ops.silu_mul(gate_up).float() - torch_ops.silu_mul(gate_up).float()
    assert diff.abs().max().item() <= 0.05
    cache = torch.zeros(2, 64, 16, 8, 128, dtype=BF16, device="cuda")
    k = torch.randn(40, 8, 128, generator=gen).to(BF16).cuda()
    v = torch.randn(40, 8, 128, generator=gen).to(BF16).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:40].cuda()
    want = cache.clone()
    torch_attention.write_kv(k, v, want, slots)
    ta.write_kv(k, v, cache, slots.to(torch.int32))
    assert torch.equal(cache, want)


def test_verification_rows_equal_decode_rows():
    """Row invariance (what makes bf16 speculation lossless on the CPU kernels): attention of
    a k+1-token verification row vs the same query decoded alone, same tile config."""
    from quickdraft.kernels import triton_attention as ta

    query, kv_cache, qsl, ctx, tables = _random_step([5], [300], 16, 32, 8, 128, BF16)
    meta = build_metadata(qsl, ctx, tables, 16, "cuda")
    verify = ta.paged_attention(query, kv_cache, meta, 128**-0.5, num_splits=1, block_m=16)
    for i in range(5):  # row i decoded alone: context 296 + i
        one = build_metadata([0, 1], [296 + i], tables, 16, "cuda")
        alone = ta.paged_attention(query[i:i + 1], kv_cache, one, 128**-0.5, num_splits=1,
                                   block_m=16)
        diff = (alone.float() - verify[i:i + 1].float()).abs().max().item()
        # report, do not fail: whether MMA results depend on a row's place in the tile is
        # what this measures (docs/kernels.md: still open)
        print(f"row {i}: max |decode - verify| = {diff}")
        assert diff <= 1.6e-2


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_tree_verification_steps(dtype, heads, kv_heads, dim, splits):
    """Tree masks compiled: random trees of 2..64 rows (one of 64: bit 63, a negative int64)
    after long contexts, mixed with decodes, a prefill chunk and a causal chain, against the
    interpreter tests' masked reference; and an all-zero mask is bitwise the causal kernel."""
    import dataclasses

    from quickdraft.kernels import triton_attention as ta
    from tests.kernels.tree_attention_oracle import masked_reference, random_tree, tree_masks

    rng = random.Random(heads + dim)
    trees = [random_tree(64, rng)] + [random_tree(rng.randint(2, 40), rng) for _ in range(7)]
    chain = tree_masks(list(range(-1, 7)))
    row_masks = [*trees, chain, [0] * 150] + [[0]] * 12
    q_lens = [len(m) for m in row_masks]
    ctx = [rng.randint(q, 3000) for q in q_lens]
    masks = [m for rows in row_masks for m in rows]
    query, kv_cache, qsl, ctx, tables = _random_step(q_lens, ctx, 16, heads, kv_heads, dim,
                                                     dtype)
    meta = build_metadata(qsl, ctx, tables, 16, "cuda", tree_mask=masks)
    meta.check_invariants()
    assert meta.tree_mask is not None
    got = ta.paged_attention(query, kv_cache, meta, dim**-0.5, num_splits=splits)
    want = masked_reference(query.cpu(), kv_cache.cpu(), meta, dim**-0.5, masks)
    assert torch.isfinite(got).all()
    tol = 1.6e-2 if dtype == BF16 else 2e-3  # as in test_triton_attention.py
    assert (got.cpu().float() - want.float()).abs().max().item() <= tol
    causal = dataclasses.replace(meta, tree_mask=None)
    zeros = dataclasses.replace(meta, tree_mask=torch.zeros_like(meta.tree_mask))
    assert torch.equal(ta.paged_attention(query, kv_cache, zeros, dim**-0.5, num_splits=splits),
                       ta.paged_attention(query, kv_cache, causal, dim**-0.5,
                                          num_splits=splits))
