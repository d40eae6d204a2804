"""kernels.cpu_fused.argmax_rows: torch.argmax's answer on logits rows (greedy sampling and
verification), ties, NaN, infinities and signed zeros included."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="cpu_fused not built here")


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100, 49152, 151936])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_random_rows_match_torch(rows: int, n: int):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g)
    assert torch.equal(cpu_fused.argmax_rows(x), x.argmax(dim=-1))
    q = (x * 2).round()  # many ties: the first index wins
    assert torch.equal(cpu_fused.argmax_rows(q), q.argmax(dim=-1))
    bf = x.bfloat16().float()  # logits as the bf16 LM head leaves them: ties too
    assert torch.equal(cpu_fused.argmax_rows(bf), bf.argmax(dim=-1))


@pytest.mark.parametrize("n", [5, 40])
def test_special_values_match_torch(n: int):
    nan, inf = float("nan"), float("inf")
    rows = torch.full((8, n), -1.0)
    rows[0, [3, 1]] = nan  # the first NaN, wherever the max is
    rows[1, :] = -inf
    rows[2, [2, 4]] = inf
    rows[3, :] = 0.0
    rows[3, 1] = -0.0  # -0.0 and +0.0 tie
    rows[3, 0] = -0.0
    rows[4, n - 1] = nan  # in the tail
    rows[5, n - 1] = 7.0  # the max in the tail
    rows[6, :] = nan
    rows[7, 2] = -inf
    got = cpu_fused.argmax_rows(rows)
    assert torch.equal(got, rows.argmax(dim=-1)), (got, rows.argmax(dim=-1))


def test_other_inputs_fall_back_to_torch():
    x = torch.randn(4, 33)
    for y in (x.bfloat16(), x.t().contiguous().t(), x[0], x.double()):
        assert torch.equal(cpu_fused.argmax_rows(y), y.argmax(dim=-1))
    assert cpu_fused.argmax_rows(torch.empty(0, 8)).shape == (0,)
