"""kernels.cpu_q4q8: 4-bit weights x 8-bit activations, against a plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_q4q8
from tests.kernels.four_bit_oracle import assert_rows_threads_and_isa_agree, dense
from tests.kernels.four_bit_oracle import q8_rounded as _q8_reference
from tests.kernels.four_bit_oracle import random_q4_weights as _weights

pytestmark = pytest.mark.skipif(not cpu_q4q8.available(), reason="q4q8 kernel not built here")


def _dense(q, d, m) -> torch.Tensor:  # fp64 [out, k]
    return dense(q, d, m, torch.float64)


@pytest.mark.parametrize(("out", "k"), [(960, 576), (64, 1536), (48, 64), (40, 64), (8, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_linear_matches_the_q8_reference(out, k, rows):
    """Against x rounded to 8 bits as the kernel does and the exact 4-bit weights in fp64,
    only fp32 accumulation (the sum of |terms| times a few fp32 epsilons: offsets cancel)
    and the output's bf16 rounding (2^-9 of each value) are left. Against unrounded x the
    8-bit activations add ~0.5 % of the largest output."""
    q, d, m = _weights(out, k, seed=out + k)
    w = cpu_q4q8.pack(q, d, m)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    y = cpu_q4q8.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    ref = _q8_reference(x) @ _dense(q, d, m).t()
    magnitude = _q8_reference(x).abs() @ _dense(q, d, m).abs().t()  # sum of |terms|
    error = (y.double() - ref).abs()
    assert bool((error <= 2 ** -8 * ref.abs() + 1e-6 * magnitude).all()), \
        float((error - 2 ** -8 * ref.abs()).div(magnitude).max())
    scale = float(ref.abs().max())
    exact = x.double() @ _dense(q, d, m).t()
    torch.testing.assert_close(y.double(), exact, rtol=0.02, atol=0.02 * scale)


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("out", [576, 40])  # pairs of 8-column groups; and an odd last group
def test_rows_threads_instruction_sets_and_layouts_give_the_same_bits(out, paired):
    """Each row is computed alone: a row's bits do not depend on the other rows (1..17 of
    them, crossing the 16-row passes), the thread count, VNNI against AVX2 (whose loops
    take 16 and 8 columns at a time) or the weights' layout (column groups paired or not)."""
    q, d, m = _weights(out, 1536, seed=5)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = cpu_q4q8.pack(q, d, m, paired=paired)
    assert w.paired == paired and cpu_q4q8.pack(q, d, m).paired == cpu_q4q8.pairs_columns()
    assert_rows_threads_and_isa_agree(cpu_q4q8.linear, w, x, cpu_q4q8.uses_vnni(),
                                      cpu_q4q8.uses_amx())
    assert torch.equal(cpu_q4q8.linear(x, w),
                       cpu_q4q8.linear(x, cpu_q4q8.pack(q, d, m, paired=not paired)))


def test_zero_and_extreme_activations():
    """An all-zero block rounds to zeros (no division by zero); a block with one huge value
    keeps it (the others round towards zero)."""
    q, d, m = _weights(16, 64, seed=2)
    w = cpu_q4q8.pack(q, d, m)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 3] = 1e4
    y = cpu_q4q8.linear(x, w)
    assert torch.equal(y[0], torch.zeros(16, dtype=torch.bfloat16))
    ref = _q8_reference(x) @ _dense(q, d, m).t()
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -8, atol=0.0)
    if cpu_q4q8.uses_amx():
        assert torch.equal(cpu_q4q8.linear(x, w, amx_rows=1), y)


def test_fp32_input_and_leading_dims():
    q, d, m = _weights(32, 64, seed=3)
    w = cpu_q4q8.pack(q, d, m)
    x = torch.randn(2, 3, 64)
    y = cpu_q4q8.linear(x, w)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert torch.equal(y.view(6, 32), cpu_q4q8.linear(x.view(6, 64).bfloat16(), w).float())


def test_amx_thresholds_are_measured_or_forced(monkeypatch):
    """Where AMX runs, from how many rows is measured at load (1..16, or 0: never) or set by
    QUICKDRAFT_AMX; elsewhere nothing runs on it and asking for it is refused."""
    if not cpu_q4q8.uses_amx():
        assert cpu_q4q8.amx_rows() == (0, 0)
        with pytest.raises(RuntimeError, match="AMX"):
            cpu_q4q8.linear(torch.zeros(1, 64), cpu_q4q8.pack(*_weights(8, 64, seed=1)),
                            amx_rows=1)
        return
    assert all(rows in (0, 4, 6, 8, 10, 12, 16) for rows in cpu_q4q8.amx_rows())
    kernel = cpu_q4q8._kernel()
    for value, want in (("off", (0, 0)), ("8", (8, 8)), ("40", (16, 16))):
        monkeypatch.setenv("QUICKDRAFT_AMX", value)
        assert cpu_q4q8._amx_thresholds(kernel) == want


def test_bad_shapes_are_refused():
    q, d, m = _weights(16, 64, seed=4)
    with pytest.raises(ValueError, match="out % 8"):
        cpu_q4q8.pack(q[:12], d[:12], m[:12])
    with pytest.raises(ValueError, match="in % 32"):
        cpu_q4q8.pack(q[:, :48], d[:, :1], m[:, :1])
    w = cpu_q4q8.pack(q, d, m)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_q4q8.linear(torch.randn(2, 32), w)
