"""kernels.triton_attention against the oracle (tests/kernels/attention_oracle.py) and the
torch attention backend (kernels.torch_attention); tree-verification steps against
``masked_reference`` (tests/kernels/tree_attention_oracle.py).

Without a GPU this runs on CPU tensors through the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); skipped without triton. On a GPU
machine, ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton_attention.py`` runs the same
tests compiled, on CUDA tensors. Shapes are small: the interpreter runs every program of
the grid in Python.
"""


import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

from quickdraft.kernels import torch_attention
from quickdraft.kernels import triton_attention as ta
from quickdraft.kernels.attention_metadata import build_metadata
from tests.kernels.attention_oracle import naive_attention
from tests.kernels.tree_attention_oracle import masked_reference, random_tree, tree_masks

if ta.interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# max abs error vs the naive reference (fp32 math on the same inputs, rounded to the dtype;
# inputs ~N(0, 1), outputs |.| < ~2): fp32 is the online softmax's rounding only (measured
# ~1e-6); half types also round P to the input dtype before P @ V: one or two output ulps
# (about what the torch path's own bf16 error is).
TOL = {F32: 5e-6, F16: 2e-3, BF16: 1.6e-2}


def _step(q_lens, ctx_lens, block_size, heads, kv_heads, dim, dtype, seed=0, tree_mask=None):
    """A random step: shuffled (non-contiguous) blocks, the new tokens' K/V already written;
    ``tree_mask``: one int per row (unsigned 64-bit patterns), as build_metadata takes it."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx_lens]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = build_metadata(qsl, list(ctx_lens), tables, block_size, DEVICE, tree_mask=tree_mask)
    query = torch.randn(qsl[-1], heads, dim, generator=gen).to(dtype)
    return query.to(DEVICE), kv_cache.to(DEVICE), meta


def _check(got, query, kv_cache, meta, scale, masks=None):
    """Within TOL of the oracle, or with ``masks`` (the step's tree masks) of
    :func:`masked_reference`."""
    if masks is None:
        want = naive_attention(query.cpu(), kv_cache.cpu(), meta, scale)
    else:
        want = masked_reference(query, kv_cache, meta, scale, masks)
    assert got.shape == query.shape and got.dtype == query.dtype
    assert torch.isfinite(got).all()
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert err <= TOL[query.dtype], f"max abs error {err}"


MIXED = ([4, 1, 30, 3], [10, 17, 45, 3])  # verification + decode + prefill chunk + fresh

STEPS = {
    "decode-1": ([1], [1]),
    "decode-ragged": ([1, 1, 1], [9, 33, 20]),
    "verify": ([4, 4], [37, 16]),  # k+1 = 4 tokens after a cached prefix
    "fresh-prefill": ([23], [23]),
    "chunked-prefill": ([20], [50]),  # second chunk of a prompt
    "mixed": MIXED,
    "mixed-2": ([1, 5, 17, 1], [64, 21, 40, 1]),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_step_matches_naive(dtype, heads, kv_heads, block_size):
    query, kv_cache, meta = _step(*MIXED, block_size, heads, kv_heads, 64, dtype)
    got = ta.paged_attention(query, kv_cache, meta, 64**-0.5, num_splits=1)
    _check(got, query, kv_cache, meta, 64**-0.5)


@pytest.mark.parametrize("name", list(STEPS))
def test_step_kinds_match_naive(name):
    block_size = 5 if len(name) % 2 else 16
    query, kv_cache, meta = _step(*STEPS[name], block_size, 6, 2, 64, F32, seed=len(name))
    got = ta.paged_attention(query, kv_cache, meta, 0.1, num_splits=1)
    _check(got, query, kv_cache, meta, 0.1)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("dim", [128, 80])  # 80: padded to 128 lanes, masked
def test_other_head_dims(dtype, heads, kv_heads, dim):
    query, kv_cache, meta = _step([3, 1, 9], [19, 40, 9], 16, heads, kv_heads, dim, dtype)
    got = ta.paged_attention(query, kv_cache, meta, dim**-0.5, num_splits=1)
    _check(got, query, kv_cache, meta, dim**-0.5)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 16), (32, 64)])
def test_tile_sizes(block_m, block_n):
    """Decode-sized query tiles on prefill rows and vice versa; KV tiles smaller and larger
    than the cache blocks."""
    query, kv_cache, meta = _step(*STEPS["mixed-2"], 16, 6, 2, 64, F32, seed=3)
    got = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=1, block_m=block_m,
                             block_n=block_n)
    _check(got, query, kv_cache, meta, 0.125)


def test_strided_query_from_fused_qkv():
    """The model passes q as a column slice of the fused qkv output."""
    heads, kv_heads, dim = 6, 2, 64
    query, kv_cache, meta = _step(*MIXED, 16, heads, kv_heads, dim, BF16, seed=5)
    qkv = torch.randn(query.shape[0], (heads + 2 * kv_heads) * dim, device=DEVICE).to(BF16)
    qkv[:, : heads * dim] = query.reshape(query.shape[0], -1)
    q_view = qkv[:, : heads * dim].view(-1, heads, dim)
    assert not q_view.is_contiguous()
    got = ta.paged_attention(q_view, kv_cache, meta, 0.125, num_splits=1)
    _check(got, query, kv_cache, meta, 0.125)


# -------------------------------------------------------------------------------- split-KV

SPLIT_CASES = {
    "long-decode": ([1], [300], 4),
    "short-and-long": ([1, 1], [130, 20], 3),  # the short one leaves splits empty
    "verify": ([4], [200], 5),
    "more-splits-than-tiles": ([1, 2], [40, 7], 8),
    "mixed": (*MIXED, 2),  # prefill rows through the split path too
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_matches_naive(name, dtype):
    q_lens, ctx_lens, splits = SPLIT_CASES[name]
    heads, kv_heads = (6, 2) if len(name) % 2 else (4, 4)
    block_size = 16 if dtype == F32 else 5
    query, kv_cache, meta = _step(q_lens, ctx_lens, block_size, heads, kv_heads, 64, dtype)
    got = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=splits)
    _check(got, query, kv_cache, meta, 0.125)


def test_split_kv_agrees_with_unsplit_fp32():
    query, kv_cache, meta = _step([1, 3], [250, 90], 16, 6, 2, 128, F32, seed=7)
    one = ta.paged_attention(query, kv_cache, meta, 0.09, num_splits=1)
    many = ta.paged_attention(query, kv_cache, meta, 0.09, num_splits=6)
    torch.testing.assert_close(many, one, atol=2e-6, rtol=2e-6)


def test_choose_num_splits():
    # a big batch or a prefill: no split
    assert ta.choose_num_splits(64, 8, 1, 8192) == 1
    assert ta.choose_num_splits(1, 8, 512, 8192) == 1
    # short contexts: no split
    assert ta.choose_num_splits(1, 8, 1, 200) == 1
    # one long decode: split, bounded
    n = ta.choose_num_splits(1, 8, 1, 8192)
    assert 1 < n <= 16
    assert ta.choose_num_splits(2, 8, 4, 2048) == 2048 // 256


# -------------------------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv_matches_reference(dtype, block_size):
    kv_heads, dim, heads = 2, 64, 6
    _, cache, meta = _step(*MIXED, block_size, heads, kv_heads, dim, dtype, seed=11)
    t = meta.num_tokens
    # k and v as the model passes them: column slices of the fused qkv output
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    want = cache.cpu().clone()
    torch_attention.write_kv(k.cpu(), v.cpu(), want, meta.slot_mapping.cpu())
    got = cache.clone()
    ta.write_kv(k, v, got, meta.slot_mapping)
    assert torch.equal(got.cpu(), want)


def test_write_kv_skips_negative_slots_and_casts():
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=BF16, device=DEVICE)
    k = torch.randn(3, 2, 16, device=DEVICE)  # fp32 into a bf16 cache
    v = torch.randn(3, 2, 16, device=DEVICE)
    ta.write_kv(k, v, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(2, 12, 2, 16).cpu()
    assert torch.equal(flat[0, 5], k[0].cpu().to(BF16))
    assert torch.equal(flat[1, 0], v[2].cpu().to(BF16))
    assert int((flat != 0).any(-1).any(-1).sum()) == 4  # 2 slots x K and V, nothing else


# ------------------------------------------------------------------ as the model's backend


def test_plugs_in_as_the_model_backend():
    """A tiny random Llama: one step (a prefill chunk and a decode row) through this module
    as the attention backend, and kernels.triton_ops as its LayerOps, equals the torch path.
    Not wiring: the engine still only selects the torch path."""
    from transformers import LlamaConfig

    from quickdraft.engine.models.llama import LlamaForCausalLM
    from quickdraft.engine.models.llama_layers import LayerOps
    from quickdraft.kernels import triton_ops

    config = LlamaConfig(vocab_size=97, hidden_size=384, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    models = {}
    for name, backend in (("torch", torch_attention), ("triton", ta)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config, F32, 256, backend)
        for p in model.parameters():
            p.data.normal_(0, 0.05)
        models[name] = model
    models["triton"].ops = LayerOps(triton_ops.rms_norm, triton_ops.add_rms_norm,
                                    triton_ops.rope_neox_, triton_ops.silu_mul)
    block_size, ctx_lens = 5, [12, 9]
    tables = [[0, 1, 2], [3, 4]]
    metas = {device: build_metadata([0, 7, 8], ctx_lens, tables, block_size, device)
             for device in {"cpu", DEVICE}}  # q_lens 7 and 1
    ids = torch.randint(0, 97, (8,))
    positions = torch.tensor([5, 6, 7, 8, 9, 10, 11, 8])
    out = {}
    for name, model in models.items():
        device = DEVICE if name == "triton" else "cpu"
        model.to(device)
        # the cached prefix of both sequences: the same random K/V for both backends
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(2, 6, block_size, 2, 64, generator=gen).to(device)
                  for _ in range(2)]
        with torch.no_grad():
            out[name] = model(ids.to(device), positions.to(device), caches,
                              metas[device]).cpu()
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- tree verification


def _tree_batch(seed):
    """One step mixing every kind of row: a random 7-node tree after 30 cached positions, a
    prefill chunk (causal, 20 rows), a plain decode (mask 0), a decode as a one-node tree
    (mask 1), a 5-node chain (masks 2^(i+1) - 1: causal by another name), a 12-node tree
    with no cached context (base 0) and a forest (rows without bit 0: roots after row 0).
    Returns (q_lens, ctx_lens, masks)."""
    rng = random.Random(seed)
    rows = [
        (30, random_tree(7, rng)),
        (25, [0] * 20),
        (16, [0]),
        (8, [1]),
        (12, tree_masks(list(range(-1, 4)))),
        (0, random_tree(12, rng)),
        (10, tree_masks([-1, -1, 0, 1, -1, 2, 4])),
    ]
    q_lens = [len(m) for _, m in rows]
    ctx_lens = [c + len(m) for c, m in rows]
    return q_lens, ctx_lens, [m for _, rows_masks in rows for m in rows_masks]


def test_masked_reference_without_masks_is_the_oracle():
    query, kv_cache, meta = _step(*MIXED, 5, 6, 2, 64, F32, seed=2)
    want = naive_attention(query.cpu(), kv_cache.cpu(), meta, 0.125)
    got = masked_reference(query, kv_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_tree_step_matches_masked_reference(dtype, heads, kv_heads, block_size):
    q_lens, ctx_lens, masks = _tree_batch(seed=block_size)
    query, kv_cache, meta = _step(q_lens, ctx_lens, block_size, heads, kv_heads, 64, dtype,
                                  seed=heads, tree_mask=masks)
    assert meta.tree_mask is not None
    meta.check_invariants()
    got = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=1)
    _check(got, query, kv_cache, meta, 0.125, masks)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 16), (32, 64), (16, 128)])
def test_tree_tile_sizes(block_m, block_n):
    """A tree crossing query-tile borders (BLOCK_Q = 5, 21, 10 rows at G = 3) and KV tiles
    smaller and larger than the cache blocks."""
    q_lens, ctx_lens, masks = _tree_batch(seed=4)
    query, kv_cache, meta = _step(q_lens, ctx_lens, 16, 6, 2, 64, F32, seed=3, tree_mask=masks)
    got = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=1, block_m=block_m,
                             block_n=block_n)
    _check(got, query, kv_cache, meta, 0.125, masks)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("splits", [3, 8])
def test_tree_split_kv(dtype, splits):
    """Split-KV forced on: trees after long contexts (the query rows land in the last split,
    earlier splits are pure context), next to a decode and a causal row set."""
    rng = random.Random(splits)
    trees = [random_tree(9, rng), random_tree(4, rng)]
    q_lens = [9, 1, 4, 6]
    ctx_lens = [200, 130, 60, 40]
    masks = trees[0] + [0] + trees[1] + [0] * 6
    query, kv_cache, meta = _step(q_lens, ctx_lens, 5, 6, 2, 64, dtype, seed=splits,
                                  tree_mask=masks)
    got = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=splits)
    _check(got, query, kv_cache, meta, 0.125, masks)


@pytest.mark.parametrize("dtype,splits", [(F32, 1), (BF16, 1), (F32, 4)],
                         ids=["fp32", "bf16", "fp32-split4"])
def test_64_row_tree(dtype, splits):
    """The widest tree: row 63's mask has bit 63 set (a negative int64 on the device)."""
    masks = [*random_tree(64, random.Random(64)), 0]  # and a plain decode
    query, kv_cache, meta = _step([64, 1], [100, 20], 16, 4, 2, 32, dtype, seed=64,
                                  tree_mask=masks)
    assert int(meta.tree_mask[63]) < 0
    got = ta.paged_attention(query, kv_cache, meta, 32**-0.5, num_splits=splits)
    _check(got, query, kv_cache, meta, 32**-0.5, masks)


def test_no_mask_and_causal_masks_are_bitwise_the_causal_kernel():
    """``tree_mask`` None is the causal kernel as before; a mask that only names causal sets
    (all 0, or every sequence written as a chain, 2^(i+1) - 1) gives bitwise the same output
    through HAS_TREE; and a tree changes exactly the rows whose set it narrows (its root, the
    chain and the other sequences' rows stay bitwise equal)."""
    q_lens, ctx_lens, masks = _tree_batch(seed=9)
    query, kv_cache, meta = _step(q_lens, ctx_lens, 5, 6, 2, 64, BF16, seed=9)
    assert meta.tree_mask is None
    causal = ta.paged_attention(query, kv_cache, meta, 0.125, num_splits=1)
    plain = ta.paged_attention_varlen(
        query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
        max_query_len=meta.max_query_len)
    assert torch.equal(plain, causal)
    row_in_seq = [i for q in q_lens for i in range(q)]
    chain = [(1 << (i + 1)) - 1 for i in row_in_seq]  # every q_len here is <= 64
    for causal_masks in ([0] * meta.num_tokens, chain):
        mask = torch.tensor([m - (1 << 64) if m >> 63 else m for m in causal_masks],
                            dtype=torch.int64, device=DEVICE)
        got = ta.paged_attention(query, kv_cache, dataclasses.replace(meta, tree_mask=mask),
                                 0.125, num_splits=1)
        assert torch.equal(got, causal)
    *_, tree_meta = _step(q_lens, ctx_lens, 5, 6, 2, 64, BF16, seed=9, tree_mask=masks)
    tree = ta.paged_attention(query, kv_cache, tree_meta, 0.125, num_splits=1)
    narrowed = torch.tensor([m not in (0, (1 << (i + 1)) - 1)
                             for m, i in zip(masks, row_in_seq, strict=True)])
    assert 0 < int(narrowed.sum()) < len(masks)
    row_equal = (tree == causal).flatten(1).all(1).cpu()
    assert row_equal[~narrowed].all()
    assert not row_equal[narrowed].any()


def test_tree_mask_must_be_int64_per_row():
    query, kv_cache, meta = _step([3], [10], 16, 2, 2, 16, F32)
    args = (query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    for bad in (torch.tensor([1, 3, 7], dtype=torch.int32), torch.tensor([1, 3])):
        with pytest.raises(ValueError, match="tree_mask"):
            ta.paged_attention_varlen(*args, max_query_len=3, tree_mask=bad.to(DEVICE))
