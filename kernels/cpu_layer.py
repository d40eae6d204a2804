"""One decoder layer of the CPU bf16 int4 path in one native call.

At batch 1 a SmolLM2 layer spends ~125 µs in its four int4 matmuls (torch's kernel) and,
called op by op from Python, ~65 µs more in the Python-level calls around them (two
add+RMSNorms, RoPE, the KV write + attention, SiLU·up, torch's dispatch of the four matmuls,
glue). ``cpu_layer.cpp`` runs the same kernels on the same buffers in the same order from
C++: the C kernels of :mod:`kernels.cpu_fused` and :mod:`kernels.cpu_attention` (their
addresses handed over once) and ATen's CPU int4 matmul called directly, or the 4-bit x 8-bit
kernel of :mod:`kernels.cpu_q4q8` (its address handed over too). The result is bit-identical
to the Python layer, which stays the path for everything else (dense weights, fp32, biases
other than qkv's, other backends) and the fallback when this module is unavailable.

It is built with g++ against the installed torch on first use into
``$QUICKDRAFT_CACHE/kernels`` (about 7 s; keyed by source, flags and torch version) and
loaded with ``torch.ops.load_library`` as the op ``torch.ops.quickdraft_cpu.decoder_layer``.
Without g++, without the C kernels or on a failed build, :func:`available` is False (one
warning) and the model keeps its Python layers.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from quickdraft.kernels import cbuild, cpu_attention, cpu_fused, cpu_q4q8
from quickdraft.kernels.attention_metadata import AttentionMetadata, MetadataLayout

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_layer.cpp")
_NO_MASK = torch.empty(0, dtype=torch.int64)


def _flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    cflags = ("-O2", "-std=c++20", "-shared", "-fPIC", "-w",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              f"-DQD_TORCH_VERSION=\"{torch.__version__}\"",
              f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}")
    ldflags = (f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}")
    return cflags, ldflags


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    """Build (if needed), load and hand the C kernels over; False, with one error logged,
    when impossible (the decoder layers then run in Python, calling the C kernels)."""
    try:
        fused, attention = cpu_fused.native_entry_points(), cpu_attention.native_entry_points()
        gxx = shutil.which("g++")
        if fused is None or attention is None:
            problem = "the C kernels it calls are not available"
        elif gxx is None:
            problem = "g++ not found"
        else:
            cflags, ldflags = _flags()
            path = cbuild.build("cpu_layer", cbuild.read_source(_SOURCE), cflags, gxx,
                                lang="c++", ldflags=ldflags)
            torch.ops.load_library(str(path))
            _hand_over(attention["write_attend"])
            cbuild.record("cpu_layer", None)
            return True
    except subprocess.CalledProcessError as e:
        problem = f"build failed:\n{e.stderr.decode(errors='replace')[-2000:]}"
    except Exception as e:
        problem = f"unavailable ({type(e).__name__}: {e})"
    cbuild.record("cpu_layer", problem)
    return False


def _hand_over(write_attend: int, vnni: bool | None = None) -> None:
    """Give the op the C kernels' addresses (attention: ``write_attend``); ``vnni`` False
    runs the q4q8 matmuls on the AVX2 loop (None: the CPU's own)."""
    fused = cpu_fused.native_entry_points()
    assert fused is not None
    q4, q6, q4k = cpu_q4q8.native_entry_points() or (0, 0, 0)  # 0: int4 weights only
    torch.ops.quickdraft_cpu.set_cpu_kernels(
        fused["rms_norm"], fused["rope"], fused["silu_mul"], write_attend,
        fused["vec_block"], fused["parallel_rows"], q4, q6, q4k, cpu_q4q8.native_flags(vnni))


def use_q4q8_loop(vnni: bool | None) -> None:
    """For tests on an AVX512-VNNI machine: the ops' q4q8 matmuls on the AVX2 loop of the
    other CPU kind (False), or on this CPU's own again (None). Needs :func:`takes_q4q8`."""
    if not takes_q4q8():
        raise RuntimeError("the native layer cannot take q4q8 weights here")
    builtin = cpu_attention.native_entry_points()
    assert builtin is not None
    _hand_over(builtin["write_attend"], vnni)


def use_attention_kernel(write_attend: int | None) -> None:
    """For A/B benchmarks (``benchmarks/attention_ab.py``): run the op's attention through
    another build of ``qd_write_kv_attention_bf16`` (its address; the caller keeps that
    library loaded), or through the built-in one again (None). Needs :func:`available`."""
    if not available():
        raise RuntimeError("the native decoder layer is not available")
    builtin = cpu_attention.native_entry_points()
    assert builtin is not None
    _hand_over(builtin["write_attend"] if write_attend is None else write_attend)


def available() -> bool:
    """True when the op is built and loaded (``QUICKDRAFT_NATIVE_LAYER=0`` turns it off).
    Never raises."""
    if os.environ.get("QUICKDRAFT_NATIVE_LAYER", "1") == "0":
        return False
    return _load()


def takes_q4q8() -> bool:
    """Whether the op can run layers on :mod:`kernels.cpu_q4q8` weights (the kernel was
    there when the op was loaded)."""
    return available() and cpu_q4q8.available()


def layer_weights(ln1: torch.Tensor, qkv: tuple[torch.Tensor, ...],
                  o: tuple[torch.Tensor, ...], ln2: torch.Tensor,
                  gate_up: tuple[torch.Tensor, ...], down: tuple[torch.Tensor, ...],
                  qkv_bias: torch.Tensor | None) -> list[torch.Tensor]:
    """The op's weight list: norms bf16 ``[hidden]``, each matrix as (packed, scales and
    zeros) of :class:`kernels.cpu_int4.Int4Weight` or as :func:`kernels.cpu_q4q8.native_parts`
    (3 tensors, 4-bit or 6-bit; qkv may be two such matrices, 6 tensors, whose outputs are
    side by side), all four the same kernel; the optional qkv bias last."""
    int4 = len(qkv) == len(o) == len(gate_up) == len(down) == 2
    q4q8 = len(o) == len(gate_up) == len(down) == 3 and len(qkv) in (3, 6)
    if not int4 and not q4q8:
        raise ValueError("the four matrices must be all int4 (2 tensors) or all q4q8 (3; "
                         "qkv 3 or 6)")
    weights = [ln1, *qkv, *o, ln2, *gate_up, *down]
    return weights if qkv_bias is None else [*weights, qkv_bias]


def decoder_layer(x: torch.Tensor,  # [T, hidden] bf16: the previous sub-layer's output
                  residual: torch.Tensor | None,  # [T, hidden] bf16; None on the first layer
                  weights: list[torch.Tensor],  # from layer_weights
                  cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, head_dim] each
                  kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
                  meta: AttentionMetadata, heads: int, kv_heads: int, eps: float,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mlp output, residual)`` of the layer, as the Python layer returns them; None when
    the native side declines (a step the attention kernel rejects: a bad slot, query layout
    or tree mask, nothing written). ``meta.tree_mask`` goes to the kernel as it is."""
    try:
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.quickdraft_cpu.decoder_layer(
            x, residual, weights, cos_sin[0], cos_sin[1], kv_cache, _meta_tensors(meta), heads,
            kv_heads, eps, scale)
    except (RuntimeError, ValueError):
        return None
    return out


def _meta_tensors(meta: AttentionMetadata) -> list[torch.Tensor]:
    """The ops' metadata list, made once per step and shared by the layers."""
    tensors: list[torch.Tensor] | None = meta.plans.get("cpu_layer")
    if tensors is None:
        # the op's 5th metadata tensor: int64 [T] ancestor bits, or empty (every row causal)
        mask = _NO_MASK if meta.tree_mask is None else meta.tree_mask
        tensors = [meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                   mask]
        meta.plans["cpu_layer"] = tensors
    return tensors


