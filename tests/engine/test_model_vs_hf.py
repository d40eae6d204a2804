"""Our model's logits equal HF transformers' (fp32, 1e-4) on random tiny configs, for prefill,
chunked prefill, decode and multi-token queries on an existing cache, over paged KV."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.models.llama import LlamaForCausalLM as OurModel
from quickdraft.engine.models.rope import compute_inv_freq
from quickdraft.kernels import torch_attention
from quickdraft.kernels.attention_metadata import build_metadata

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256)
CONFIGS = {
    "llama-gqa-tied": (LlamaForCausalLM, LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied-bias-llama3rope": (LlamaForCausalLM, LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2-bias-untied": (Qwen2ForCausalLM, Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-tied-yarn": (Qwen2ForCausalLM, Qwen2Config(
        **COMMON, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    "mistral-gqa-linear-rope": (MistralForCausalLM, MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        sliding_window=None, rope_scaling=dict(rope_type="linear", factor=2.0))),
}


class Harness:
    """Our model over a paged cache, fed step by step like the engine does."""

    def __init__(self, hf_model: torch.nn.Module, block_size: int) -> None:
        self.model = OurModel(hf_model.config, torch.float32, 256, torch_attention)
        self.model.load_weights(hf_model.state_dict().items())
        s = self.model.shape
        self.kv = KVCacheManager(num_blocks=64, block_size=block_size)
        # Hand out blocks in a scrambled order so tables are not contiguous.
        self.kv.pool.allocate(64)
        self.kv.pool.free(list(range(63, -1, -7)) + [b for b in range(64) if b % 7 != 0])
        self.caches = [torch.zeros(2, 64, block_size, s.num_kv_heads, s.head_dim)
                       for _ in range(s.num_layers)]
        self.block_size = block_size

    @torch.inference_mode()
    def step(self, chunks: dict[str, tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        """``chunks[seq] = (token_ids, start_pos)``; returns logits per sequence's new tokens."""
        ids, positions, qsl, seq_lens, tables = [], [], [0], [], []
        for seq, (tokens, start) in chunks.items():
            assert self.kv.allocate_slots(seq, start + len(tokens))
            ids += tokens
            positions += range(start, start + len(tokens))
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(self.kv.block_table(seq))
        meta = build_metadata(qsl, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        logits = self.model.compute_logits(hidden)
        return {seq: logits[qsl[i]:qsl[i + 1]] for i, seq in enumerate(chunks)}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    cls, config = CONFIGS[request.param]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomise everything
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    return model


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


PROMPT_A = [(i * 37 + 11) % 97 for i in range(23)]
PROMPT_B = [(i * 13 + 5) % 97 for i in range(9)]


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_prefill(hf_model, block_size):
    h = Harness(hf_model, block_size)
    close(h.step({"a": (PROMPT_A, 0)})["a"], hf_logits(hf_model, PROMPT_A))


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_chunked_prefill_then_decode(hf_model, block_size):
    h = Harness(hf_model, block_size)
    want = hf_logits(hf_model, PROMPT_A)
    for start, end in [(0, 7), (7, 12), (12, 20)]:
        close(h.step({"a": (PROMPT_A[start:end], start)})["a"], want[start:end])
    for pos in range(20, 23):  # single-token decode steps
        close(h.step({"a": ([PROMPT_A[pos]], pos)})["a"], want[pos:pos + 1])


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_mixed_batch_with_multi_token_query(hf_model, block_size):
    """One step: a k+1-token query on a cached sequence, a decode, and a fresh prefill."""
    h = Harness(hf_model, block_size)
    want_a, want_b = hf_logits(hf_model, PROMPT_A), hf_logits(hf_model, PROMPT_B)
    h.step({"a": (PROMPT_A[:15], 0), "b": (PROMPT_B[:8], 0)})
    c = PROMPT_B[::-1] + PROMPT_A[:3]
    got = h.step({"a": (PROMPT_A[15:20], 15), "b": ([PROMPT_B[8]], 8), "c": (c, 0)})
    close(got["a"], want_a[15:20])
    close(got["b"], want_b[8:9])
    close(got["c"], hf_logits(hf_model, c))


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "default"])
def test_rope_inv_freq_matches_hf(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "linear": dict(rope_type="linear", factor=4.0),
        "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=8192),
        "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                     beta_fast=32, beta_slow=1),
        "default": None,
    }[name]
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=32768,
                         rope_theta=500000.0, rope_scaling=scaling)
    ours, ours_scale = compute_inv_freq(config, 128)
    if name == "default":
        want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[name](config, "cpu")
    torch.testing.assert_close(ours, want, atol=0, rtol=1e-6)
    assert ours_scale == pytest.approx(want_scale)
