"""The Llama decoder's weights outside its modules (:mod:`engine.models.llama`): how an HF
checkpoint's tensor names map onto the fused parameters (q/k/v stacked in ``qkv``, gate/up in
``gate_up``), and the 4-bit copies of its matrices that the CPU kernels multiply by
(packing a file's Q4/Q6_K/Q8_0 blocks for :mod:`kernels.cpu_q4q8` or torch's int4 kernel,
Qwen's fused matrices whose parts come in two formats, the move onto 2 MiB pages).

Functions of their arguments (only :func:`onto_huge_pages` changes them: it rebinds the
linears' 4-bit copies to the moved tensors); the model calls them when it loads
(``load_weights``, ``attach_int4_weights``), its layers when they multiply and when they
bind to the native kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from quickdraft.engine.gguf_quant import HeadWeight, Q4Weight, Q6Weight, Q8Weight
from quickdraft.kernels import cpu_int4, cpu_q4q8, huge_pages
from quickdraft.kernels.cpu_int4 import Int4Weight
from quickdraft.kernels.cpu_q4q8 import Q4KQ8Weight, Q4Q8Weight, Q6Q8Weight, Q8Q8Weight

if TYPE_CHECKING:
    from quickdraft.engine.models.llama_layers import ModelShape

# A linear layer's 4-bit copy, by kernel: "torch" (ATen's int4 kernel, bf16 activations) or
# "q8" (kernels.cpu_q4q8: activations rounded to 8 bits, cheap extra rows; with it the LM
# head runs on the file's Q8_0 or Q6_K blocks where it has them).
FOUR_BIT_KERNELS = ("torch", "q8")


@dataclass(frozen=True)
class StackedWeight:
    """A fused matrix whose parts the file stores in different formats (Qwen's qkv with a
    Q6_K ``v_proj`` and Q4_K ``q_proj``/``k_proj``): each part on its own loop of
    :mod:`kernels.cpu_q4q8`, the outputs side by side (each row still computed alone)."""

    parts: tuple[Q4Q8Weight | Q4KQ8Weight | Q6Q8Weight, ...]


FourBitWeight = Int4Weight | Q4Q8Weight | Q4KQ8Weight | Q8Q8Weight | Q6Q8Weight | StackedWeight
HeadCopy = Q8Q8Weight | Q6Q8Weight  # an LM head's 8- or 6-bit copy (the "q8" kernel's)


class HasFourBitCopy(Protocol):
    """A linear layer as :func:`onto_huge_pages` sees it."""

    int4: FourBitWeight | None


def four_bit_linear(x: torch.Tensor, weight: FourBitWeight) -> torch.Tensor:
    """``x [rows, in] @ W^T -> [rows, out]`` with ``W``'s 4-bit (or 6-/8-bit) copy."""
    if isinstance(weight, cpu_q4q8.WEIGHTS):
        return cpu_q4q8.linear(x, weight)
    if isinstance(weight, StackedWeight):
        return torch.cat([cpu_q4q8.linear(x, part) for part in weight.parts], dim=-1)
    return cpu_int4.linear(x, weight)


def native_parts(weight: FourBitWeight) -> tuple[torch.Tensor, ...]:
    """The tensors :func:`kernels.cpu_layer.layer_weights` takes for one matrix (a stacked
    one's parts in turn)."""
    assert not isinstance(weight, Q8Q8Weight), "the layers' matrices are 4- or 6-bit"
    if isinstance(weight, StackedWeight):
        return tuple(t for part in weight.parts for t in cpu_q4q8.native_parts(part))
    if isinstance(weight, cpu_q4q8.LAYER_WEIGHTS):
        return cpu_q4q8.native_parts(weight)
    return weight.packed, weight.scales_and_zeros


def pack_fused(names: Sequence[str], weights: Mapping[str, Q4Weight | HeadWeight],
               shape: tuple[int, ...], kernel: str) -> FourBitWeight | None:
    """The 4-bit copy of one of our fused matrices (``shape`` = its dense weight's ``[out,
    in]``) whose HF parts are ``names`` in row order, packed for ``kernel`` (one of
    :data:`FOUR_BIT_KERNELS`); None when a part is missing or, for ``"torch"``, not 4-bit.
    With ``"q8"`` a part stored as Q6_K (Qwen's ``down_proj`` and ``v_proj`` in some layers)
    runs on the 6-bit loop, a fused matrix with such a part as a :class:`StackedWeight`."""
    found = [weights.get(n) for n in names]
    if kernel == "q8" and any(isinstance(w, Q6Weight) for w in found) \
            and all(isinstance(w, Q4Weight | Q6Weight) for w in found):
        return _pack_mixed(names, found, shape)
    if not found or not all(isinstance(w, Q4Weight) for w in found):
        return None
    q4 = Q4Weight.cat([w for w in found if isinstance(w, Q4Weight)])
    if q4.shape != shape:
        raise ValueError(f"{names[0]}: 4-bit shape {q4.shape}, expected {shape}")
    return (cpu_q4q8.pack_layer(q4.q, q4.d, q4.m) if kernel == "q8"
            else cpu_int4.pack(q4.q, q4.d, q4.m))


