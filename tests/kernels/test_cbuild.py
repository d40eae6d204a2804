"""Build-on-first-use of the C kernels: cached by source hash, atomic, stale builds removed."""

from __future__ import annotations

import shutil

import pytest

from quickdraft.kernels import cbuild, cpu_attention, cpu_fused, cpu_gemv

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")


@needs_gcc
@pytest.mark.parametrize("module", [cpu_gemv, cpu_fused, cpu_attention],
                         ids=lambda m: m.__name__)
def test_build_into_fresh_cache(monkeypatch, tmp_path, module):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    gcc = shutil.which("gcc")
    assert gcc is not None
    src = module._SOURCE.read_bytes()
    path = module._build(src, gcc)
    assert path.parent == tmp_path / "kernels" == cbuild.cache_dir() and path.exists()
    assert module._build(src, gcc) == path  # cached
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [path.name]  # no temp left
    new = module._build(src + b"\n/* edited */\n", gcc)
    assert new != path  # an edited source gets a new library; the stale one is removed
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [new.name]


def test_cpu_has_reads_cpuinfo_flags():
    assert cbuild.cpu_has(frozenset())
    assert not cbuild.cpu_has(frozenset({"no-such-cpu-flag"}))
