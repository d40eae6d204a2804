"""kernels.cpu_q4q8's Q8_0- and Q6_K-weight paths (the 8-bit and 6-bit LM heads): 8- or
6-bit weights x 8-bit activations, against a plain-torch reference (the Q6_K path's own
cases: test_cpu_q6q8.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from quickdraft.engine.gguf_quant import Q8Weight
from quickdraft.kernels import cpu_q4q8
from tests.kernels.four_bit_oracle import (
    assert_matches_q8_reference,
    assert_rows_threads_and_isa_agree,
    random_q4_weights,
    random_q6_weights,
)

pytestmark = pytest.mark.skipif(not cpu_q4q8.available(), reason="q4q8 kernel not built here")


def _weights(out: int, k: int, seed: int) -> Q8Weight:
    """Codes over the whole int8 range (-128 included, which a Q8_0 file may hold) and fp16
    block scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out, k), generator=g, dtype=torch.int8)
    d = (torch.rand(out, k // 32, generator=g) * 0.01 + 1e-4).half().float()
    return Q8Weight(q, d)


# format -> (random weights (out, k, seed), packed for the kernel)
FORMATS: dict[str, tuple[Callable[[int, int, int], Any], Callable[[Any], Any]]] = {
    "q8_0": (lambda out, k, seed: _weights(out, k, seed), lambda w: cpu_q4q8.pack_q8(w.q, w.d)),
    "q6_k": (random_q6_weights, lambda w: cpu_q4q8.pack_q6(w.q, w.d, w.sc)),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("out", "k"), [(1024, 576), (64, 1536), (8, 32)])
@pytest.mark.parametrize("rows", [1, 4, 8, 11])
def test_linear_matches_the_q8_reference(fmt, out, k, rows):
    """Against x rounded to 8 bits as the kernel does and the exact weights in fp64."""
    make, pack = FORMATS[fmt]
    w = make(out, k, out + k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    y = cpu_q4q8.linear(x, pack(w))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    assert_matches_q8_reference(y, x, w.dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_threads_and_instruction_sets_give_the_same_bits(fmt):
    make, pack = FORMATS[fmt]
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert_rows_threads_and_isa_agree(cpu_q4q8.linear, pack(make(256, 576, 3)), x,
                                      cpu_q4q8.uses_vnni(),
                                      cpu_q4q8.uses_amx())


def test_extreme_codes_do_not_saturate():
    """Every code -128 or 127 against x at +-127 after rounding: the AVX2 loop's 16-bit pair
    sums (|2 · 128 · 127| < 2^15) must not saturate; the result is exact integer arithmetic."""
    k = 64
    q = torch.full((8, k), -128, dtype=torch.int8)
    q[4:] = 127
    d = torch.ones(8, k // 32)
    x = torch.full((1, k), -1.0, dtype=torch.bfloat16)  # rounds to -127, sx = 1/127
    packed = cpu_q4q8.pack_q8(q, d)
    want = torch.tensor([[128.0 * k] * 4 + [-127.0 * k] * 4])  # isum / 127, exact in bf16
    for vnni in ((False, True) if cpu_q4q8.uses_vnni() else (False,)):
        y = cpu_q4q8.linear(x, packed, vnni=vnni).float()
        torch.testing.assert_close(y, want.bfloat16().float(), rtol=0, atol=0)
    if cpu_q4q8.uses_amx():
        y = cpu_q4q8.linear(x, packed, amx_rows=1).float()
        torch.testing.assert_close(y, want.bfloat16().float(), rtol=0, atol=0)


def test_bad_shapes_are_refused():
    w = _weights(16, 64, seed=1)
    with pytest.raises(ValueError, match="q8q8 weights need"):
        cpu_q4q8.pack_q8(w.q[:12], w.d[:12])
    with pytest.raises(ValueError, match="does not fit"):
        cpu_q4q8.linear(torch.zeros(2, 32), cpu_q4q8.pack_q8(w.q, w.d))
    # no rows (a step that samples nothing) is an empty product, not an error
    assert cpu_q4q8.linear(torch.zeros(0, 64), cpu_q4q8.pack_q8(w.q, w.d)).shape == (0, 16)


@pytest.mark.parametrize("fmt", [*FORMATS, "q4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_float_output_is_the_bf16_result_as_fp32(fmt, threads):
    """``float_out`` (an LM head's logits): the kernel's fp32 copy holds exactly the bf16
    result's values, for every row (1..17, across the 16-row passes), on every loop and
    thread count; a 4-bit matrix (no fp32 entry point) converts afterwards, the same."""
    if fmt == "q4":
        q, d, m = random_q4_weights(1024, 576, seed=7)
        packed = cpu_q4q8.pack(q, d, m)
    else:
        make, pack = FORMATS[fmt]
        packed = pack(make(1024, 576, 7))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 4, 17):
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
            for vnni in ((False, True) if cpu_q4q8.uses_vnni() else (None,)):
                y = cpu_q4q8.linear(x, packed, vnni=vnni, float_out=True)
                assert y.dtype == torch.float32 and y.shape == (rows, 1024)
                assert torch.equal(y, cpu_q4q8.linear(x, packed, vnni=vnni).float())
                assert torch.equal(cpu_q4q8.linear(x.view(1, rows, 576), packed, vnni=vnni,
                                                   float_out=True), y.view(1, rows, 1024))
            if cpu_q4q8.uses_amx():
                assert torch.equal(cpu_q4q8.linear(x, packed, amx_rows=1, float_out=True),
                                   cpu_q4q8.linear(x, packed, amx_rows=0).float())
    finally:
        torch.set_num_threads(before)
    assert cpu_q4q8.linear(torch.zeros(0, 576), packed, float_out=True).dtype == torch.float32
