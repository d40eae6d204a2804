"""The CPU kernel tests again with torch forced onto the code paths of the other CPU kinds.

Machines of two kinds run this project: AVX2-only EPYCs and EPYCs with AVX512-BF16/VNNI.
torch picks its kernels (summation orders, exp loops, the int4 and bf16 matmuls) by
``ATEN_CPU_CAPABILITY``, which can force a lower kind on a higher machine, so an AVX512
machine also runs the AVX2 and the generic paths here (an AVX2 machine the generic one).
Our own C kernels pick their loops by CPU flags: the 4-bit matmuls' VNNI loops give the AVX2
loops' results exactly; the attention's AVX512-BF16 "dot" lane differs from its fp32 lane in
the last bits, so these runs also force the fp32 lane (``QUICKDRAFT_ATTENTION=fp32``): the
engine end to end as an AVX2-only machine runs it. The attention's own tests run both lanes
in the main run. These tests hold for each kind (our fixed orders, stated tolerances to
torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SUITES = ["tests/kernels/test_cpu_fused.py", "tests/kernels/test_cpu_gemv.py",
          "tests/kernels/test_cpu_attention.py", "tests/kernels/test_cpu_ragged_attention.py",
          "tests/kernels/test_tree_attention.py",
          "tests/kernels/test_cpu_int4.py", "tests/kernels/test_cpu_q4q8.py",
          "tests/kernels/test_cpu_q8q8.py", "tests/kernels/test_cpu_argmax.py",
          "tests/kernels/test_cpu_top_log_softmax.py", "tests/spec/test_tree_verification.py",
          "tests/engine/test_cpu_fast_path.py", "tests/engine/test_gguf_quant.py"]
# On the AVX2 path also the default model end to end: its int4 kernel (the AVX2 one) and the
# dense path, batch invariance and closeness to fp32 (~1 min).
# Tree speculation end to end too: tree rows through the native int4 layer and the masked C
# kernel must stay token for token on the AVX2 int4 matmul; the shipped draft head's drafts
# (fused small ops, 4-bit matrices) likewise; and the engine measuring and observing its
# step costs (the speculation policy's curve) on that path, and the lookup back-off. The
# native layers (one call a layer, and every layer in one call) on ATen's AVX2 int4 kernel.
AVX2_ONLY = ["tests/engine/test_batch_invariance.py", "tests/engine/test_int4_weights.py",
             "tests/spec/test_observed_cost.py", "tests/spec/test_lookup_backoff.py",
             "tests/spec/test_tree_engine.py", "tests/spec/test_head_engine.py",
             "tests/spec/test_shipped_head.py", "tests/engine/test_native_layer.py",
             "tests/engine/test_native_stack.py"]
_ORDER = ["default", "avx2", "avx512"]
_ONEDNN_ISA = {"avx2": "AVX2", "default": "SSE41"}


def _current() -> str:
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" if cap.startswith("avx512") else cap


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_cpu_suites_pass_on_a_lower_cpu_kind(capability: str):
    if _ORDER.index(capability) >= _ORDER.index(_current()):
        pytest.skip(f"this machine's torch runs {_current()} already (the main run)")
    # oneDNN picks its ISA from the CPU, not from ATen: on an AMX machine torch's bf16 SDPA
    # then packs for AMX and refuses ("pack_vnni2 is only supported when avx512 is
    # supported"); capped as the lower kind's CPU would cap it, the run is that CPU's
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "QUICKDRAFT_ATTENTION": "fp32",
           "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[capability]}
    suites = [*SUITES, *AVX2_ONLY] if capability == "avx2" else SUITES
    marks = [] if capability == "avx2" else ["-m", "not slow"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, "-x",
         *suites], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(proc.stdout.splitlines()[-15:])
    assert proc.returncode == 0, f"under ATEN_CPU_CAPABILITY={capability}:\n{tail}"
    assert " passed" in tail
