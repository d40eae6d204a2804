"""Every C kernel builds and loads where the machine can run it (gcc and the CPU flags it
needs): their tests skip when a kernel is unavailable, so a kernel that stopped compiling
would otherwise pass CI unnoticed, with the engine on its slower torch fallback."""

from __future__ import annotations

import shutil
from types import ModuleType

import pytest

from quickdraft.kernels import cbuild, cpu_attention, cpu_fused, cpu_gemv, cpu_q4q8


@pytest.mark.parametrize("module", [cpu_attention, cpu_fused, cpu_gemv, cpu_q4q8],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernel_builds_where_the_machine_can_run_it(module: ModuleType) -> None:
    name = module.__name__.rsplit(".", 1)[-1]
    if shutil.which("gcc") is None or not cbuild.cpu_has(module._CPU_FLAGS):
        pytest.skip(f"{name} cannot run here (no gcc, or the CPU lacks "
                    f"{sorted(module._CPU_FLAGS)})")
    assert module.available(), f"{name}: {cbuild.status().get(name)}"
