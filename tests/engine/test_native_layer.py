"""kernels.cpu_layer: a whole decoder layer in one native call gives bit-identical hidden
states and KV caches to the Python layer (bf16, int4 weights), on mixed steps of prefill
chunks, decodes and verification rows, with and without a qkv bias; a step the kernel
rejects falls back to the Python layer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.kernels import cpu_gemv, cpu_int4, cpu_layer, torch_attention
from quickdraft.kernels.attention_metadata import build_metadata

pytestmark = pytest.mark.skipif(not (cpu_layer.available() and cpu_int4.available()),
                                reason="needs g++, the C kernels and torch's CPU int4 ops")

BLOCK = 4
NUM_BLOCKS = 32


def _model(qwen: bool) -> LlamaForCausalLM:
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = Qwen2Config(**common) if qwen else LlamaConfig(**common)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, torch.bfloat16, 128, torch_attention)
    model.init_random_weights(0, std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.enable_cpu_fast_path(cpu_gemv.linear_bf16)
    gen = torch.Generator().manual_seed(1)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            out, k = lin.weight.shape
            q = torch.randint(0, 16, (out, k), generator=gen)
            d = torch.rand(out, k // 32, generator=gen) * 0.02 + 0.005
            m = -8 * d + torch.randn(out, k // 32, generator=gen) * 0.01
            lin.int4 = cpu_int4.pack(q, d, m)
    model.use_int4(True)
    return model


# (sequence, tokens fed, start position) per step: prefills, then a decode, a 3-row
# verification and a second prefill chunk in one step
STEPS = [[("a", 9, 0), ("b", 5, 0)], [("a", 1, 9), ("b", 3, 5), ("c", 7, 0)],
         [("c", 6, 7), ("a", 1, 10)]]
TABLES = {"a": [3, 0, 7, 12], "b": [5, 9, 1], "c": [2, 20, 4, 11]}


def _run(model: LlamaForCausalLM, native: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model.use_native_layers(native)
    assert all((layer.native is not None) == native for layer in model.layers)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    outs, gen = [], torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for step in STEPS:
            qsl, lens, tables, positions = [0], [], [], []
            for seq, n, start in step:
                qsl.append(qsl[-1] + n)
                lens.append(start + n)
                tables.append(TABLES[seq])
                positions += range(start, start + n)
            meta = build_metadata(qsl, lens, tables, BLOCK)
            ids = torch.randint(0, 96, (qsl[-1],), generator=gen)
            outs.append(model(ids, torch.tensor(positions), caches, meta))
    return outs, caches


@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2-qkv-bias"])
def test_native_layers_equal_python_layers_bit_for_bit(qwen: bool) -> None:
    model = _model(qwen)
    want, want_caches = _run(model, native=False)
    got, got_caches = _run(model, native=True)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(w.float()).all()
        assert torch.equal(g, w)
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g, w)


def test_layers_without_int4_weights_stay_python() -> None:
    model = _model(False)
    model.use_int4(False)
    assert all(layer.native is None for layer in model.layers)
    model.use_int4(True)
    assert all(layer.native is not None for layer in model.layers)


def test_a_rejected_step_declines_and_writes_nothing() -> None:
    model = _model(False)
    layer = model.layers[0]
    assert layer.native is not None
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16)
    meta = build_metadata([0, 2], [2], [[NUM_BLOCKS + 3]], BLOCK)  # block id out of range
    x = torch.randn(2, 64).bfloat16()
    cos_sin = model.rotary.cos_sin(torch.arange(2))
    attn = layer.self_attn
    with torch.inference_mode():
        out = cpu_layer.decoder_layer(x, None, layer.native, cos_sin, kv, meta, attn.heads,
                                      attn.kv_heads, layer.input_layernorm.eps, attn.scale)
    assert out is None and not kv.any()
