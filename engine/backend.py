"""The kernel backend: which kernels run the model, on which device. Chosen once at start-up.

Two backends share one model definition (:mod:`engine.models.llama`), which calls them
through a small interface:

* ``torch``: the reference. Attention is :mod:`kernels.torch_attention` (SDPA / fp32
  math over gathered context, the bf16 C kernels on CPU), the layer ops are
  :mod:`kernels.torch_ops` (or the fused C kernels for bf16 on CPU), verification is
  :func:`spec.rejection_sampler.rejection_sample`. Runs anywhere, CUDA included.
* ``triton``: the GPU fast path. :mod:`kernels.triton_attention` (paged attention for any mix
  of decode, verification and prefill rows in one launch, and the KV write),
  :mod:`kernels.triton_ops` (RMSNorm, RoPE, SiLU·up) and :mod:`kernels.triton_rejection`.
  Its per-step metadata lives on the device and has fixed shapes per batch bucket, so its
  decode and verification steps can be captured as CUDA graphs (:mod:`engine.cuda_graphs`).
  Batch-invariant by default (``EngineConfig.batch_invariant``,
  :mod:`kernels.triton_invariant`): linear layers through a fixed-tile Triton GEMM instead of
  cuBLAS, attention in one tile shape without split-KV, chain drafts only, so that
  speculation's output is plain decoding's in bf16 too.
  On CPU it runs only under Triton's interpreter (``TRITON_INTERPRET=1``): slow, for tests.

``auto`` picks triton on CUDA when triton imports, torch otherwise. The choice and the reason
are logged at start-up and reported by ``/health``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.engine.models.llama_layers import LayerOps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendChoice:
    """The decision alone (pure; see :func:`decide`)."""

    name: str  # "torch" | "triton"
    cuda_graphs: bool
    reason: str


@dataclass(frozen=True)
class KernelBackend:
    name: str  # "torch" | "triton"
    device: torch.device
    attention: ModuleType  # write_kv, paged_attention(, write_kv_and_attend): all read the
    # one kernels.attention_metadata.AttentionMetadata, built from the step plan
    layer_ops: LayerOps | None  # None: the model keeps its own (torch refs / fused CPU ops)
    rejection_sample: Callable[..., Any]  # spec.rejection_sampler.rejection_sample's signature
    cuda_graphs: bool
    reason: str
    # every linear layer's matmul, (x [rows, in], weight, bias) -> [rows, out]; None: the
    # model's own (F.linear, or the CPU kernels)
    linear: Callable[..., Any] | None = None
    # whether verification may take token trees; False: each tree's best path (a chain),
    # where only a chain's rows get plain decoding's bits (kernels/triton_invariant.py)
    verify_trees: bool = True

    def describe(self) -> dict[str, Any]:
        """What ``/health`` and the start-up log report."""
        return {"kernel_backend": self.name, "device": str(self.device),
                "cuda_graphs": self.cuda_graphs, "batch_invariant": self.linear is not None,
                "reason": self.reason}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu; ``cuda`` without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: no CUDA GPU is visible to torch")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # present in sys.modules as None: blocked
        return False


def decide(requested: str, device: torch.device, want_graphs: bool, *,
           triton_ok: bool, interpreting: bool) -> BackendChoice:
    """Which backend runs, whether CUDA graphs are used, and why (no side effects)."""
    on_cuda = device.type == "cuda"
    if requested == "triton":
        if not triton_ok:
            raise ConfigError("kernel_backend 'triton': triton is not installed "
                              "(pip install triton)")
        if not on_cuda and not interpreting:
            raise ConfigError(f"kernel_backend 'triton' on {device}: the kernels need a CUDA "
                              "GPU, or TRITON_INTERPRET=1 for the (slow) CPU interpreter")
        name, reason = "triton", "forced by kernel_backend=triton"
    elif requested == "torch":
        name, reason = "torch", "forced by kernel_backend=torch"
    elif on_cuda and triton_ok:
        name, reason = "triton", "auto: CUDA device and triton installed"
    elif on_cuda:
        name, reason = "torch", "auto: triton is not installed"
    else:
        name, reason = "torch", f"auto: {device.type} device (the Triton kernels need CUDA)"
    graphs = want_graphs and on_cuda and name == "triton"
    if want_graphs and not graphs:
        reason += "; no CUDA graphs (" + ("not on CUDA" if not on_cuda else
                                          "they need the triton backend") + ")"
    return BackendChoice(name, graphs, reason)


def select_backend(config: EngineConfig) -> KernelBackend:
    """Build the backend ``config`` asks for, importing only the kernels it uses."""
    device = resolve_device(config.device)
    triton_ok = triton_installed() and (config.kernel_backend != "auto"
                                        or device.type == "cuda")
    interpreting = False
    if triton_ok:
        from quickdraft.kernels import triton_common

        triton_ok = triton_common.available()
        interpreting = triton_common.INTERPRET
    choice = decide(config.kernel_backend, device, config.cuda_graphs,
                    triton_ok=triton_ok, interpreting=interpreting)
    if choice.name == "triton":
        backend = _triton_backend(device, choice, config.batch_invariant)
    else:
        from quickdraft.kernels import torch_attention
        from quickdraft.spec.rejection_sampler import rejection_sample

        backend = KernelBackend("torch", device, torch_attention, None, rejection_sample,
                                False, choice.reason)
    log.info("kernel backend: %s", backend.describe())
    return backend


def _triton_backend(device: torch.device, choice: BackendChoice,
                    batch_invariant: bool) -> KernelBackend:
    from quickdraft.kernels import triton_attention, triton_ops, triton_rejection

    ops = LayerOps(triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.rope_neox_,
                   triton_ops.silu_mul)
    if not batch_invariant:
        return KernelBackend("triton", device, triton_attention, ops,
                             triton_rejection.rejection_sample, choice.cuda_graphs,
                             choice.reason + "; not batch-invariant (batch_invariant=False)")
    from quickdraft.kernels import triton_invariant

    return KernelBackend("triton", device, triton_invariant, ops,
                         triton_rejection.rejection_sample, choice.cuda_graphs,
                         choice.reason + "; batch-invariant (chain drafts only)",
                         linear=triton_invariant.linear, verify_trees=False)
