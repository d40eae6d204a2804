"""The triton backend's batch-invariant mode (kernels/triton_matmul.py,
kernels/triton_invariant.py): a row's result has the same bits whatever else is in its step.

The property speculation needs: a token verified as one of ``1 + k`` chain rows, beside other
requests' decodes and a prefill chunk, gets exactly the logits of its 1-row decode step. On a
CPU this runs the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``); on a
GPU machine ``TRITON_INTERPRET=0 pytest tests/kernels/test_batch_invariant.py`` runs the same
tests compiled, where cuBLAS and the tuned attention tiles do NOT have the property (that is
what the GPU run checks; the interpreter's dots are numpy's).
"""

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from quickdraft.kernels import triton_invariant as ti
from quickdraft.kernels import triton_matmul as tm
from quickdraft.kernels.attention_metadata import build_metadata
from tests.kernels.attention_oracle import naive_attention

if ti.interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

F32, BF16 = torch.float32, torch.bfloat16


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_matches_torch(dtype: torch.dtype, bias: bool) -> None:
    """Within rounding of an fp32 reference: fp32 exact products (no TF32), bf16 one
    rounding of an fp32 accumulation (at most one bf16 ulp of |y| < 64: 0.25)."""
    x, w = _rand(37, 96, dtype=dtype, seed=1), _rand(70, 96, dtype=dtype, seed=2)
    b = _rand(70, dtype=dtype, seed=3) if bias else None
    got = tm.linear(x, w, b)
    want = F.linear(x.cpu().double(), w.cpu().double(), None if b is None else b.cpu().double())
    assert got.shape == (37, 70) and got.dtype == dtype
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= (1e-4 if dtype == F32 else 0.25), err


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_linear_row_bits_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Every row of a 40-row product equals the same row computed alone, in a 5-row
    verification-sized batch and at another offset in a 17-row batch."""
    x, w = _rand(40, 96, dtype=dtype, seed=4), _rand(130, 96, dtype=dtype, seed=5)
    b = _rand(130, dtype=dtype, seed=6)
    full = tm.linear(x, w, b)
    for r in (0, 7, 16, 39):
        assert torch.equal(tm.linear(x[r:r + 1], w, b)[0], full[r])
    assert torch.equal(tm.linear(x[3:8], w, b), full[3:8])
    assert torch.equal(tm.linear(x[9:26], w, b), full[9:26])
    assert torch.equal(tm.linear(x[9:26].t().contiguous().t(), w, b), full[9:26])  # strides


def test_linear_rejects_bad_input() -> None:
    x, w = _rand(3, 32, dtype=F32, seed=7), _rand(8, 32, dtype=F32, seed=8)
    with pytest.raises(ValueError, match="does not fit"):
        tm.linear(x[:, :16], w)
    with pytest.raises(TypeError, match="expected one of"):
        tm.linear(x.to(BF16), w)
    with pytest.raises(ValueError, match="bias"):
        tm.linear(x, w, torch.zeros(7, device=DEVICE))
    assert tm.linear(x[:0], w).shape == (0, 8)


def _cache(ctxs: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype,
           seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """A random cache and a shuffled block table per context length."""
    rng = random.Random(seed)
    blocks = list(range(sum(-(-c // block_size) for c in ctxs) + 3))
    rng.shuffle(blocks)
    kv = _rand(2, len(blocks), block_size, kv_heads, dim, dtype=dtype, seed=seed)
    return kv, [[blocks.pop() for _ in range(-(-c // block_size))] for c in ctxs]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("block_size", [16, 5])
def test_chain_rows_equal_their_decode_steps(dtype: torch.dtype, block_size: int) -> None:
    """A 5-row chain verification of sequence A (positions 40..44), in one step with a
    3-token decode batch and a 30-token prefill chunk of sequence B, gives each of A's rows
    the bits of a 1-row decode step at its position (the same cache)."""
    heads, kv_heads, dim = 6, 2, 64
    scale = dim ** -0.5
    a_ctx, b_ctx = 45, 50
    kv, (a_table, b_table) = _cache([a_ctx, b_ctx], block_size, kv_heads, dim, dtype, seed=11)
    query = _rand(5 + 30, heads, dim, dtype=dtype, seed=12)
    meta = build_metadata([0, 5, 35], [a_ctx, b_ctx], [a_table, b_table], block_size, DEVICE)
    step = ti.paged_attention(query, kv, meta, scale)
    want = naive_attention(query.cpu(), kv.cpu(), meta, scale)
    assert (step.cpu().float() - want.float()).abs().max() <= (5e-6 if dtype == F32 else 1.6e-2)
    for i in range(5):
        pos = a_ctx - 5 + i
        alone = build_metadata([0, 1], [pos + 1], [a_table], block_size, DEVICE)
        one = ti.paged_attention(query[i:i + 1], kv, alone, scale)
        assert torch.equal(one[0], step[i]), f"row {i}"


def test_split_and_tile_choices_are_fixed() -> None:
    """Whatever a caller or a graph asks for, no split-KV and one query tile shape."""
    assert ti.choose_num_splits(1, 2, 1, 32768) == 1
    heads, kv_heads, dim, block_size = 6, 2, 64, 16
    kv, (table,) = _cache([300], block_size, kv_heads, dim, BF16, seed=13)
    query = _rand(1, heads, dim, dtype=BF16, seed=14)
    meta = build_metadata([0, 1], [300], [table], block_size, DEVICE)
    plain = ti.paged_attention(query, kv, meta, 0.125)
    asked = ti.paged_attention(query, kv, meta, 0.125, num_splits=4, block_m=64)
    assert torch.equal(plain, asked)
