"""A small random model on 4-bit weights and mixed steps (prefill chunks, decodes, a
verification) over shuffled block tables, shared by the native layer's and the native layer
stack's tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, Qwen2Config

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_weights import StackedWeight
from quickdraft.kernels import cpu_gemv, cpu_int4, cpu_q4q8, torch_attention
from tests.kernels.four_bit_oracle import random_q4k_weights, random_q6_weights

BLOCK = 4
NUM_BLOCKS = 32


def four_bit_model(qwen: bool, kernel: str = "torch") -> LlamaForCausalLM:
    """A small random model on 4-bit weights for ``kernel`` ("torch": ATen's int4, "q8":
    kernels.cpu_q4q8; "q6": cpu_q4q8 with 6-bit matrices as a Qwen2.5 Q4_K_M file has them:
    layer 1's qkv as q, k in 4 bits and v in 6 side by side and its down in 6 bits, and
    layer 2's o in 6 bits; "q4k": cpu_q4q8's Q4_K layout for every matrix, on wider layers
    since it takes ``in % 256 == 0``)."""
    wide = kernel == "q4k"
    common = dict(vocab_size=96, hidden_size=256 if wide else 64,
                  intermediate_size=512 if wide else 96, num_hidden_layers=3,
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
            if wide:
                lin.int4 = cpu_q4q8.pack_q4k(*random_q4k_weights(out, k, seed=out + k))
                continue
            q = torch.randint(0, 16, (out, k), generator=gen)
            d = torch.rand(out, k // 32, generator=gen) * 0.02 + 0.005
            m = -8 * d + torch.randn(out, k // 32, generator=gen) * 0.01
            lin.int4 = (cpu_int4 if kernel == "torch" else cpu_q4q8).pack(q, d, m)
    if kernel == "q6":
        qkv, down = model.layers[1].self_attn.qkv, model.layers[1].mlp.down
        out, k = qkv.weight.shape
        q = torch.randint(0, 16, (out - 32, k), generator=gen)
        d = torch.rand(out - 32, k // 32, generator=gen) * 0.02 + 0.005
        v = random_q6_weights(32, k, 3)
        qkv.int4 = StackedWeight((cpu_q4q8.pack(q, d, -8 * d),
                                  cpu_q4q8.pack_q6(v.q, v.d * 0.05, v.sc)))
        for lin, seed in ((down, 4), (model.layers[2].self_attn.o, 5)):
            w = random_q6_weights(*lin.weight.shape, seed)
            lin.int4 = cpu_q4q8.pack_q6(w.q, w.d * 0.05, w.sc)  # |w| <= 0.2
    model.use_int4(True)
    return model


# (sequence, tokens fed, start position) per step: prefills, then a decode, a 3-row
# verification and a second prefill chunk in one step
STEPS = [[("a", 9, 0), ("b", 5, 0)], [("a", 1, 9), ("b", 3, 5), ("c", 7, 0)],
         [("c", 6, 7), ("a", 1, 10)]]
TABLES = {"a": [3, 0, 7, 12], "b": [5, 9, 1], "c": [2, 20, 4, 11], "d": [6, 8, 10, 13]}
