"""kernels.cpu_fused: fused bf16 RMSNorm / RoPE / SiLU*up against their plain-torch references.

RoPE, SiLU*up and the residual add emulate torch's op order and roundings on every CPU, so
they are compared bit for bit (``_bits_equal``: same bf16 bit patterns, NaN compared as NaN).
RMSNorm sums in one fixed order on every CPU: bit for bit against that order written out in
``sum_order_oracle``, within two bf16 ulps of torch (whose order depends on the CPU)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quickdraft.kernels import cpu_fused, torch_ops
from tests.kernels import sum_order_oracle

needs_kernel = pytest.mark.skipif(
    shutil.which("gcc") is None or not cpu_fused._cpu_supported(),
    reason="needs gcc and an AVX2/FMA/F16C CPU")

ROWS = [1, 3, 17, 64]
BF16 = torch.bfloat16


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 1_000_003 + k
    return torch.Generator().manual_seed(seed % (2**63))


def _randn(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose bf16 bits differ (any NaN equals any NaN)."""
    assert got.dtype == want.dtype == BF16 and got.shape == want.shape
    nan = got.isnan() & want.isnan()
    return int(((got.view(torch.int16) != want.view(torch.int16)) & ~nan).sum())


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = _mismatches(got, want)
    assert bad == 0, f"{bad} of {want.numel()} elements differ from the reference"


@needs_kernel
def test_available_on_this_machine():
    assert cpu_fused.available()
    assert cpu_fused.available()  # memoised


# ---------------------------------------------------------------------------------- RMSNorm


