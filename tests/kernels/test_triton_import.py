"""The Triton kernel modules import, and say they cannot run, on a machine without triton
(the CPU engine must never need it)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
from quickdraft.kernels import triton_attention as ta, triton_common as tc, triton_ops as ops
from quickdraft.kernels import triton_rejection as tr
from quickdraft.engine.backend import select_backend
from quickdraft.engine.config import EngineConfig
assert not ta.available() and not ops.available() and not tc.available()
assert not tr.available()
# auto falls back to the torch path; forcing triton is a clear error
assert select_backend(EngineConfig(device="cpu")).name == "torch"
try:
    select_backend(EngineConfig(device="cpu", kernel_backend="triton"))
except ValueError as e:
    assert "triton is not installed" in str(e), e
else:
    raise AssertionError("triton forced without triton")
assert not ta.interpreting()
for call in (lambda: ta.write_kv(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2),
                                 torch.zeros(2, 1, 1, 1, 2), torch.zeros(1, dtype=torch.long)),
             lambda: ops.rms_norm(torch.zeros(1, 2), torch.ones(2), 1e-5),
             lambda: ops.silu_mul(torch.zeros(1, 2)),
             lambda: tr.rejection_sample(torch.zeros(1, 4), [[]], None, None)):
    try:
        call()
    except RuntimeError as e:
        assert "needs triton" in str(e)
    else:
        raise AssertionError("ran without triton")
print("OK")
"""


def test_modules_import_without_triton():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")
