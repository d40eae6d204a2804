"""Kernel backend selection: chosen once, from the device and what is installed, with a reason."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.backend import decide, resolve_device, select_backend
from quickdraft.engine.config import ConfigError, EngineConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("requested", "device", "triton_ok", "name", "graphs"), [
    ("auto", CUDA, True, "triton", True),
    ("auto", CUDA, False, "torch", False),
    ("auto", CPU, True, "torch", False),
    ("torch", CUDA, True, "torch", False),
    ("triton", CUDA, True, "triton", True),
])
def test_decide(requested, device, triton_ok, name, graphs):
    choice = decide(requested, device, True, triton_ok=triton_ok, interpreting=False)
    assert (choice.name, choice.cuda_graphs) == (name, graphs)
    assert choice.reason  # logged at start-up and shown by /health


def test_graphs_can_be_turned_off_and_need_triton_on_cuda():
    assert not decide("auto", CUDA, False, triton_ok=True, interpreting=False).cuda_graphs
    choice = decide("torch", CUDA, True, triton_ok=True, interpreting=False)
    assert not choice.cuda_graphs and "need the triton backend" in choice.reason
    assert "not on CUDA" in decide("auto", CPU, True, triton_ok=True, interpreting=False).reason


def test_forcing_triton_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(ConfigError, match="not installed"):
        decide("triton", CUDA, True, triton_ok=False, interpreting=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        decide("triton", CPU, True, triton_ok=True, interpreting=False)
    # under the interpreter the kernels take CPU tensors (how the tests run them)
    assert decide("triton", CPU, True, triton_ok=True, interpreting=True).name == "triton"


@pytest.mark.parametrize(("field", "value"), [
    ("device", "gpu"), ("device", "cuda:x"), ("kernel_backend", "cuda"),
    ("cuda_graph_max_tokens", 0),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_without_a_gpu():
    backend = select_backend(EngineConfig())
    assert backend.describe() == {
        "kernel_backend": "torch", "device": "cpu", "cuda_graphs": False,
        "batch_invariant": False,
        "reason": "auto: cpu device (the Triton kernels need CUDA); no CUDA graphs (not on CUDA)"}
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_forced_triton_under_the_interpreter():
    pytest.importorskip("triton")
    from quickdraft.kernels import triton_common

    if not triton_common.INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    backend = select_backend(EngineConfig(kernel_backend="triton", batch_invariant=False))
    assert backend.name == "triton" and backend.layer_ops is not None
    assert backend.attention.__name__ == "quickdraft.kernels.triton_attention"
    assert backend.linear is None and backend.verify_trees


def test_triton_is_batch_invariant_by_default():
    """The default triton backend: the fixed-tile GEMM for every linear layer, attention
    without split-KV, chains only (kernels/triton_invariant.py); /health says so."""
    pytest.importorskip("triton")
    from quickdraft.kernels import triton_common, triton_invariant, triton_matmul

    if not triton_common.INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    backend = select_backend(EngineConfig(kernel_backend="triton"))
    assert backend.attention is triton_invariant and backend.linear is triton_matmul.linear
    assert not backend.verify_trees
    described = backend.describe()
    assert described["batch_invariant"] is True and "batch-invariant" in described["reason"]
