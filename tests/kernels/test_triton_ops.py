"""kernels.triton_ops against the torch references of kernels.cpu_fused.

Without a GPU this runs on CPU tensors through the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); skipped without triton. On a GPU
machine ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton_ops.py`` runs them compiled.

The kernels round where torch rounds, so in half precision they agree with the references
to the bit except where the mean of squares (RMSNorm, summed in another order) or exp (SiLU)
differ in their last fp32 bit and that flips a rounding: rarely, by one unit in the last place
(two for SiLU*up, where a flipped silu(gate) is then multiplied). RoPE involves neither and is
compared bit for bit. In fp32 nothing hides those last-bit differences: a few ulps.
"""


import pytest
import torch

pytest.importorskip("triton")

from quickdraft.kernels import torch_ops
from quickdraft.kernels import triton_ops as ops

if ops.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1_000_003 + k
    return torch.Generator().manual_seed(seed % (2**63))


def _randn(*shape, g, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of the dtype, per element (same-sign finite values
    or tiny ones; enough for these tests)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    itype = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}[got.dtype]
    a = got.contiguous().view(itype).to(torch.int64)
    b = want.contiguous().view(itype).to(torch.int64)
    return (a - b).abs()


def _close(got, want, max_ulps=1, max_frac=0.02):
    """Every element within ``max_ulps``, and at most ``max_frac`` of them differ at all. In
    fp32 nothing rounds the difference away: one ulp in the mean of squares or in exp moves
    most outputs by a few ulps (~1e-7 relative each)."""
    if want.dtype == F32:
        max_ulps, max_frac = max(max_ulps, 4), 1.0
    got = got.cpu()
    assert torch.isfinite(got).all()
    d = _ulps(got, want)
    assert int(d.max()) <= max_ulps, f"max {int(d.max())} ulps"
    frac = float((d > 0).float().mean())
    assert frac <= max_frac, f"{frac:.2%} of elements differ"


# ---------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100), (3, 576)])
def test_rms_norm(dtype, rows, hidden):
    g = _gen(1, rows, hidden)
    x = _randn(rows, hidden, g=g, dtype=dtype, scale=3.0)
    w = _randn(hidden, g=g, dtype=dtype)
    want = torch_ops.rms_norm(x, w, 1e-5)
    got = ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (6, 100), (2, 576)])
def test_add_rms_norm(dtype, rows, hidden):
    g = _gen(2, rows, hidden)
    x = _randn(rows, hidden, g=g, dtype=dtype)
    res = _randn(rows, hidden, g=g, dtype=dtype, scale=4.0)
    w = _randn(hidden, g=g, dtype=dtype)
    want_y, want_r = torch_ops.add_rms_norm(x, res, w, 1e-6)
    got_y, got_r = ops.add_rms_norm(x.to(DEVICE), res.to(DEVICE), w.to(DEVICE), 1e-6)
    assert torch.equal(got_r.cpu(), want_r)  # one rounded add: exact
    _close(got_y, want_y)


def test_rms_norm_leading_dims_and_fp32_weight():
    """x [2, 3, hidden] bf16 with an fp32 weight: torch promotes the output to fp32."""
    g = _gen(3)
    x = _randn(2, 3, 96, g=g, dtype=BF16)
    w = _randn(96, g=g, dtype=F32)
    want = torch_ops.rms_norm(x, w, 1e-5)
    got = ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    assert got.dtype == F32 and got.shape == (2, 3, 96)
    _close(got, want)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_chunked_rows(monkeypatch, residual):
    """Rows longer than one block: the two-pass path (block shrunk to 32 for the test)."""
    monkeypatch.setattr(ops, "_MAX_NORM_BLOCK", 32)
    g = _gen(4, residual)
    x = _randn(3, 100, g=g, dtype=BF16)
    res = _randn(3, 100, g=g, dtype=BF16)
    w = _randn(100, g=g, dtype=BF16)
    if residual:
        want_y, want_r = torch_ops.add_rms_norm(x, res, w, 1e-5)
        got_y, got_r = ops.add_rms_norm(x.to(DEVICE), res.to(DEVICE), w.to(DEVICE), 1e-5)
        assert torch.equal(got_r.cpu(), want_r)
    else:
        want_y = torch_ops.rms_norm(x, w, 1e-5)
        got_y = ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    _close(got_y, want_y)


