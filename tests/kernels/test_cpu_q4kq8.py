"""kernels.cpu_q4q8's Q4_K layout (a GGUF Q4_K file's own 6-bit scales and mins per 32
weights, an fp16 d and dmin per 256): the same weights exactly as the 4-bit blocks they are
made from, against the 8-bit reference, row/thread/ISA invariant, and where it is chosen."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_q4q8
from tests.kernels.four_bit_oracle import (
    assert_matches_q8_reference,
    assert_rows_threads_and_isa_agree,
    dense,
    random_q4_k_blocks,
    random_q4_weights,
    random_q4k_weights,
)

pytestmark = pytest.mark.skipif(not cpu_q4q8.available(), reason="q4q8 kernel not built here")


@pytest.mark.parametrize(("out", "k", "top"), [(64, 1536, 63), (40, 256, 63), (16, 512, 20)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_q4_k_layout_matches_the_q8_reference(out, k, top, rows):
    """The scales factor back into the file's (or equivalent) fp16 and 6-bit integers, so the
    loop multiplies by the exact products ``d · sc`` (the 4-bit layout rounds them to fp16);
    ``top`` < 63: no block has the largest 6-bit scale."""
    q, d, m = random_q4k_weights(out, k, seed=out + k + top, top=top)
    w = cpu_q4q8.pack_q4k(q, d, m)
    assert isinstance(w, cpu_q4q8.Q4KQ8Weight)
    assert w.sm.dtype == torch.uint8 and int(w.sm.max()) <= 63
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    y = cpu_q4q8.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    assert_matches_q8_reference(y, x, dense(q, d, m, torch.float64))


def test_rows_threads_and_instruction_sets_give_the_same_bits():
    """One loop (AVX2) on both CPU kinds: the VNNI flag an AVX512 machine passes changes
    nothing, on every machine."""
    q, d, m = random_q4k_weights(48, 1536, seed=3)
    w = cpu_q4q8.pack_q4k(q, d, m)
    assert w is not None
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_rows_threads_and_isa_agree(cpu_q4q8.linear, w, x, uses_vnni=True)


def test_a_gguf_q4_k_matrix_runs_on_its_own_scales():
    """Random Q4_K blocks (any 6-bit scales and mins, either sign of d and dmin) read by
    ``engine.gguf_quant`` factor back exactly, and the product matches gguf's own
    dequantization under the 8-bit reference."""
    from gguf import GGMLQuantizationType, quants

    from quickdraft.engine import gguf_quant

    rows, k = 16, 512
    blocks = random_q4_k_blocks(rows, k, seed=5)
    q4 = gguf_quant._unpack_q4_k(blocks, rows, k)
    w = cpu_q4q8.pack_q4k(q4.q, q4.d, q4.m)
    assert w is not None
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_K)
                            .reshape(rows, k)).double()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert_matches_q8_reference(cpu_q4q8.linear(x, w), x, want)


def test_scales_that_do_not_factor_keep_the_4_bit_layout():
    """Q4_1-style scales (any fp16 per 32) or ``in % 256 != 0``: no Q4_K layout, and
    :func:`pack_layer` packs the 4-bit one; all-zero super-blocks factor (as zero)."""
    q, d, m = random_q4_weights(16, 512, seed=1)
    assert cpu_q4q8.pack_q4k(q, d, m) is None
    assert isinstance(cpu_q4q8.pack_layer(q, d, m), cpu_q4q8.Q4Q8Weight)
    q, d, m = random_q4k_weights(16, 768, seed=2)
    assert cpu_q4q8.pack_q4k(q[:, :736], d[:, :23], m[:, :23]) is None
    d[:, :8] = 0.0
    m[3:5] = 0.0
    w = cpu_q4q8.pack_q4k(q, d, m)
    assert w is not None
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert_matches_q8_reference(cpu_q4q8.linear(x, w), x, dense(q, d, m, torch.float64))


@pytest.mark.parametrize("paired", [False, True], ids=["avx2-only", "avx512-vnni"])
def test_pack_layer_picks_the_q4_k_layout_where_4_bit_weights_are_not_paired(monkeypatch,
                                                                            paired):
    """AVX2-only machines: the Q4_K layout (0.578 bytes a weight against 0.625); where the
    16-column VNNI loop runs (paired 4-bit weights) the 4-bit layout, for that loop. Both
    kinds' choices on any machine (the paired weights run on the AVX2 loop where the CPU
    lacks VNNI: the same bits, tested in test_cpu_q4q8.py)."""
    monkeypatch.setattr(cpu_q4q8, "pairs_columns", lambda: paired)
    q, d, m = random_q4k_weights(16, 512, seed=4)
    w = cpu_q4q8.pack_layer(q, d, m)
    if paired:  # the 4-bit layout keeps the scales as fp16
        assert isinstance(w, cpu_q4q8.Q4Q8Weight) and w.paired
        d, m = d.half().float(), m.half().float()
    else:
        assert isinstance(w, cpu_q4q8.Q4KQ8Weight)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert_matches_q8_reference(cpu_q4q8.linear(x, w), x, dense(q, d, m, torch.float64))
