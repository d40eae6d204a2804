"""The bf16 CPU fast path of our Linear (chunked GEMV kernel / fp32 GEMM) equals torch's bf16
linear up to one bf16 rounding, for every row count that picks a different route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import Linear
from kernels import cpu_gemv


@pytest.mark.skipif(not cpu_gemv.available(), reason="CPU GEMV kernel not built here")
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 48, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_matches_fp32_reference(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(200, 96, bias, torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    layer.enable_cpu_fast_path(cpu_gemv.linear_bf16, cpu_gemv.MAX_ROWS, gemv_rows=48)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = layer(x)
    b = layer.bias.float() if layer.bias is not None else None
    want = F.linear(x.float(), layer.weight.float(), b).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.98