def pack_head(head: Q4Weight | HeadWeight | None, name: str,
              shape: tuple[int, ...]) -> HeadCopy | None:
    """The LM head's copy for the ``"q8"`` kernel from the file's Q8_0 or Q6_K blocks
    (``name``: where they were found, for the error); None for anything else or a shape the
    kernel does not take."""
    if not isinstance(head, Q8Weight | Q6Weight):
        return None
    if head.shape != shape:
        raise ValueError(f"{name}: {type(head).__name__} shape {head.shape}, expected {shape}")
    if not cpu_q4q8.supports(*head.shape):
        return None
    return (cpu_q4q8.pack_q8(head.q, head.d) if isinstance(head, Q8Weight)
            else cpu_q4q8.pack_q6(head.q, head.d, head.sc))


def _pack_mixed(names: Sequence[str], parts: list[Any],
                shape: tuple[int, ...]) -> Q6Q8Weight | StackedWeight:
    """A matrix with Q6_K parts (and maybe 4-bit ones) for :mod:`kernels.cpu_q4q8`: a lone
    Q6_K matrix packed as it is, else the parts one by one (adjacent 4-bit parts fused)."""
    runs: list[list[Any]] = []
    for part in parts:
        if runs and isinstance(part, Q4Weight) and isinstance(runs[-1][0], Q4Weight):
            runs[-1].append(part)
        else:
            runs.append([part])
    packed = [cpu_q4q8.pack_q6(run[0].q, run[0].d, run[0].sc) if isinstance(run[0], Q6Weight)
              else cpu_q4q8.pack_layer(*_cat_q4(run)) for run in runs]
    rows = sum(p.out_features for p in packed)
    if (rows, packed[0].in_features) != shape:
        raise ValueError(f"{names[0]}: Q6_K/4-bit parts of shape {(rows, packed[0].in_features)}"
                         f", expected {shape}")
    return packed[0] if len(packed) == 1 and isinstance(packed[0], Q6Q8Weight) \
        else StackedWeight(tuple(packed))


def _cat_q4(run: list[Q4Weight]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q4 = Q4Weight.cat(run)
    return q4.q, q4.d, q4.m


def onto_huge_pages(linears: Iterable[HasFourBitCopy]) -> None:
    """Move the linears' 4-bit weights into one buffer on 2 MiB pages (every decode step
    streams them all: :mod:`kernels.huge_pages`); the same values."""
    weights = [(lin, lin.int4) for lin in linears if lin.int4 is not None]
    names = [[f.name for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
             for _, w in weights]
    copies = iter(huge_pages.copy_to_huge_pages(
        [getattr(w, n) for (_, w), ns in zip(weights, names, strict=True) for n in ns]))
    for (lin, w), ns in zip(weights, names, strict=True):
        moved: dict[str, Any] = {n: next(copies) for n in ns}
        lin.int4 = dataclasses.replace(w, **moved)


# ------------------------------------------------------------------ checkpoint names

def _slices(shape: ModelShape) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """HF matrix (within a layer) -> our linear layer and its row range in it (None: all)."""
    q, kv, inter = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up", (inter, 2 * inter)),
        "self_attn.o_proj": ("self_attn.o", None),
        "mlp.down_proj": ("mlp.down", None),
    }


def fused_parts(shape: ModelShape) -> dict[str, list[str]]:
    """Our linear layers -> the HF matrices stacked in them, in row order."""
    parts: dict[str, list[str]] = {}
    for hf, (target, _rows) in _slices(shape).items():
        parts.setdefault(target, []).append(hf)
    return parts


def map_weight(name: str, shape: ModelShape) -> tuple[str | None, tuple[int, int] | None]:
    """HF tensor name -> (our parameter name, row range inside a fused parameter); (None,
    None) for a tensor we do not keep (RoPE tables, a tied LM head)."""
    if "rotary_emb" in name:
        return None, None
    if name == "lm_head.weight":
        return (None, None) if shape.tie_word_embeddings else ("lm_head.weight", None)
    name = name.removeprefix("model.")
    if name in ("embed_tokens.weight", "norm.weight"):
        return name.removesuffix(".weight") if name.startswith("embed") else name, None
    rest = name.removeprefix("layers.")  # "N.self_attn.q_proj.weight"
    index, _, rest = rest.partition(".")
    module, _, kind = rest.rpartition(".")  # "self_attn.q_proj", "weight"
    base = f"layers.{index}."
    fused = _slices(shape)
    if module in fused:
        target, rows = fused[module]
        return f"{base}{target}.{kind}", rows
    return f"{base}{rest}", None
