"""Layering: kernels/ depends only on spec's public names, never on its private helpers.

Read from the source (AST), nothing is imported: a module under kernels/ must not import a
``_``-prefixed name from ``quickdraft.spec`` (or a ``_``-prefixed spec module), nor access a
``_``-prefixed attribute of anything it imported from spec (``ref._prepare``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
_PACKAGE = "quickdraft.kernels"  # what a relative import in kernels/ is relative to


def _private(name: str) -> bool:
    """A ``_``-prefixed name that is not a dunder (``__name__`` is fine)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import``, resolving relative ones in kernels/."""
    if not node.level:
        return node.module or ""
    base = _PACKAGE.split(".")[: len(_PACKAGE.split(".")) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_spec(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["quickdraft", "spec"] or parts[:1] == ["spec"]


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def spec_privacy_violations(source: str) -> list[str]:
    """Every use of a private spec name in ``source``, as ``"line: what"`` strings."""
    tree = ast.parse(source)
    found: list[str] = []
    spec_names: set[str] = set()  # local names bound to spec modules or spec objects
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _is_spec(module := _absolute(node)):
            if any(_private(part) for part in module.split(".")):
                found.append(f"{node.lineno}: from {module} import")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                spec_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_spec(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                # ``import quickdraft.spec.x`` binds ``quickdraft``: track the dotted path
                spec_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = _dotted(node.value)
            if base is not None and (base in spec_names or _is_spec(base)):
                found.append(f"{node.lineno}: {base}.{node.attr}")
    return found


def _kernel_modules() -> list[Path]:
    return sorted(KERNELS.rglob("*.py"))


def test_kernels_exist() -> None:
    assert any(p.name == "triton_rejection.py" for p in _kernel_modules())


@pytest.mark.parametrize("path", _kernel_modules(), ids=lambda p: p.name)
def test_kernel_module_uses_only_public_spec_names(path: Path) -> None:
    violations = spec_privacy_violations(path.read_text())
    assert not violations, f"{path.relative_to(ROOT)} uses private spec names: {violations}"


@pytest.mark.parametrize("source", [
    "from quickdraft.spec import rejection_sampler as ref\nref._prepare(1)\n",
    "from quickdraft.spec.rejection_sampler import _Layout\n",
    "from quickdraft.spec.rejection_sampler import VerifyOutput as V, _output as o\n",
    "import quickdraft.spec.rejection_sampler as ref\nx: ref._Layout\n",
    "import quickdraft.spec.rejection_sampler\nquickdraft.spec.rejection_sampler._prepare()\n",
    "from ..spec import rejection_sampler\nrejection_sampler._draft_uniforms()\n",
    "from ..spec.rejection_sampler import _prepare\n",
    "from quickdraft.spec._private_module import thing\n",
    "from quickdraft.spec.verification import VerifyLayout\nVerifyLayout._fields\n",
])
def test_checker_catches_private_uses(source: str) -> None:
    assert spec_privacy_violations(source)


@pytest.mark.parametrize("source", [
    "from quickdraft.spec.verification import VerifyLayout, prepare_verification\n"
    "prepare_verification(1).layout\nVerifyLayout.build\n",
    "from quickdraft.spec import verification\nverification.__name__\n",
    "from quickdraft.engine import sampler\nsampler._flat_positions\n",  # not spec
    "import torch\ntorch._C\n",
])
def test_checker_allows_public_uses(source: str) -> None:
    assert spec_privacy_violations(source) == []
