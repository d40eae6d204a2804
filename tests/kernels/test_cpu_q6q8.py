"""kernels.cpu_q4q8's Q6_K-weight path (Qwen2.5's 6-bit LM head, and its ``down_proj`` and
``v_proj`` in some layers): exact extreme codes, refused shapes, and the model's LM head and
layers on it (its reference and bit-equality tests: test_cpu_q8q8.py)."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.gguf_quant import LM_HEAD
from quickdraft.kernels import cpu_q4q8
from tests.kernels.four_bit_oracle import assert_rows_threads_and_isa_agree, random_q6_weights

pytestmark = pytest.mark.skipif(not cpu_q4q8.available(), reason="q4q8 kernel not built here")


def test_extreme_codes_are_exact():
    """Every code -32 or 31 against x at -127 after rounding, over two super-blocks of 256
    with different ``d`` and both halves of each block with different ``sc``: exact
    integer sums (|2 · 2 · 63 · 127| < 2^15 in the 16-bit pairs) and exact scales."""
    k = 512
    q = torch.full((8, k), -32, dtype=torch.int8)
    q[4:] = 31
    d = torch.tensor([[1.0, 0.5]]).repeat(8, 1)
    sc = torch.ones(8, k // 16, dtype=torch.int8)
    sc[:, 1::2] = 2  # the second half of each block weighs twice
    x = torch.full((1, k), -1.0, dtype=torch.bfloat16)  # rounds to -127, sx = 1/127
    y = cpu_q4q8.linear(x, cpu_q4q8.pack_q6(q, d, sc)).float()
    # per block -q · 16 · (1 + 2) · d: 8 blocks at d = 1, 8 at d = 0.5
    want = torch.tensor([[32.0 * 576] * 4 + [-31.0 * 576] * 4])
    torch.testing.assert_close(y, want.bfloat16().float(), rtol=0, atol=0)


def test_every_code_at_every_position_of_a_block_is_read_back():
    """The codes are stored in 6 bits (nibbles and top bit pairs in separate chunks): one-hot
    rows of x pick out one input position each, and the 64 columns hold every code at every
    position of the block, so ``y[p, c]`` must be exactly ``q[c, p]``."""
    positions, codes = 32, 64
    col = torch.arange(codes).unsqueeze(1)
    pos = torch.arange(positions).unsqueeze(0)
    q = ((col + 5 * pos) % codes - 32).to(torch.int8)  # [64, 32]: each column a permutation
    assert all(len(set(q[:, p].tolist())) == codes for p in range(positions))
    x = torch.eye(positions, dtype=torch.bfloat16)  # 1.0 rounds to 127 with sx = 1 / 127
    y = cpu_q4q8.linear(x, cpu_q4q8.pack_q6(q, torch.ones(codes, 1),
                                            torch.ones(codes, 2, dtype=torch.int8)))
    torch.testing.assert_close(y.float(), q.T.float(), rtol=0, atol=0)


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("out", [256, 40])  # pairs of 8-column groups; and an odd last group
def test_rows_threads_instruction_sets_and_layouts_give_the_same_bits(out, paired):
    """As the 4-bit path's: a row's bits do not depend on the other rows, the thread count,
    VNNI (16 columns a vector on paired weights, else 8) against AVX2, or the layout; over
    a last super-block of 64 inputs (k = 576)."""
    w = random_q6_weights(out, 576, out)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    packed = cpu_q4q8.pack_q6(w.q, w.d, w.sc, paired=paired)
    assert packed.paired == paired
    assert cpu_q4q8.pack_q6(w.q, w.d, w.sc).paired == cpu_q4q8.pairs_columns()
    assert_rows_threads_and_isa_agree(cpu_q4q8.linear, packed, x, cpu_q4q8.uses_vnni())
    other = cpu_q4q8.pack_q6(w.q, w.d, w.sc, paired=not paired)
    assert torch.equal(cpu_q4q8.linear(x, packed), cpu_q4q8.linear(x, other))


def test_bad_shapes_and_codes_are_refused():
    w = random_q6_weights(16, 64, 1)
    with pytest.raises(ValueError, match="q6q8 weights need"):
        cpu_q4q8.pack_q6(w.q[:12], w.d[:12], w.sc[:12])
    with pytest.raises(ValueError, match="q6q8 weights need"):
        cpu_q4q8.pack_q6(w.q, w.d, w.sc[:, :2])
    with pytest.raises(ValueError, match="q6q8 weights need"):
        cpu_q4q8.pack_q6(w.q, torch.ones(16, 2), w.sc)
    with pytest.raises(ValueError, match=r"-32\.\.31"):
        cpu_q4q8.pack_q6(torch.full((8, 32), 40, dtype=torch.int8), torch.ones(8, 1),
                         torch.ones(8, 2, dtype=torch.int8))
    packed = cpu_q4q8.pack_q6(w.q, w.d, w.sc)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_q4q8.linear(torch.zeros(2, 32), packed)
    assert cpu_q4q8.linear(torch.zeros(0, 64), packed).shape == (0, 16)


def test_a_model_runs_its_lm_head_on_q6_k_blocks():
    """``attach_int4_weights`` with the ``q8`` kernel puts a Q6_K head on the 6-bit loop: the
    logits are the kernel's product with the head's blocks, the same for a row alone as in
    a batch, and close to the dense head's."""
    from transformers import LlamaConfig

    from quickdraft.engine.models.llama import LlamaForCausalLM
    from quickdraft.kernels import torch_attention

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config, torch.bfloat16, 64, torch_attention)
    model.init_random_weights(seed=0)
    vocab, hidden = model.lm_head.weight.shape
    head = random_q6_weights(vocab, hidden, 7)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.dequantize().bfloat16())
    h = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    dense = model.compute_logits(h)
    model.attach_int4_weights({LM_HEAD: head}, "q8")
    model.use_int4(True)
    assert isinstance(model.lm_head.int4, cpu_q4q8.Q6Q8Weight) and model.lm_head.use_int4
    logits = model.compute_logits(h)
    assert torch.equal(logits, cpu_q4q8.linear(h, model.lm_head.int4).float())
    assert torch.equal(logits[2:3], model.compute_logits(h[2:3]))
    torch.testing.assert_close(logits, dense, rtol=0.05, atol=0.05 * float(dense.abs().max()))


