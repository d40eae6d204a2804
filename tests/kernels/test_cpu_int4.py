"""kernels.cpu_int4: linear layers on 4-bit group-32 weights (torch's CPU int4 kernel)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_int4
from tests.kernels.four_bit_oracle import dense as _dense
from tests.kernels.four_bit_oracle import random_q4_weights as _weights

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="no CPU int4 ops in torch")


@pytest.mark.parametrize(("out", "k"), [(960, 576), (64, 1536), (48, 64)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_linear_is_close_to_the_fp32_product(out, k, rows):
    """Stated tolerance: bf16 activations and bf16 scale/offset put the result within
    2 % of the largest output (plus 2 % of each value) of x @ w.T in fp32; against the
    weights the kernel really uses (bf16-rounded scales) only bf16 output rounding is left."""
    q, d, m = _weights(out, k, seed=out + k)
    w = cpu_int4.pack(q, d, m)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = cpu_int4.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    exact = x.float() @ _dense(q, d, m).t()
    scale = float(exact.abs().max())
    torch.testing.assert_close(y.float(), exact, rtol=0.02, atol=0.02 * scale)
    # the weights the kernel really uses: scale d and offset m + 8 d rounded to bf16
    d16, z16 = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
    used = x.float() @ _dense(q.float() - 8, d16, z16).t()
    err = (y.float() - used).abs()
    assert float(err.max()) <= 2**-7 * float(used.abs().max()) + 1e-6


def test_fp32_input_returns_fp32():
    w = cpu_int4.pack(*_weights(32, 64, seed=1))
    x = torch.randn(3, 64)
    y = cpu_int4.linear(x, w)
    assert y.dtype == torch.float32
    assert torch.equal(y, cpu_int4.linear(x.bfloat16(), w).float())


def test_a_row_does_not_depend_on_the_other_rows():
    """Batch invariance: each row alone equals the same row inside any batch."""
    w = cpu_int4.pack(*_weights(1536, 576, seed=2))
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    full = cpu_int4.linear(x, w)
    for start, size in [(0, 1), (7, 1), (3, 2), (10, 5), (40, 8), (100, 17), (0, 64),
                        (299, 1)]:
        assert torch.equal(cpu_int4.linear(x[start:start + size], w),
                           full[start:start + size]), (start, size)


def test_pack_rejects_bad_shapes():
    q, d, m = _weights(8, 64, seed=3)
    with pytest.raises(ValueError, match="in % 32"):
        cpu_int4.pack(q[:, :48], d, m)
    with pytest.raises(ValueError, match="out % 16"):
        cpu_int4.pack(q[:5], d[:5], m[:5])
    assert cpu_int4.supports(960, 576) and not cpu_int4.supports(33, 64)
    with pytest.raises(ValueError):
        cpu_int4.pack(q, d[:, :1], m)


@pytest.mark.parametrize(("out", "k"), [(960, 576), (64, 1536)])
def test_quantize_moves_each_weight_by_at_most_half_a_step(out, k):
    """Q4_1-style rounding: every weight within d/2 of its group's grid, codes 0..15, and
    the packed matrix multiplies like the dequantized one."""
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(out)) * 0.05
    w[0, :32] = 0.25  # a constant group: d = 0, exact
    q, d, m = cpu_int4.quantize(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == (out, k // 32)
    back = _dense(q, d, m)
    step = d.repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-7).all())
    assert torch.equal(back[0, :32], w[0, :32])
    x = torch.randn(4, k).bfloat16()
    exact = x.float() @ back.t()
    y = cpu_int4.linear(x, cpu_int4.pack(q, d, m)).float()
    torch.testing.assert_close(y, exact, rtol=0.02, atol=0.02 * float(exact.abs().max()))


def test_quantize_refuses_a_ragged_row():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_int4.quantize(torch.zeros(16, 40))
