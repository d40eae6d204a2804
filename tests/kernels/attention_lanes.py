"""A fixture that runs a CPU attention test module once per lane of ``cpu_attention`` this
CPU can run (fp32 everywhere with AVX2; dot too with AVX512-BF16; amx too with AMX-BF16
that Linux grants), restoring the process's lane afterwards."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from quickdraft.kernels import cpu_attention


def runnable_lanes() -> list[str]:
    """The lanes this CPU runs, slowest first (fp32, dot, amx)."""
    if shutil.which("gcc") is None or not cpu_attention._cpu_supported():
        return ["fp32"]  # (the kernel's tests skip; one pass is enough)
    return list(cpu_attention.runnable_lanes())


@pytest.fixture(autouse=True, params=runnable_lanes())
def attention_lane(request: pytest.FixtureRequest) -> Iterator[str]:
    if not cpu_attention.available():
        yield request.param
        return
    before = cpu_attention.set_lane(request.param)
    try:
        yield request.param
    finally:
        cpu_attention.set_lane(before)