def test_q6_k_layer_matrices_run_on_the_6_bit_loop():
    """With the ``q8`` kernel a Q6_K ``down_proj`` multiplies by its 6-bit blocks, and a fused
    qkv with a Q6_K ``v_proj`` runs each part on its own loop (q and k fused on the 4-bit
    one), outputs side by side; such layers run in the native layer too (its bits against
    the Python layer's: tests/engine/test_native_layer.py), and every output row is the
    same alone as in a batch."""
    from transformers import LlamaConfig

    from quickdraft.engine.gguf_quant import Q4Weight
    from quickdraft.engine.models.llama import LlamaForCausalLM
    from quickdraft.engine.models.llama_layers import FUSED_CPU_OPS
    from quickdraft.engine.models.llama_weights import StackedWeight
    from quickdraft.kernels import cpu_layer, torch_attention

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config, torch.bfloat16, 64, torch_attention)
    model.init_random_weights(seed=0)
    g = torch.Generator().manual_seed(3)

    def q4(out: int, k: int) -> Q4Weight:
        return Q4Weight(torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8),
                        torch.rand(out, k // 32, generator=g) * 0.01,
                        -torch.rand(out, k // 32, generator=g) * 0.05)

    weights: dict[str, object] = {}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, (out, k) in {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
                               "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
                               "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
                               "mlp.down_proj": (64, 96)}.items():
            weights[f"{p}{name}.weight"] = q4(out, k)
    weights["model.layers.1.mlp.down_proj.weight"] = random_q6_weights(64, 96, 5)
    weights["model.layers.1.self_attn.v_proj.weight"] = random_q6_weights(32, 64, 6)
    model.use_layer_ops(FUSED_CPU_OPS)
    assert model.attach_int4_weights(weights, "q8") == 8  # type: ignore[arg-type]
    model.use_int4(True)
    layer0, layer1 = model.layers
    native = cpu_layer.available() and cpu_layer.takes_q4q8()
    assert (layer0.native is not None) == native  # four 4-bit matrices
    assert (layer1.native is not None) == native  # 4- and 6-bit ones
    if native:
        assert layer1.native is not None and len(layer1.native) == 17  # qkv: 2 matrices
    down, qkv = layer1.mlp.down, layer1.self_attn.qkv
    assert isinstance(down.int4, cpu_q4q8.Q6Q8Weight) and down.use_int4
    assert isinstance(qkv.int4, StackedWeight) and qkv.use_int4
    first, v = qkv.int4.parts
    assert isinstance(first, cpu_q4q8.Q4Q8Weight) and first.out_features == 96
    assert isinstance(v, cpu_q4q8.Q6Q8Weight) and v.out_features == 32
    x = torch.randn(3, 96, generator=g).bfloat16()
    assert torch.equal(down(x), cpu_q4q8.linear(x, down.int4))
    h = torch.randn(3, 64, generator=g).bfloat16()
    y = qkv(h)
    assert torch.equal(y, torch.cat([cpu_q4q8.linear(h, first), cpu_q4q8.linear(h, v)], -1))
    assert torch.equal(y[1:2], qkv(h[1:2]))
