"""Shared fixtures: the real default model (converted once per session) and tiny random models
that reuse its tokenizer, so engine tests run fast with real text."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# The Triton kernel tests run through Triton's CPU interpreter when there is no GPU. The
# switch is read when triton is first imported, and transformers may import it while other
# test modules are collected, so it is set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every step's plan and attention metadata check their invariants (engine/step_plan.py);
# read at import, so set before the engine is imported.
os.environ.setdefault("QUICKDRAFT_CHECK_INVARIANTS", "1")

from quickdraft.engine import loader


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the embedded GGUF (cached across runs)."""
    return loader.resolve_model(None, progress=False)


def make_tiny_model(path: Path, tokenizer_dir: Path, *, arch: str = "llama", seed: int = 0,
                    num_layers: int = 2, hidden: int = 64, vocab: int | None = None) -> Path:
    """A random tiny model in HF layout with the default model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab = vocab or loader.load_config(tokenizer_dir).vocab_size
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, eos_token_id=2, bos_token_id=1)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)
