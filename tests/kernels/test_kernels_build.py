"""Every C kernel builds and loads where the machine can run it: their tests skip when a
kernel is unavailable, so a kernel that stopped compiling would otherwise pass CI
unnoticed, with the engine on its slower torch fallback. Unavailable is allowed only for
the reasons :func:`kernels.cbuild.load` gives when the machine cannot run it (no gcc, or
the CPU lacks the flags the kernel needs)."""

from __future__ import annotations

from types import ModuleType

import pytest

from quickdraft.kernels import cbuild, cpu_attention, cpu_fused, cpu_gemv, cpu_q4q8

MACHINE_CANNOT = ("CPU lacks", "gcc not found")  # cbuild.load's reasons that are not a fault


@pytest.mark.parametrize("module", [cpu_attention, cpu_fused, cpu_gemv, cpu_q4q8],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernel_builds_where_the_machine_can_run_it(module: ModuleType) -> None:
    name = module.__name__.rsplit(".", 1)[-1]
    if module.available():
        return
    problem = cbuild.status().get(name) or "no reason recorded"
    if problem.startswith(MACHINE_CANNOT):
        pytest.skip(f"{name}: {problem}")
    pytest.fail(f"{name} did not build or load here: {problem}")
