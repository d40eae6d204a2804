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
    src = cbuild.read_source(module._SOURCE)
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


def test_read_source_expands_local_headers_once(tmp_path):
    """A kernel's local headers are compiled as part of its one source, so they are hashed
    with it: editing a header rebuilds the kernel."""
    (tmp_path / "a.h").write_text('#include "b.h"\nint a;\n')
    (tmp_path / "b.h").write_text("int b;\n")
    (tmp_path / "k.c").write_text('#include <stdint.h>\n#include "a.h"\n#include "b.h"\nint k;\n')
    text = cbuild.read_source(tmp_path / "k.c").decode()
    code = [line for line in text.splitlines() if not line.startswith("#line")]
    assert code == ["#include <stdint.h>", "int b;", "int a;", "int k;"]
    assert '#line 3 "k.c"' in text  # messages after the header point back at k.c
    before = cbuild.read_source(tmp_path / "k.c")
    (tmp_path / "b.h").write_text("int b2;\n")
    assert cbuild.read_source(tmp_path / "k.c") != before
