"""kernels.cpu_fused.top_log_softmax: torch's ``topk(log_softmax(x), k)`` on logits rows (a
draft head's candidates), ties to the smaller index."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="cpu_fused not built")


def _reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values of ``topk(log_softmax(x), k)``; indices by (value desc, index asc)."""
    lp = torch.log_softmax(x, dim=-1)
    order = sorted(range(x.shape[1]), key=lambda i: (-float(x[0, i]), i))[:k]
    return lp[0, order], torch.tensor(order)


@pytest.mark.parametrize("n", [7, 8, 100, 4096])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_matches_torch_log_softmax_and_topk(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    x = torch.randn(5, n, generator=g) * 4
    values, indices = cpu_fused.top_log_softmax(x, k)
    want = torch.topk(torch.log_softmax(x, dim=-1), k)
    assert torch.equal(indices, want.indices)  # (no ties in random floats)
    torch.testing.assert_close(values, want.values, rtol=0, atol=2e-6)


def test_ties_go_to_the_smaller_index_and_nan_ranks_first() -> None:
    x = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.5, 2.0, 0.5, -3.0, 0.5, 1.0]])
    values, indices = cpu_fused.top_log_softmax(x, 5)
    want_values, want_indices = _reference(x, 5)
    assert indices[0].tolist() == want_indices.tolist() == [1, 3, 5, 9, 0]
    torch.testing.assert_close(values[0], want_values, rtol=0, atol=2e-6)
    nan = torch.tensor([[1.0, float("nan"), 3.0, float("-inf"), float("nan")] + [0.0] * 11])
    values, indices = cpu_fused.top_log_softmax(nan, 3)
    assert indices[0].tolist() == [1, 4, 2]
    assert values.isnan().all()  # (log_softmax of a row with a NaN is NaN everywhere)


def test_a_row_beyond_the_vector_tail_and_k_equal_to_n() -> None:
    x = torch.arange(19, dtype=torch.float32).flip(0).reshape(1, 19)  # the best come first
    values, indices = cpu_fused.top_log_softmax(x, 19)
    assert indices[0].tolist() == list(range(19))
    torch.testing.assert_close(values, torch.log_softmax(x, -1), rtol=0, atol=2e-6)
    late = torch.zeros(1, 21)
    late[0, 20] = 5.0  # in the scalar tail after the 8-wide loop
    assert cpu_fused.top_log_softmax(late, 2)[1][0].tolist() == [20, 0]


def test_other_inputs_run_torch() -> None:
    x = torch.randn(3, 64, dtype=torch.float64)
    values, indices = cpu_fused.top_log_softmax(x, 4)
    want = torch.topk(torch.log_softmax(x.float(), dim=-1), 4)
    assert torch.equal(indices, want.indices) and torch.equal(values, want.values)
    strided = torch.randn(64, 3).t()  # not contiguous
    assert torch.equal(cpu_fused.top_log_softmax(strided, 2)[1],
                       torch.topk(strided, 2).indices)
    assert cpu_fused.top_log_softmax(torch.zeros(0, 8), 2)[0].shape == (0, 2)
