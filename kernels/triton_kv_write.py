"""Triton's KV write: the new tokens' K and V rows scattered into their paged-cache slots.

:func:`write_kv` has the interface of :func:`kernels.torch_attention.write_kv` (the
``triton`` backend's attention module, :mod:`kernels.triton_attention`, re-exports it).
Layout as in :mod:`kernels.attention_metadata`: ``kv_cache[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (0 = K, 1 = V), slot ``s`` = block ``s // block_size``, offset
``s % block_size``.

``_write_kv_kernel``: one program per new token scatters its K and V rows
(``[num_kv_heads, head_dim]``, any strides) into ``slot_mapping[token]``, rounded to the
cache's dtype as the reference rounds (``round_to``); negative slots (padding tokens, e.g. a
CUDA-graph batch larger than the step) are skipped.

Importing this module never fails: without triton, :func:`available` is False and the entry
point raises.
"""

# No ``from __future__ import annotations`` in the kernel modules: triton reads the
# ``tl.constexpr`` annotations of the kernels' parameters.
import torch

from quickdraft.kernels.triton_common import (
    INTERPRET,
    available,
    jit,
    next_pow2,
    on_device,
    require,
    round_to,
    tl,
)

__all__ = ["available", "write_kv"]


@jit
def _write_kv_kernel(
    key_ptr, value_ptr, kv_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kv, stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, INTERP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch larger than the step)
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                mask=mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs \
        + h[:, None] * stride_ch + d[None, :] * stride_cd
    elem = kv_ptr.dtype.element_ty
    tl.store(kv_ptr + dst, round_to(k, elem, INTERP), mask=mask)
    tl.store(kv_ptr + stride_kv + dst, round_to(v, elem, INTERP), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int (negative = skip)
) -> None:
    """:func:`kernels.torch_attention.write_kv`: scatter the new tokens' K/V into their
    cache slots (cast to the cache dtype)."""
    require("quickdraft.kernels.triton_kv_write")
    num_tokens, kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit "
                         f"kv_cache {tuple(kv_cache.shape)}")
    if num_tokens == 0:
        return
    slot_mapping = on_device(slot_mapping, kv_cache.device)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, kv_cache.shape[2],
        *key.stride(), *value.stride(), *kv_cache.stride(),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(kv_heads), HEAD_DIM_PAD=next_pow2(head_dim), INTERP=INTERPRET)