# ---------------------------------------------------------------------------------- RoPE


def _cos_sin(rows, d, dtype, g):
    """Like RotaryEmbedding.cos_sin: [rows, 1, d], the two halves equal."""
    pos = torch.randint(0, 4000, (rows,), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 4, 2, 64), (5, 6, 2, 128), (3, 3, 3, 48)])
def test_rope_in_place_on_fused_qkv_view(dtype, rows, heads, kv_heads, d):
    """As the model calls it: the q|k columns of a fused qkv output, rotated in place; the v
    columns must stay untouched."""
    g = _gen(5, rows, heads, d)
    qkv = _randn(rows, (heads + 2 * kv_heads) * d, g=g, dtype=dtype)
    cos, sin = _cos_sin(rows, d, dtype, g)
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    want = torch_ops.rope_neox(qk, cos, sin)
    qkv_dev = qkv.to(DEVICE)
    qk_dev = qkv_dev[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    out = ops.rope_neox_(qk_dev, cos.to(DEVICE), sin.to(DEVICE))
    assert out is qk_dev
    got = qkv_dev.cpu()
    if ops.INTERPRET or dtype != F32:
        assert torch.equal(got[:, : (heads + kv_heads) * d].view_as(want), want)
    else:  # compiled fp32: the same ops, but sin/cos-free; allow the last bit anyway
        _close(got[:, : (heads + kv_heads) * d].view_as(want), want)
    assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])


def test_rope_bf16_x_with_fp32_tables():
    """cos/sin in fp32: torch computes in fp32, the in-place write rounds once to bf16."""
    g = _gen(6)
    x = _randn(4, 5, 64, g=g, dtype=BF16)
    cos, sin = _cos_sin(4, 64, F32, g)
    want = torch_ops.rope_neox(x, cos[:, 0], sin[:, 0]).to(BF16)
    got = ops.rope_neox_(x.to(DEVICE), cos[:, 0].to(DEVICE), sin[:, 0].to(DEVICE))
    assert torch.equal(got.cpu(), want)


# ---------------------------------------------------------------------------------- SiLU*up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 100), (2, 3, 2 * 1500)])
def test_silu_mul(dtype, shape):
    g = _gen(7, *shape)
    gate_up = _randn(*shape, g=g, dtype=dtype, scale=3.0)
    want = torch_ops.silu_mul(gate_up)
    got = ops.silu_mul(gate_up.to(DEVICE))
    assert got.dtype == want.dtype and got.shape == want.shape
    # exp differs from torch's in the last fp32 bit now and then; when that flips the rounding
    # of silu(gate) (one ulp), the product with up can move by two of its own ulps
    max_ulps = 2
    if dtype == F32 and not ops.INTERPRET:
        # Compiled for CUDA, tl.exp(-g) is ex2.approx(-g * log2 e): the product's rounding is
        # scaled by |g * log2 e|, so the relative error grows by ~1.44 ulp per unit of |g|
        # (measured on an H200, triton 3.6, |g| <= ~12 here: 5, 6 and 7 ulps on the three
        # shapes). bf16 and fp16 round it away.
        max_ulps = 4 + int(1.5 * float(gate_up[..., : shape[-1] // 2].abs().max()))
    _close(got, want, max_ulps=max_ulps)


# ------------------------------------------------------------------------------- robustness


def test_rejects_bad_shapes():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        ops.rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError):
        ops.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError):
        ops.rope_neox_(torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(2, 6), torch.zeros(2, 6))


def test_empty_inputs():
    assert ops.rms_norm(torch.zeros(0, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                        1e-5).shape == (0, 8)
    assert ops.silu_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)
