"""The GGUF's own 4-bit weights, read as stored, for the native int4 path.

A GGUF converted for HF (``engine.loader``) is dequantized to fp32; this module reads the
quantized blocks of the same file instead, so that the linear layers can run on them
(``kernels.cpu_int4``) and read 4.5 bits a weight rather than 16.

Formats that map exactly onto a 4-bit code with one fp scale and offset per 32 weights
(``w = d · q + m``, ``q`` in 0..15):

- ``Q4_1``: blocks of 32: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles (low nibbles are
  weights 0-15, high nibbles 16-31);
- ``Q4_0``: blocks of 32: fp16 ``d``, nibbles; ``w = d · (q − 8)``, i.e. ``m = −8 d``;
- ``Q4_K``: super-blocks of 256: fp16 ``d`` and ``dmin``, eight 6-bit scales ``sc`` and mins
  ``mn``, 128 bytes of nibbles (each 32-byte chunk: low nibbles one sub-block of 32, high
  nibbles the next); ``w = (d · sc) · q − dmin · mn`` per sub-block, i.e. ``d = d · sc``,
  ``m = −dmin · mn``.

Layer matrices stored as ``Q6_K`` (Qwen2.5's Q4_K_M files keep some ``ffn_down`` and
``attn_v`` so) are returned as :class:`Q6Weight` (below); other formats are not returned,
and their layers keep the dense weights. The LM head is read too when it is stored as
``Q8_0`` (blocks of 32: fp16 ``d``, 32 int8 codes; ``w = d · q``) or ``Q6_K``
(super-blocks of 256: 6-bit codes ``q`` in -32..31, an int8 scale ``sc`` per 16 weights and
an fp16 ``d``; ``w = (d · sc) · q``, ``d · sc`` exact in fp32), as Qwen2.5's Q4_K_M files
store theirs: ``output.weight``, or the tied ``token_embd.weight`` as SmolLM2's file has
it (:func:`read_head`). Tensor names are the HF ones, and the Llama q/k rows are permuted
back as transformers does when it dequantizes, so row ``i`` here is row ``i`` of the
converted checkpoint.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GROUP = 32  # weights per scale/offset

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class Q4Weight:
    """``w[n, k] = d[n, k // 32] · q[n, k] + m[n, k // 32]`` for a ``[out, in]`` matrix."""

    q: torch.Tensor  # [out, in] uint8, values 0..15
    d: torch.Tensor  # [out, in / 32] fp32 (exact: fp16 in the file)
    m: torch.Tensor  # [out, in / 32] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:  # [out, in] fp32, as gguf/transformers compute it
        out, k = self.shape
        q = self.q.view(out, k // GROUP, GROUP).float()
        return (self.d[..., None] * q + self.m[..., None]).view(out, k)

    def rows(self, index: torch.Tensor) -> Q4Weight:
        return Q4Weight(self.q[index], self.d[index], self.m[index])

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        """Stacked along the output rows (q, k, v into one qkv matrix)."""
        return Q4Weight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))