def layer_stack(weights: list[list[torch.Tensor]],  # per layer, from layer_weights
                kv_caches: list[torch.Tensor],  # per layer
                heads: int, kv_heads: int, eps: float, scale: float) -> Any:
    """A model's layers bound once for :func:`run_stack` (a ``LayerStack`` of the op's
    library: it holds the weights and caches). Every layer the same heads, eps and scale
    (its weight list may differ: Qwen2.5's layers with 6-bit matrices). Needs
    :func:`available`."""
    if not weights or len(weights) != len(kv_caches):
        raise ValueError("one weight list for each KV cache")
    return torch.classes.quickdraft_cpu.LayerStack(
        [t for layer in weights for t in layer], [len(w) for w in weights], kv_caches, heads,
        kv_heads, eps, scale)


def run_stack(stack: Any, x: torch.Tensor,  # [T, hidden] bf16: the embeddings
              cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
              aux_after: list[int],  # ascending layer counts in 1..L
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Every layer of ``stack`` in one call: ``(x, residual, aux)`` as a loop of
    :func:`decoder_layer` calls gives them (bit-identical), ``aux [T, n * hidden]`` the
    residual streams ``x + residual`` after the ``n`` layer counts of ``aux_after`` side by
    side (None when it is empty); None when the step is declined (the attention kernel
    rejects it at the first layer, nothing written)."""
    try:
        out: list[torch.Tensor] = stack.forward(x, cos_sin[0], cos_sin[1], _meta_tensors(meta),
                                                aux_after)
    except (RuntimeError, ValueError):
        return None
    return out[0], out[1], out[2] if len(out) > 2 else None


def run_stack_normed(stack: Any, x: torch.Tensor,  # [T, hidden] bf16: the embeddings
                     cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     aux_after: list[int],  # ascending layer counts in 1..L
                     norm_weight: torch.Tensor,  # [hidden] bf16: the model's final norm
                     eps: float,
                     ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`run_stack` and the model's final norm in the same call: ``(rms_norm(x +
    residual) * norm_weight, aux)``, bit-identical to :func:`kernels.cpu_fused.add_rms_norm`
    on :func:`run_stack`'s ``x`` and ``residual``, ``aux`` as :func:`run_stack`'s; None when
    the step is declined. (The model calls :func:`run_stack_normed_ids`; this rows form is
    what the tests compare it with.)"""
    try:
        out: list[torch.Tensor] = stack.forward_normed(
            x, cos_sin[0], cos_sin[1], _meta_tensors(meta), aux_after, norm_weight, eps)
    except (RuntimeError, ValueError):
        return None
    return out[0], out[1] if len(out) > 1 else None


def run_stack_normed_ids(stack: Any, input_ids: torch.Tensor,  # [T] int64
                         positions: torch.Tensor,  # [T] int64
                         embed: torch.Tensor,  # [vocab, hidden] bf16: the token embeddings
                         rope_tables: tuple[torch.Tensor, torch.Tensor],  # [P, head_dim] bf16
                         meta: AttentionMetadata,
                         aux_after: list[int],  # ascending layer counts in 0..L (0: embeddings)
                         norm_weight: torch.Tensor, eps: float,
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`run_stack_normed` on ``embed[input_ids]`` with the RoPE tables' rows at
    ``positions``, gathered inside the same call (bit-identical: the rows ``F.embedding``
    copies; what the model calls); ``aux_after`` may start with 0, the embeddings (then the
    first block of ``aux``). None when the step is declined, also for an id or position out
    of range (checked before anything is written: the Python path then raises its own
    error)."""
    try:
        out: list[torch.Tensor] = stack.forward_normed_ids(
            input_ids, positions, embed, rope_tables[0], rope_tables[1], _meta_tensors(meta),
            aux_after, norm_weight, eps)
    except (RuntimeError, ValueError):
        return None
    return out[0], out[1] if len(out) > 1 else None


def head_layer_weights(input_norm: torch.Tensor, hidden_norm: torch.Tensor,
                       qkv: tuple[torch.Tensor, ...], o: tuple[torch.Tensor, ...],
                       post_norm: torch.Tensor, gate_up: tuple[torch.Tensor, ...],
                       down: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """:func:`head_layer`'s weight list: the draft head's norms (bf16 ``[hidden]``) and its
    four matrices, each as :func:`layer_weights` takes them (all four the same kind)."""
    if len({len(qkv), len(o), len(gate_up), len(down)}) != 1 or len(qkv) not in (2, 3):
        raise ValueError("the four matrices must be all int4 (2 tensors) or all q4q8 (3)")
    return [input_norm, hidden_norm, *qkv, *o, post_norm, *gate_up, *down]


def head_layer(emb: torch.Tensor,  # [T or r, hidden] bf16: the embeddings of the rows' tokens
               hidden: torch.Tensor,  # [T or r, hidden] bf16: fused features or parent outputs
               weights: list[torch.Tensor],  # from head_layer_weights
               cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T or r, head_dim] each
               kv_cache: torch.Tensor,  # the head's [2, blocks, block_size, kv_heads, d]
               meta: AttentionMetadata, heads: int, kv_heads: int, eps: float,
               scale: float, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The draft head's layer output ``[T, hidden]`` (``spec/draft_head.py``: the same
    kernels in the same order as its Python form), its K/V written at ``meta``'s slots;
    None when the native side declines (the attention kernel rejects the step).
    ``rows`` (int64 ``[r]``, increasing; None: all): ``emb``, ``hidden`` and ``cos_sin``
    hold only these rows of ``meta``'s step, the only ones computed and written (the
    others' K/V are cached already): the output is ``[r, hidden]``, each row the same bits
    as in the whole step."""
    mask = _NO_MASK if meta.tree_mask is None else meta.tree_mask
    tensors = [meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, mask]
    try:
        out: torch.Tensor = torch.ops.quickdraft_cpu.head_layer(
            emb, hidden, weights, cos_sin[0], cos_sin[1], kv_cache, tensors, heads, kv_heads,
            eps, scale, rows)
    except (RuntimeError, ValueError):
        return None
    return out


def head_stack(weights: list[torch.Tensor],  # head_layer's, + final norm, LM head, fc
               embed: torch.Tensor,  # the target's bf16 [vocab, hidden] embeddings
               rope_tables: tuple[torch.Tensor, torch.Tensor],  # bf16 [positions, d] each
               heads: int, kv_heads: int, eps: float, scale: float) -> Any:
    """The draft head bound once for :func:`run_head_stack` (the native ``HeadStack``):
    ``weights`` are :func:`head_layer_weights`' list, then the final norm and the LM head's
    q4q8 parts, then fc's."""
    return torch.classes.quickdraft_cpu.HeadStack(weights, embed, rope_tables[0],
                                                  rope_tables[1], heads, kv_heads, eps, scale)


def run_head_stack(stack: Any, input_ids: list[int], positions: list[int],
                   hidden: torch.Tensor,  # bf16 [r, 3 hidden] features or [r, hidden]
                   kv_cache: torch.Tensor,  # the head's [2, blocks, block_size, kv_heads, d]
                   layout: MetadataLayout, packed: list[int],  # attention_metadata.pack_step
                   tree_mask: list[int] | None = None, rows: list[int] | None = None,
                   logit_rows: list[int] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The draft head's forward in one native call on a bound ``stack``: :func:`head_layer`
    over the rows' embeddings and RoPE rows (gathered inside), on ``hidden`` or, given the
    target's fused features, on ``fc(hidden)``; its outputs ``[l, hidden]`` at the rows
    ``logit_rows`` (None: all) and their fp32 logits ``[l, V_d]`` through the final norm and
    the LM head. Without ``rows`` every row's K/V is written but only the ``logit_rows`` go
    on past the attention (o, the MLP: a catch-up's other rows' outputs are never read);
    ``rows`` as :func:`head_layer`'s. The step is given by its packed metadata (the values
    :class:`AttentionMetadata`'s tensors would hold, ``tree_mask`` below 2^63) and every
    index as a plain list. The same kernels in the same order as the head's torch calls
    (``spec/draft_head.py``), so the same bits. None when the native side declines (an id,
    position, index or block out of range: nothing written)."""
    try:
        out, logits = stack.forward(input_ids, positions, hidden, kv_cache, packed,
                                    layout.num_seqs, layout.max_blocks, tree_mask or [],
                                    rows or [], logit_rows or [])
    except (RuntimeError, ValueError):
        return None
    return out, logits
