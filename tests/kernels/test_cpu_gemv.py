"""kernels.cpu_gemv: the AVX2 bf16 GEMV against an fp32 reference rounded once to bf16."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from quickdraft.kernels import cpu_gemv

needs_kernel = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 product of the same bf16 inputs, rounded once to bf16."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def _inputs(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + m * 10_007 + n * 101 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    exact = (got == want).float().mean().item()
    assert exact >= 0.99, f"only {exact:.4f} of elements match the rounded fp32 reference"


@needs_kernel
def test_available_on_this_machine():
    assert cpu_gemv.available()
    assert cpu_gemv.available()  # memoised, still fine


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 7, 576, 1537])
@pytest.mark.parametrize("k", [576, 64, 100, 1536])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_matches_fp32_reference(m: int, k: int, n: int, bias: bool):
    x, w, b = _inputs(m, n, k, bias)
    _check(cpu_gemv.linear_bf16(x, w, b), _want(x, w, b))


@needs_kernel
@pytest.mark.parametrize("m", [4, 6, 7])
def test_other_row_counts_and_odd_k(m: int):
    for k, n in [(17, 9), (31, 1000), (1, 5), (2048, 130)]:
        x, w, b = _inputs(m, n, k, True, seed=1)
        _check(cpu_gemv.linear_bf16(x, w, b), _want(x, w, b))


@needs_kernel
def test_batched_leading_dims_and_noncontiguous_x():
    x, w, b = _inputs(6, 300, 576, True, seed=2)
    x3 = x.view(2, 3, 576)
    got = cpu_gemv.linear_bf16(x3, w, b)
    assert got.shape == (2, 3, 300)
    _check(got, _want(x3, w, b))
    xt = torch.randn(576, 4).to(torch.bfloat16).t()  # [4, 576], not contiguous
    _check(cpu_gemv.linear_bf16(xt, w), _want(xt, w, None))
    bs = torch.randn(600).to(torch.bfloat16)[::2]  # strided bias
    _check(cpu_gemv.linear_bf16(x, w, bs), _want(x, w, bs))
    xv = x.view(-1)[:576]  # 1-D input
    assert cpu_gemv.linear_bf16(xv, w, b).shape == (300,)
    _check(cpu_gemv.linear_bf16(xv, w, b), _want(xv, w, b))


@needs_kernel
def test_single_thread_matches_threaded():
    x, w, b = _inputs(3, 3000, 576, True, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.linear_bf16(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, cpu_gemv.linear_bf16(x, w, b))


@needs_kernel
def test_special_values_round_like_torch():
    k = 64
    w = torch.zeros(8, k, dtype=torch.bfloat16)
    w[:, 0] = 1.0
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    vals = [float("inf"), float("-inf"), float("nan"), 3e38, -0.0, 1e-40, 1.0, -2.5]
    for i, v in enumerate(vals):
        w[i, 0] = v
    x[0, 0] = 1.0
    got = cpu_gemv.linear_bf16(x, w)
    want = _want(x, w, None)
    assert torch.equal(got[0, :2], want[0, :2])
    assert torch.isnan(got[0, 2])
    assert torch.equal(got[0, 3:], want[0, 3:])


def test_fallbacks_match_reference(monkeypatch):
    # more than MAX_ROWS rows, fp32, fp16: plain F.linear
    monkeypatch.setattr(cpu_gemv, "MAX_ROWS", 8)
    x, w, b = _inputs(16, 100, 64, True, seed=4)
    assert torch.equal(cpu_gemv.linear_bf16(x, w, b), cpu_gemv.reference_linear(x, w, b))
    xf, wf, bf = x.float(), w.float(), b.float()
    got = cpu_gemv.linear_bf16(xf, wf, bf)
    assert got.dtype == torch.float32
    assert torch.equal(got, F.linear(xf, wf, bf))
    xh, wh = x.half(), w.half()
    assert torch.equal(cpu_gemv.linear_bf16(xh, wh), F.linear(xh, wh))
    # non-contiguous weight
    wt = w.t().contiguous().t()
    assert torch.equal(cpu_gemv.linear_bf16(x[:2], wt), F.linear(x[:2], wt))


def test_autograd_falls_back():
    x, w, _ = _inputs(1, 10, 64, False, seed=5)
    w.requires_grad_(True)
    y = cpu_gemv.linear_bf16(x, w)
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert w.grad is not None


def test_unavailable_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_kernel", lambda: None)
    assert not cpu_gemv.available()
    x, w, b = _inputs(1, 20, 64, True, seed=6)
    assert torch.equal(cpu_gemv.linear_bf16(x, w, b), F.linear(x, w, b))


@needs_kernel
def test_build_failure_warns_and_falls_back(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_gemv, "_SOURCE", bad)
    cpu_gemv._kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_gemv.__name__):
            assert not cpu_gemv.available()
            assert not cpu_gemv.available()
        assert sum("build failed" in r.getMessage() for r in caplog.records) == 1
        x, w, b = _inputs(2, 20, 64, True, seed=7)
        assert torch.equal(cpu_gemv.linear_bf16(x, w, b), F.linear(x, w, b))
    finally:
        monkeypatch.undo()
        cpu_gemv._kernel.cache_clear()
    assert cpu_gemv.available()


@pytest.mark.skipif(not cpu_gemv.available(), reason="needs gcc and an AVX2/FMA CPU")
@pytest.mark.parametrize(("m", "n", "k"), [(100, 1000, 576), (37, 300, 1536), (9, 64, 40)])
def test_many_rows_walk_weight_tiles_and_stay_row_invariant(m, n, k):
    """More rows than one pass (8) go through cache-sized weight tiles: each output is the
    same bits as for that row alone (what makes prefill and decode agree), and within the
    kernel's tolerance of the fp32 product."""
    x, w, b = _inputs(m, n, k, True, seed=9)
    got = cpu_gemv.linear_bf16(x, w, b)
    _check(got, _want(x, w, b))
    for i in (0, 7, 8, m // 2, m - 1):
        assert torch.equal(cpu_gemv.linear_bf16(x[i:i + 1], w, b), got[i:i + 1]), i
    assert torch.equal(cpu_gemv.linear_bf16(x[3:11], w, b), got[3:11])
