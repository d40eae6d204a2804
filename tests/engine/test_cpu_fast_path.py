"""The bf16 CPU fast path of our Linear (the GEMV kernel at every row count) equals torch's
bf16 linear up to one bf16 rounding, for row counts below, at and above one pass (8 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quickdraft.engine.models.llama_layers import Linear
from quickdraft.kernels import cpu_fused, cpu_gemv


@pytest.mark.skipif(not cpu_gemv.available(), reason="CPU GEMV kernel not built here")
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 48, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_matches_fp32_reference(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(200, 96, bias, torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    layer.use_matmul(cpu_gemv.linear_bf16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = layer(x)
    b = layer.bias.float() if layer.bias is not None else None
    want = F.linear(x.float(), layer.weight.float(), b).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.98


@pytest.mark.skipif(not cpu_fused.available(), reason="fused CPU kernels not built here")
def test_fused_layer_ops_are_bit_equal_to_torch_ops_in_bf16():
    """A whole bf16 forward (prefill + decode over paged KV) with the fused small ops equals
    the torch-reference ops exactly: they are drop-in replacements, not approximations. The
    one difference on some CPUs, RMSNorm's summation order (fixed in the kernel, per CPU in
    torch), is taken out by giving the torch ops the kernel's order."""
    import dataclasses

    from transformers import LlamaConfig

    from quickdraft.engine.kv_cache import KVCacheManager
    from quickdraft.engine.models.llama import LlamaForCausalLM
    from quickdraft.engine.models.llama_layers import FUSED_CPU_OPS, TORCH_OPS
    from quickdraft.kernels import torch_attention
    from quickdraft.kernels.attention_metadata import build_metadata
    from tests.kernels import sum_order_oracle

    torch_ops = dataclasses.replace(
        TORCH_OPS, rms_norm=lambda x, w, eps: sum_order_oracle.rms_norm(x, w, eps)[0],
        add_rms_norm=lambda x, r, w, eps: sum_order_oracle.rms_norm(x, w, eps, residual=r))

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=200,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, torch.bfloat16, 128, torch_attention)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    outs = []
    for ops in (torch_ops, FUSED_CPU_OPS):
        model.ops = ops
        kv = KVCacheManager(16, 4)
        caches = [torch.zeros(2, 16, 4, 2, 32, dtype=torch.bfloat16) for _ in range(3)]
        logits = []
        with torch.inference_mode():
            for start, n in [(0, 9), (9, 1), (10, 3)]:
                kv.allocate_slots("s", start + n)
                meta = build_metadata([0, n], [start + n], [kv.block_table("s")], 4)
                ids = torch.arange(start, start + n) % 128
                hidden = model(ids, torch.arange(start, start + n), caches, meta)
                logits.append(model.compute_logits(hidden))
        outs.append(torch.cat(logits))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not cpu_fused.available(), reason="CPU kernels not built here")
def test_bf16_batched_decode_uses_the_attention_kernel_not_its_slow_fallback(
        tiny_model_dir, monkeypatch):
    """The query reaching attention is a strided view of the qkv output; it must still take
    the C kernel (a silent fallback to the per-sequence reference cost 2x step time)."""
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine
    from quickdraft.engine.sampling_params import SamplingParams
    from quickdraft.kernels import torch_attention

    def refuse(*args, **kwargs):
        raise AssertionError("bf16 attention fell back to the torch path")

    monkeypatch.setattr(torch_attention, "plan_attention", refuse)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16",
                                    speculation="off", num_kv_blocks=64), progress=False)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = engine.generate(["one", "two three", "four five six"], params)
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