def _within_two_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """The stated tolerance to torch's RMSNorm: torch sums the squares in its own CPU's
    order (16 lanes under AVX512), the kernel in one fixed order, so the rsqrt may differ
    by an fp32 ulp and an output by up to two bf16 ulps (each is rounded twice)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 64, 100])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_bit_exact_to_its_order_and_close_to_torch(rows: int, hidden: int):
    g = _gen(1, rows, hidden)
    x = _randn(rows, hidden, g=g, scale=3.0)
    w = _randn(hidden, g=g)
    for eps in (1e-5, 1e-6):
        y = cpu_fused.rms_norm(x, w, eps)
        _bits_equal(y, sum_order_oracle.rms_norm(x, w, eps)[0])
        _within_two_ulps(y, torch_ops.rms_norm(x, w, eps))


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 64, 100])
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_bit_exact_to_its_order_and_close_to_torch(rows: int, hidden: int):
    g = _gen(2, rows, hidden)
    x = _randn(rows, hidden, g=g, scale=2.0)
    res = _randn(rows, hidden, g=g, scale=5.0)
    w = _randn(hidden, g=g)
    y, r = cpu_fused.add_rms_norm(x, res, w, 1e-5)
    y_oracle, r_oracle = sum_order_oracle.rms_norm(x, w, 1e-5, residual=res)
    y_ref, r_ref = torch_ops.add_rms_norm(x, res, w, 1e-5)
    _bits_equal(r, r_ref)  # the add is the same on every CPU
    _bits_equal(r, r_oracle)
    _bits_equal(y, y_oracle)
    _within_two_ulps(y, y_ref)
    assert r.data_ptr() not in (x.data_ptr(), res.data_ptr())  # new tensors, inputs intact


SUM_SIZES = [1, 3, 4, 5, 7, 8, 9, 31, 64, 100, 127, 129, 576, 960, 1536, 2049, 4096, 8192, 20000]


def _sumsq_inputs(n: int) -> torch.Tensor:
    g = _gen(3, n)
    return torch.randn(6, n, generator=g) * torch.rand(6, 1, generator=g) * 10


@needs_kernel
@pytest.mark.parametrize("n", SUM_SIZES)
def test_sum_of_squares_in_the_fixed_order(n: int):
    """The kernel's sum of squares is the oracle's order bit for bit, on every CPU; a plain
    (fp64) sum rounded to fp32 differs in about half of the rows, so the test can tell."""
    lib = cpu_fused._lib()
    assert lib is not None
    fn = lib.dll.qd_sumsq_f32
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    x = _sumsq_inputs(n)
    out = torch.empty(x.shape[0])
    assert fn(x.data_ptr(), out.data_ptr(), x.shape[0], n) == 0
    want = torch.tensor([sum_order_oracle.sum_of_squares(row) for row in x])
    assert torch.equal(out, want)


_TORCH_SUMS = """
import sys, torch
from tests.kernels.test_cpu_fused import SUM_SIZES, _sumsq_inputs
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
inputs = {n: _sumsq_inputs(n) for n in SUM_SIZES}  # saved: randn differs between kinds
torch.save({n: (x, x.pow(2).sum(-1)) for n, x in inputs.items()}, sys.argv[1])
"""


def test_fixed_order_is_torchs_avx2_order(tmp_path):
    """The oracle's order is ATen's AVX2 sum (torch forced to AVX2 in a child process, which
    works on AVX512 machines too), so on AVX2 machines the kernel equals torch bit for bit."""
    out = tmp_path / "sums.pt"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    subprocess.run([sys.executable, "-c", _TORCH_SUMS, str(out)], check=True, env=env,
                   cwd=Path(__file__).parents[2], timeout=120)
    sums = torch.load(out)
    for n in SUM_SIZES:
        x, torch_sums = sums[n]
        want = torch.tensor([sum_order_oracle.sum_of_squares(row) for row in x])
        assert torch.equal(torch_sums, want), n


@needs_kernel
def test_rms_norm_many_rows_and_leading_dims():
    g = _gen(4)
    x = _randn(2, 300, 576, g=g, scale=4.0)
    w = _randn(576, g=g)
    y = cpu_fused.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape
    _bits_equal(y, sum_order_oracle.rms_norm(x, w, 1e-5)[0])
    res = _randn(2, 300, 576, g=g)
    y, r = cpu_fused.add_rms_norm(x, res, w, 1e-5)
    y_oracle, r_oracle = sum_order_oracle.rms_norm(x, w, 1e-5, residual=res)
    _bits_equal(y, y_oracle)
    _bits_equal(r, r_oracle)
    x1 = x[0, 0]  # 1-D
    _bits_equal(cpu_fused.rms_norm(x1, w, 1e-5), sum_order_oracle.rms_norm(x1, w, 1e-5)[0])


@needs_kernel
def test_rms_norm_row_does_not_depend_on_the_batch():
    """Batch invariance: a row normalised alone (one thread) equals the same row inside a
    threaded 600-row call, at any position."""
    g = _gen(16)
    x, res, w = _randn(600, 576, g=g, scale=3.0), _randn(600, 576, g=g), _randn(576, g=g)
    y_all, r_all = cpu_fused.add_rms_norm(x, res, w, 1e-5)
    for i in (0, 17, 299, 599):
        y, r = cpu_fused.add_rms_norm(x[i:i + 1], res[i:i + 1], w, 1e-5)
        assert torch.equal(y[0], y_all[i]) and torch.equal(r[0], r_all[i])
        assert torch.equal(cpu_fused.rms_norm(x[i], w, 1e-5), cpu_fused.rms_norm(x, w, 1e-5)[i])


@needs_kernel
def test_rms_norm_special_values():
    w = torch.ones(64, dtype=BF16)
    x = torch.zeros(4, 64, dtype=BF16)  # row 0: all zero (y = 0)
    x[1, 3] = 3e38  # overflowing square
    x[2, 5] = float("nan")
    x[3, :] = 1e-30  # tiny: var << eps
    _bits_equal(cpu_fused.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6))
    res = -x.clone()
    res[1, 3] = 3e38  # x + res overflows to inf
    y, r = cpu_fused.add_rms_norm(x, res, w, 1e-6)
    y_ref, r_ref = torch_ops.add_rms_norm(x, res, w, 1e-6)
    _bits_equal(r, r_ref)
    _bits_equal(y, y_ref)


# ------------------------------------------------------------------------------------- RoPE


def _cos_sin(rows: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Real rotary tables at random positions (and some random values in the mix)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.randint(0, 4096, (rows,), generator=g).float()
    emb = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
    return emb.cos().to(BF16), emb.sin().to(BF16)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 2, 16), (3, 1, 8),
                                                      (2, 1, 100)])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_strided_qk_view_bit_exact(rows: int, heads: int, kv_heads: int, d: int):
    g = _gen(5, rows, heads, d)
    q, kv = heads * d, kv_heads * d
    m = _randn(rows, q + 2 * kv, g=g, scale=4.0)
    cos, sin = _cos_sin(rows, d, g)
    qk = m[:, :q + kv].view(rows, heads + kv_heads, d)  # stride(0) = q + 2 kv
    assert rows == 1 or not qk.is_contiguous()
    want = torch_ops.rope_neox(qk, cos, sin)
    v_before = m[:, q + kv:].clone()
    out = cpu_fused.rope_neox_(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # in place
    _bits_equal(qk, want)
    _bits_equal(m[:, q + kv:], v_before)  # v untouched


@needs_kernel
@pytest.mark.parametrize("d", [64, 16, 8, 100])
@pytest.mark.parametrize("rows", ROWS)
def test_rope_contiguous_and_random_tables(rows: int, d: int):
    g = _gen(6, rows, d)
    x = _randn(rows, 5, d, g=g, scale=3.0)
    cos, sin = _randn(rows, d, g=g), _randn(rows, d, g=g)  # arbitrary values, not a rotation
    want = torch_ops.rope_neox(x, cos, sin)
    cpu_fused.rope_neox_(x, cos, sin)
    _bits_equal(x, want)
    # cos/sin as the engine keeps them: [rows, 1, d]
    x2 = _randn(rows, 5, d, g=g)
    want = torch_ops.rope_neox(x2, cos.unsqueeze(1), sin.unsqueeze(1))
    cpu_fused.rope_neox_(x2, cos.unsqueeze(1), sin.unsqueeze(1))
    _bits_equal(x2, want)


# ------------------------------------------------------------------------------- SiLU * up


@needs_kernel
@pytest.mark.parametrize("inter", [1536, 576, 64, 100, 8])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_bit_exact(rows: int, inter: int):
    g = _gen(8, rows, inter)
    gu = _randn(rows, 2 * inter, g=g, scale=4.0)
    y = cpu_fused.silu_mul(gu)
    assert y.shape == (rows, inter)
    _bits_equal(y, torch_ops.silu_mul(gu))


@needs_kernel
def test_silu_mul_every_bf16_gate_value():
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gates = bits.view(BF16)
    gates = gates[~gates.isnan()]  # +-inf kept
    n = gates.numel() // 100 * 100  # rows of 100: 96 vector + 4 tail (libm) elements
    g = gates[:n].view(-1, 100)
    for up in (torch.ones_like(g), _randn(*g.shape, g=_gen(9), scale=3.0)):
        gu = torch.cat([g, up], dim=1)
        _bits_equal(cpu_fused.silu_mul(gu), torch_ops.silu_mul(gu))


@needs_kernel
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="torch's generic build has no vectorised (SLEEF) exp to compare with")
def test_silu_exp_is_torchs_sleef_exp():
    """fp32 x / (1 + exp(-x)) with the kernel's exp equals F.silu on fp32 bit for bit, which a
    correctly rounded exp does not (bf16 results alone can hardly tell exps apart)."""
    lib = cpu_fused._lib()
    assert lib is not None
    fn = lib.dll.qd_silu_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    g = _gen(10)
    x = torch.cat([torch.randn(1 << 16, generator=g) * s for s in (1.0, 10.0, 40.0)])
    x = torch.cat([x, torch.tensor([-104.5, -104.0, -103.9, 88.0, 100.0, 100.5, 0.0, -0.0,
                                    float("inf"), float("-inf"), 1e-30, -1e-30, 0.5, -0.5,
                                    87.5, -87.5])])
    out = torch.empty_like(x)
    assert fn(x.data_ptr(), out.data_ptr(), x.numel()) == 0
    want = F.silu(x)
    same = (out == want) | (out.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {x.numel()} differ"
    other = x / (1 + torch.exp(-x.double()).float())
    assert int((other != want).sum()) > 100  # the check above can tell exps apart


@needs_kernel
def test_silu_mul_leading_dims_and_special_values():
    g = _gen(11)
    gu = _randn(2, 3, 2 * 64, g=g, scale=3.0)
    y = cpu_fused.silu_mul(gu)
    assert y.shape == (2, 3, 64)
    _bits_equal(y, torch_ops.silu_mul(gu))
    gu = torch.zeros(1, 64, dtype=BF16)
    gu[0, :8] = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 90, -90,
                              0.0])
    gu[0, 32:40] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, float("inf"), 0.0, float("nan")])
    _bits_equal(cpu_fused.silu_mul(gu), torch_ops.silu_mul(gu))


# ------------------------------------------------------------------------- threads, fallbacks


@needs_kernel
def test_single_thread_matches_threaded():
    g = _gen(12)
    x, res, w = _randn(64, 576, g=g), _randn(64, 576, g=g), _randn(576, g=g)
    gu = _randn(64, 3072, g=g)
    m = _randn(64, 960, g=g)
    cos, sin = _cos_sin(64, 64, g)

    def run() -> list[torch.Tensor]:
        qk = m.clone()[:, :768].view(64, 12, 64)
        return [cpu_fused.rms_norm(x, w, 1e-5), *cpu_fused.add_rms_norm(x, res, w, 1e-5),
                cpu_fused.silu_mul(gu), cpu_fused.rope_neox_(qk, cos, sin)]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, run(), strict=True):
        assert torch.equal(a, b)


def test_fallbacks_match_reference():
    g = _gen(13)
    x, res, w = _randn(3, 64, g=g), _randn(3, 64, g=g), _randn(64, g=g)
    # fp32 / fp16: the reference, same dtype out
    for dt in (torch.float32, torch.float16):
        assert torch.equal(cpu_fused.rms_norm(x.to(dt), w.to(dt), 1e-5),
                           torch_ops.rms_norm(x.to(dt), w.to(dt), 1e-5))
        gu = _randn(3, 128, g=g).to(dt)
        assert torch.equal(cpu_fused.silu_mul(gu), torch_ops.silu_mul(gu))
    # non-contiguous x
    xt = _randn(64, 3, g=g).t()
    assert torch.equal(cpu_fused.rms_norm(xt, w, 1e-5), torch_ops.rms_norm(xt, w, 1e-5))
    ya, ra = cpu_fused.add_rms_norm(xt, res, w, 1e-5)
    yb, rb = torch_ops.add_rms_norm(xt, res, w, 1e-5)
    assert torch.equal(ya, yb) and torch.equal(ra, rb)
    gut = _randn(128, 3, g=g).t()
    assert torch.equal(cpu_fused.silu_mul(gut), torch_ops.silu_mul(gut))
    # rope on a view whose last dim is strided: computed by the reference, written in place
    base = _randn(2, 4, 16, 2, g=g)
    xs = base[..., 0]
    cos, sin = _randn(2, 16, g=g), _randn(2, 16, g=g)
    want = torch_ops.rope_neox(xs, cos, sin)
    out = cpu_fused.rope_neox_(xs, cos, sin)
    assert out.data_ptr() == xs.data_ptr()
    assert torch.equal(xs, want)


def test_unavailable_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_fused, "_lib", lambda: None)
    assert not cpu_fused.available()
    g = _gen(14)
    x, res, w = _randn(2, 64, g=g), _randn(2, 64, g=g), _randn(64, g=g)
    assert torch.equal(cpu_fused.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5))
    y, r = cpu_fused.add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = torch_ops.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    gu = _randn(2, 128, g=g)
    assert torch.equal(cpu_fused.silu_mul(gu), torch_ops.silu_mul(gu))
    qk = _randn(2, 3, 16, g=g)
    cos, sin = _cos_sin(2, 16, g)
    want = torch_ops.rope_neox(qk, cos, sin)
    assert torch.equal(cpu_fused.rope_neox_(qk, cos, sin), want)


@needs_kernel
def test_build_failure_warns_and_falls_back(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_fused, "_SOURCE", bad)
    cpu_fused._lib.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
            assert not cpu_fused.available()
            assert not cpu_fused.available()
        assert sum("build failed" in r.getMessage() for r in caplog.records) == 1
        g = _gen(15)
        x, w = _randn(2, 64, g=g), _randn(64, g=g)
        assert torch.equal(cpu_fused.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5))
    finally:
        monkeypatch.undo()
        cpu_fused._lib.cache_clear()
    assert cpu_fused.available()