@dataclass(frozen=True)
class Q8Weight:
    """``w[n, k] = d[n, k // 32] · q[n, k]`` for a ``[out, in]`` matrix (GGUF ``Q8_0``)."""

    q: torch.Tensor  # [out, in] int8
    d: torch.Tensor  # [out, in / 32] fp32 (exact: fp16 in the file)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:  # [out, in] fp32, exact
        out, k = self.shape
        return (self.d[..., None] * self.q.view(out, k // GROUP, GROUP).float()).view(out, k)


@dataclass(frozen=True)
class Q6Weight:
    """``w[n, k] = d[n, k // 256] · sc[n, k // 16] · q[n, k]`` for a ``[out, in]`` matrix (GGUF
    ``Q6_K`` as stored: an fp16 ``d`` per super-block of 256 and an int8 ``sc`` per 16
    weights; ``d · sc`` is exact in fp32, and so is its product with a code)."""

    q: torch.Tensor  # [out, in] int8, values -32..31
    d: torch.Tensor  # [out, ceil(in / 256)] fp32 (fp16 values)
    sc: torch.Tensor  # [out, in / 16] int8

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def scales(self) -> torch.Tensor:  # [out, in / 16] fp32: d · sc, exact
        return self.d.repeat_interleave(16, dim=1)[:, : self.sc.shape[1]] * self.sc.float()

    def dequantize(self) -> torch.Tensor:  # [out, in] fp32, exact
        out, k = self.shape
        return (self.scales()[..., None] * self.q.view(out, k // 16, 16).float()).view(out, k)

    def rows(self, index: torch.Tensor) -> Q6Weight:
        return Q6Weight(self.q[index], self.d[index], self.sc[index])


HeadWeight = Q8Weight | Q6Weight  # the LM head formats read as stored
LM_HEAD = "lm_head.weight"  # the key of the 8- or 6-bit head among the 4-bit matrices


def _unpack_q8_0(blocks: np.ndarray, out: int, k: int) -> Q8Weight:
    """Raw ``[out, bytes per row]`` uint8 rows of Q8_0 blocks (34 bytes per 32 weights)."""
    b = np.ascontiguousarray(blocks).reshape(out, k // GROUP, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(out, k)  # (a fresh array: no second copy)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(d))


def _unpack_q6_k(blocks: np.ndarray, out: int, k: int) -> Q6Weight:
    """Raw ``[out, bytes per row]`` uint8 rows of Q6_K super-blocks (256 weights, 210 bytes:
    128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 ``d``), in the
    element order of gguf's own dequantization."""
    n = out * (k // 256)
    b = np.ascontiguousarray(blocks).reshape(n, 210)
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8)  # [n, 16]
    d = b[:, 208:210].copy().view(np.float16)[:, 0].astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).astype(np.int8) - 32
    return Q6Weight(torch.from_numpy(q.reshape(out, k).copy()),
                    torch.from_numpy(d.reshape(out, k // 256).copy()),
                    torch.from_numpy(sc.reshape(out, k // 16).copy()))


def _unpack(blocks: np.ndarray, out: int, k: int, has_min: bool) -> Q4Weight:
    """Raw ``[out, bytes per row]`` uint8 rows of Q4_1 (``has_min``) or Q4_0 blocks."""
    size = 20 if has_min else 18
    b = np.ascontiguousarray(blocks).reshape(out, k // GROUP, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if has_min:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = b[..., 4:]
    else:
        m = -8.0 * d  # exact: a power-of-two multiple
        nibbles = b[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [out, groups, 32]
    return Q4Weight(torch.from_numpy(q.reshape(out, k).copy()),
                    torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def _unpack_q4_k(blocks: np.ndarray, out: int, k: int) -> Q4Weight:
    """Raw ``[out, bytes per row]`` uint8 rows of Q4_K super-blocks (256 weights, 144 bytes)."""
    from gguf import quants  # the 6-bit scale/min unpacking, as llama.cpp packs it

    n = out * (k // 256)
    b = np.ascontiguousarray(blocks).reshape(n, 144)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
    sc, mn = quants.Q4_K.get_scale_min(b[:, 4:16].copy())  # [n, 8] each
    sub_d = d[:, None] * sc.astype(np.float32)  # [n, 8]
    sub_m = -(dmin[:, None] * mn.astype(np.float32))
    chunks = b[:, 16:].reshape(n, 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=2)  # [n, 4, 2, 32]: sub-block 2j, 2j + 1
    groups = k // GROUP
    return Q4Weight(torch.from_numpy(q.reshape(out, k).copy()),
                    torch.from_numpy(sub_d.reshape(out, groups).copy()),
                    torch.from_numpy(sub_m.reshape(out, groups).copy()))


def _unpermute_rows(out: int, heads: int) -> torch.Tensor:
    """Row order transformers gives a llama.cpp-permuted q/k matrix of ``heads`` heads."""
    half = out // heads // 2
    return torch.arange(out).view(heads, half, 2).transpose(1, 2).reshape(-1)


def read_q4_weights(gguf_path: Path, *, llama_permute: bool, num_heads: int,
                    num_kv_heads: int, tied: bool | None = None,
                    ) -> dict[str, Q4Weight | HeadWeight]:
    """Every layer matrix of the file stored as Q4_1, Q4_0, Q4_K (:class:`Q4Weight`) or Q6_K
    (:class:`Q6Weight`), keyed by its HF name (``model.layers.N.self_attn.q_proj.weight``);
    ``llama_permute``: the architecture whose q/k rows transformers permutes back
    (llama/mistral, not qwen2). With ``tied`` given (whether the model reuses its
    embedding as the head), also the Q8_0 or Q6_K LM head under :data:`LM_HEAD` when there
    is one (:func:`read_head`), from the same parse."""
    from gguf import GGMLQuantizationType, GGUFReader  # optional at import time

    Kind = GGMLQuantizationType
    # format -> (weights a block, the rows' unpacker)
    unpackers: dict[Any, tuple[int, Any]] = {
        Kind.Q4_1: (GROUP, lambda data, out, k: _unpack(data, out, k, has_min=True)),
        Kind.Q4_0: (GROUP, lambda data, out, k: _unpack(data, out, k, has_min=False)),
        Kind.Q4_K: (256, _unpack_q4_k), Kind.Q6_K: (256, _unpack_q6_k)}
    tensors = GGUFReader(str(gguf_path)).tensors
    weights: dict[str, Q4Weight | HeadWeight] = {}
    for tensor in tensors:
        match = _BLOCK.fullmatch(tensor.name)
        if match is None or tensor.tensor_type not in unpackers:
            continue
        layer, kind = match.groups()
        if kind not in _LAYER_NAMES:
            continue
        k, out = (int(v) for v in tensor.shape[:2])  # GGUF lists the fastest dim first
        block, unpack = unpackers[tensor.tensor_type]
        if k % block:
            continue
        w: Q4Weight | Q6Weight = unpack(tensor.data, out, k)
        if llama_permute and kind in ("attn_q", "attn_k"):
            w = w.rows(_unpermute_rows(out, num_heads if kind == "attn_q" else num_kv_heads))
        weights[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = w
    if tied is not None and (head := _head(tensors, tied)) is not None:
        weights[LM_HEAD] = head
    return weights


def read_head(gguf_path: Path, tied: bool) -> HeadWeight | None:
    """The LM head when the file stores it as Q8_0 or Q6_K: ``output.weight``, else
    (``tied``: the model reuses its embedding) ``token_embd.weight``; None otherwise."""
    from gguf import GGUFReader

    return _head(GGUFReader(str(gguf_path)).tensors, tied)


def _head(tensors: Any, tied: bool) -> HeadWeight | None:
    from gguf import GGMLQuantizationType

    by_name = {t.name: t for t in tensors}
    tensor = by_name.get("output.weight") or (by_name.get("token_embd.weight") if tied
                                              else None)
    if tensor is None:
        return None
    k, out = (int(v) for v in tensor.shape[:2])
    if tensor.tensor_type == GGMLQuantizationType.Q8_0 and k % GROUP == 0:
        return _unpack_q8_0(tensor.data, out, k)
    if tensor.tensor_type == GGMLQuantizationType.Q6_K and k % 256 == 0:
        return _unpack_q6_k(tensor.data, out, k)
    return None


def save_q4_weights(path: Path, weights: dict[str, Q4Weight | HeadWeight]) -> None:
    """Write ``weights`` to one safetensors file (two codes a byte), atomically: reading the
    GGUF takes seconds (its Python reader parses the whole tokenizer), this file loads in a
    fraction of one."""
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, Q8Weight):
            tensors[f"{name}.q8"], tensors[f"{name}.d"] = w.q.contiguous(), w.d.contiguous()
            continue
        if isinstance(w, Q6Weight):
            tensors[f"{name}.q6"], tensors[f"{name}.d"] = w.q.contiguous(), w.d.contiguous()
            tensors[f"{name}.sc"] = w.sc.contiguous()
            continue
        tensors[f"{name}.q"] = (w.q[:, 0::2] | (w.q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.d"], tensors[f"{name}.m"] = w.d.contiguous(), w.m.contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def load_q4_weights(path: Path) -> dict[str, Q4Weight | HeadWeight]:
    """What :func:`save_q4_weights` wrote."""
    tensors = load_file(str(path))
    weights: dict[str, Q4Weight | HeadWeight] = {}
    for key in tensors:
        if key.endswith(".q8"):
            weights[key[:-3]] = Q8Weight(tensors[key], tensors[f"{key[:-3]}.d"])
            continue
        if key.endswith(".q6"):
            name = key[:-3]
            weights[name] = Q6Weight(tensors[key], tensors[f"{name}.d"], tensors[f"{name}.sc"])
            continue
        if not key.endswith(".q"):
            continue
        name = key[:-2]
        pairs = tensors[key]  # [out, in / 2]
        q = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).view(pairs.shape[0], -1)
        weights[name] = Q4Weight(q, tensors[f"{name}.d"], tensors[f"{name}.m"])
    return weights
