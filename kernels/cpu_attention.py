"""Attention of ragged query tokens over a paged bf16 KV cache: a whole batch in one C call.

``cpu_attention.c`` walks each sequence's block table directly (no gather of K/V), handles
all query heads of a kv-head group together (GQA: each K/V row is read once per group), and
uses an online softmax in fp32 over chunks of positions, started afresh every 128 visible
positions and folded segment by segment (so that a long context can be split between threads
by positions without changing a bit: one decode row after ~1,800 positions ~0.8x the step's
time on the 2-core AVX2-only EPYC, docs/kernels.md). Three lanes compute it (one per
process, :func:`lane`): on a CPU with AMX-BF16, q K^T and P V are tile multiplies
(``tdpbf16ps``, up to 16 query heads a tile: a row's heads, or several rows' in the chunks
they share; ``cpu_attention_amx.h``); with AVX512-BF16, bf16 pair dot products
(``vdpbf16ps``, fp32 accumulation, P rounded to bf16 first as GPU flash attention does;
``cpu_attention_dot.h``); elsewhere, or with ``QUICKDRAFT_ATTENTION=fp32``, K and V are
converted to fp32 and multiplied with fp32 FMAs (``cpu_attention_lane.h``). They may differ
in the last bits, and each keeps every invariant below. A sequence's query rows (draft rows
being verified, a prefill chunk) share each chunk of K/V read from the cache: at long
contexts the kernel is memory-bound, so the extra rows cost little more than their
arithmetic. It is built with gcc on first use
into ``$QUICKDRAFT_CACHE/kernels`` (default ``~/.cache/quickdraft/kernels``), keyed by a hash
of the source and flags, and loaded with ctypes. Without gcc, AVX2/FMA or on a failed build,
:func:`available` is False and the entry points return None: the caller
(:mod:`kernels.torch_attention`) then runs the torch path. The oracle the kernels are tested
against lives in ``tests/kernels/attention_oracle.py``.

:func:`ragged_attention` takes any number of new tokens per sequence (a decode token, k+1
speculative-verification tokens, a short prefill chunk), attending causally; each (token, kv
head) is computed by the same code as a lone decode query over that token's visible context,
so in bf16 verifying k+1 tokens gives bit-identical results to decoding them one at a time
(and a token's result never depends on the rest of the batch or the thread count).
:func:`decode_attention` is its one-token-per-sequence case.

Tree verification: ``tree_mask`` (int64 ``[num_tokens]``, the rows' ancestor bitmasks as
:mod:`kernels.attention_metadata` defines them; None = every row causal) lets a row with a
nonzero mask see its sequence's context before the new tokens plus only the new rows whose
bits it has. Its visible positions are walked in increasing order and chunked as a causal
row over as many positions would be, so a tree row's result is bit-identical to that of a
causal row whose context holds the same K/V at contiguous positions: once the accepted path's
K/V is copied into place, later decode steps see exactly what verification saw (lossless bf16
speculation). Rows with mask 0, or no mask at all, take the unchanged causal code.

Cache layout as in :mod:`kernels.attention_metadata`:
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V); position
``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]`` at offset
``p % block_size``.

The entry points are called once per layer per step, so they check only what is cheap
(dtypes, ``is_cpu``, contiguity, ranks and shapes); anything else returns None. The C
side also checks block ids against ``num_blocks``, the query layout (``query_start_loc``
starts at 0, never decreases, ends at ``num_tokens``) and ``q_len <= seq_lens[s] <=
max_blocks * block_size`` with a nonempty visible context, and every nonzero tree mask (bit
``i`` set for row ``i``, no higher bit, ``q_len <= 64``); a violation returns None too (the
torch path then raises, or returns NaN for an empty context).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from quickdraft.kernels import cbuild

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")
_CPU_FLAGS = frozenset({"avx2", "fma"})
_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
_AMX_FLAGS = _DOT_FLAGS | {"amx_tile", "amx_bf16"}
LANES = ("fp32", "dot", "amx")  # the C side's QD_LANE_FP32, _DOT, _AMX, in order
_BF16 = torch.bfloat16
_I32 = torch.int32
_I64 = torch.int64
# The C side takes at most this many (query heads per kv head) * head_dim, 64 heads per group,
# and head_dim <= 256.
_MAX_GD = 8192
_MAX_GROUP = 64
_MAX_DIM = 256

_vp = ctypes.c_void_p
_int = ctypes.c_int


class _Lib(NamedTuple):
    ragged: Callable[..., int]
    write_attend: Callable[..., int]
    use_lane: Callable[[int], int]  # an index into LANES (< 0: none); returns the lane in use
    dll: ctypes.CDLL


def _cpu_supported() -> bool:
    return cbuild.cpu_has(_CPU_FLAGS)


def _build(source: bytes, cc: str) -> Path:
    return cbuild.build("cpu_attention", source, _CFLAGS, cc)


@functools.lru_cache(maxsize=1)
def _lib() -> _Lib | None:
    """Build (if needed) and load the kernel; None, with one warning, when impossible."""
    lib = cbuild.load("cpu_attention", _SOURCE, _CFLAGS, _CPU_FLAGS)
    if lib is None:
        return None
    fn = lib.qd_ragged_attention_bf16
    fn.argtypes = [_vp] * 7 + [_int] * 8 + [ctypes.c_float, _int]
    fn.restype = _int
    both = lib.qd_write_kv_attention_bf16
    both.argtypes = [_vp, _int, *[_vp] * 7, *[_int] * 8, ctypes.c_float, _int]
    both.restype = _int
    use_lane = lib.qd_attention_use_lane
    use_lane.argtypes = [_int]
    use_lane.restype = _int
    chosen = _default_lane()
    for name in LANES[LANES.index(chosen)::-1]:  # the chosen lane, else the next one down
        if LANES[use_lane(LANES.index(name))] == name:
            break
        log.warning("cpu_attention: the %s lane was refused", name)
    return _Lib(fn, both, use_lane, lib)


def _best_lane() -> str:
    """The fastest lane this CPU has: amx, else dot, else fp32. Measured (benchmarks/
    attention_lanes.py): dot 0.67-0.83x the fp32 lane's time per call on the 2-core
    AVX512-BF16 EPYC; amx 0.54-0.98x the dot lane's on the 2-core AMX Xeon (0.98 for one
    row after 256 positions, 0.54 for 8 rows after 1,024; docs/kernels.md). By the CPU's
    flags, not by a timing at start-up: the lanes may differ in the last bits, and a
    process's bits must not depend on how busy the machine was when it started."""
    return "amx" if amx_supported() else "dot" if dot_supported() else "fp32"


def _default_lane() -> str:
    """``QUICKDRAFT_ATTENTION`` (fp32, dot or amx) if set and this CPU has it, else
    :func:`_best_lane`."""
    forced = os.environ.get("QUICKDRAFT_ATTENTION", "").strip().lower()
    best = _best_lane()
    if forced in LANES:
        if LANES.index(forced) > LANES.index(best):
            log.warning("QUICKDRAFT_ATTENTION=%s: this CPU cannot run it; using %s", forced, best)
            return best
        return forced
    if forced:
        log.warning("QUICKDRAFT_ATTENTION=%s is not one of %s; ignored", forced, LANES)
    return best


def dot_supported() -> bool:
    """Whether this CPU has what the dot lane needs (AVX512-BF16 and -BW/-VL); whether the
    kernel builds and loads is :func:`available`'s question."""
    return cbuild.cpu_has(_DOT_FLAGS)


def amx_supported() -> bool:
    """Whether this CPU has what the AMX lane needs (the dot lane's and AMX-BF16); Linux must
    also grant the tile state, which the kernel asks for when the lane is chosen."""
    return cbuild.cpu_has(_AMX_FLAGS)


def lane() -> str:
    """The lane this process computes attention with: one of :data:`LANES` (see the module
    docstring); ``"fp32"`` when the kernel is not available. Builds and loads the kernel if
    nothing has yet (see :func:`loaded_lane`)."""
    lib = _lib() if available() else None
    return LANES[lib.use_lane(-1)] if lib is not None else "fp32"


def runnable_lanes() -> tuple[str, ...]:
    """The lanes this process can run, slowest first (a subset of :data:`LANES`): each one
    asked of the kernel (for amx, Linux must grant the tile state), the lane in use kept;
    ``("fp32",)`` when the kernel is not available. Builds and loads the kernel if nothing
    has yet."""
    lib = _lib() if available() else None
    if lib is None:
        return ("fp32",)
    current = lib.use_lane(-1)
    runs = tuple(name for i, name in enumerate(LANES) if lib.use_lane(i) == i)
    lib.use_lane(current)
    return runs


def loaded_lane() -> str | None:
    """:func:`lane` if the kernel is already loaded in this process, else None; never builds
    (for ``/health``, which must not wait on a compiler)."""
    if _lib.cache_info().currsize == 0:
        return None
    return lane()


def set_lane(name: str) -> str:
    """Switch every later call (the native layer's too) to lane ``name``; returns the lane
    before. For tests and benchmarks that compare the lanes: a server keeps the lane it
    started with (the lanes may differ in the last bits, and decoding and verification must
    agree). Raises ValueError for an unknown lane, RuntimeError when this CPU cannot run
    ``name`` (the lane in use stays) or the kernel is not available."""
    if name not in LANES:
        raise ValueError(f"lane must be one of {LANES}, got {name!r}")
    lib = _lib() if available() else None
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    before = LANES[lib.use_lane(-1)]
    if LANES[lib.use_lane(LANES.index(name))] != name:  # refused: the lane stays
        need = "AVX512-BF16" if name == "dot" else "AMX-BF16 (granted by Linux)"
        raise RuntimeError(f"this CPU has no {need}: the {name} lane cannot run")
    return before


def available() -> bool:
    """True when the kernel is built, loaded and the CPU can run it. Never raises."""
    try:
        return _lib() is not None
    except Exception:
        return False


def native_entry_points() -> dict[str, int] | None:
    """For native callers (:mod:`kernels.cpu_layer`): the address of the KV write +
    attention kernel (``qd_write_kv_attention_bf16``); None when not built."""
    lib = _lib() if available() else None
    if lib is None:
        return None
    fn: Any = lib.write_attend
    return {"write_attend": ctypes.cast(fn, ctypes.c_void_p).value or 0}


# Threads are offered once a call has this many (row, kv head) lanes: one decode row of a
# 3-kv-head model is 3 one-head tasks, or, past 256 positions, runs of positions with all
# heads, one a thread (the kernel itself stays serial below QD_PAR_CTX positions of work). A
# lane's arithmetic does not depend on how tasks are spread over threads.
_PARALLEL_LANES = 2


def _mask_ptr(tree_mask: torch.Tensor, num_tokens: int) -> int | None:
    """The C pointer of ``tree_mask``, or None when the kernel does not take it (not a CPU
    contiguous int64 ``[num_tokens]`` vector). Its bits are checked on the C side."""
    if (tree_mask.dtype is not _I64 or not tree_mask.is_cpu or not tree_mask.is_contiguous()
            or tree_mask.shape != (num_tokens,)):
        return None
    return tree_mask.data_ptr()


def _run(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The C call (``query_start_loc`` None: one token per sequence), or None when the inputs
    are not the kernel's (the caller then runs the torch path)."""
    lib = _lib()
    if (lib is None or query.dtype is not _BF16 or kv_cache.dtype is not _BF16
            or block_tables.dtype is not _I32 or seq_lens.dtype is not _I32
            or not (query.is_cpu and kv_cache.is_cpu and block_tables.is_cpu and seq_lens.is_cpu)
            or not query.is_contiguous() or not kv_cache.is_contiguous()
            or not block_tables.is_contiguous() or not seq_lens.is_contiguous()
            or query.dim() != 3 or kv_cache.dim() != 5 or block_tables.dim() != 2):
        return None
    num_tokens, heads, dim = query.shape
    _, num_blocks, block_size, kv_heads, kv_dim = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    if (kv_dim != dim or dim % 8 or dim > _MAX_DIM or kv_heads == 0 or heads % kv_heads
            or heads // kv_heads > _MAX_GROUP or heads // kv_heads * dim > _MAX_GD
            or seq_lens.shape != (num_seqs,) or num_seqs == 0 or num_tokens == 0
            or max_blocks == 0 or num_blocks == 0):
        return None
    qsl_ptr = None
    if query_start_loc is None:
        if num_tokens != num_seqs:
            return None
    elif (query_start_loc.dtype is not _I32 or not query_start_loc.is_cpu
            or not query_start_loc.is_contiguous()
            or query_start_loc.shape != (num_seqs + 1,)):
        return None
    else:
        qsl_ptr = query_start_loc.data_ptr()
    mask_ptr = None
    if tree_mask is not None and (mask_ptr := _mask_ptr(tree_mask, num_tokens)) is None:
        return None
    out = torch.empty_like(query)
    rc = lib.ragged(query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
                    seq_lens.data_ptr(), qsl_ptr, mask_ptr, out.data_ptr(), num_seqs,
                    num_tokens, heads, kv_heads, dim, block_size, num_blocks, max_blocks, scale,
                    torch.get_num_threads() if num_tokens * kv_heads >= _PARALLEL_LANES else 1)
    return out if rc == 0 else None


def ragged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] bf16
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's tokens
    scale: float,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64 ancestor bits; None: causal
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim] bf16
    """Token ``i`` of sequence ``s`` (rows ``query_start_loc[s] .. query_start_loc[s+1] - 1``,
    ``q_len`` of them) and head ``h`` (kv head ``h // (heads // kv_heads)``) get
    ``softmax(scale * q K^T) V`` over positions ``[0, seq_lens[s] - q_len + i]`` (or, where
    ``tree_mask[t]`` is nonzero, over ``[0, seq_lens[s] - q_len)`` and the new rows ``j``
    whose bit it sets) in fp32, returned in bf16, in one C call (the new tokens' K/V already
    in the cache). All tensors CPU and contiguous, query/kv_cache bf16, block_tables,
    seq_lens and query_start_loc int32, tree_mask int64, ``head_dim % 8 == 0``; otherwise,
    or for a malformed mask, None (the caller runs the torch path)."""
    return _run(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, tree_mask)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] bf16
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] bf16
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new token
    scale: float,
) -> torch.Tensor | None:  # [num_seqs, num_heads, head_dim] bf16
    """:func:`ragged_attention` with one new token per sequence (``query_start_loc =
    arange``): same code path and bits. Input rules as there; otherwise None."""
    return _run(query, kv_cache, block_tables, seq_lens, None, scale)


def write_kv_and_attend(
    qkv: torch.Tensor,  # [num_tokens, (heads + 2 kv_heads) * head_dim] bf16, rows contiguous
    heads: int,
    kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim] bf16
    slot_mapping: torch.Tensor,  # [num_tokens] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64 ancestor bits; None: causal
) -> torch.Tensor | None:  # [num_tokens, heads, head_dim] bf16
    """A layer's KV write (the k and v columns of ``qkv`` into their slots) and
    :func:`ragged_attention` of its q columns (``tree_mask`` as there), in one C call with
    no copies; bit-equal to ``torch_attention.write_kv`` then :func:`ragged_attention`. None
    when the inputs are not the kernel's (nothing written; a bad slot, query layout or tree
    mask included): the caller then runs those two."""
    lib = _lib()
    if (lib is None or qkv.dtype is not _BF16 or kv_cache.dtype is not _BF16
            or not (qkv.is_cpu and kv_cache.is_cpu) or qkv.dim() != 2 or qkv.stride(1) != 1
            or not kv_cache.is_contiguous() or kv_cache.dim() != 5
            or slot_mapping.dtype is not _I32 or not slot_mapping.is_contiguous()
            or block_tables.dtype is not _I32 or not block_tables.is_contiguous()
            or seq_lens.dtype is not _I32 or not seq_lens.is_contiguous()
            or query_start_loc.dtype is not _I32 or not query_start_loc.is_contiguous()):
        return None
    num_tokens = qkv.shape[0]
    _, num_blocks, block_size, kv_h, dim = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    if (kv_h != kv_heads or qkv.shape[1] != (heads + 2 * kv_heads) * dim or dim % 8
            or dim > _MAX_DIM or heads % kv_heads or heads // kv_heads > _MAX_GROUP
            or heads // kv_heads * dim > _MAX_GD or num_tokens == 0 or num_seqs == 0
            or slot_mapping.shape != (num_tokens,) or seq_lens.shape != (num_seqs,)
            or query_start_loc.shape != (num_seqs + 1,)):
        return None
    mask_ptr = None
    if tree_mask is not None and (mask_ptr := _mask_ptr(tree_mask, num_tokens)) is None:
        return None
    out = torch.empty(num_tokens, heads, dim, dtype=_BF16)
    rc = lib.write_attend(qkv.data_ptr(), qkv.stride(0), slot_mapping.data_ptr(),
                          kv_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
                          query_start_loc.data_ptr(), mask_ptr, out.data_ptr(), num_seqs,
                          num_tokens, heads, kv_heads, dim, block_size, num_blocks, max_blocks,
                          scale, torch.get_num_threads()
                          if num_tokens * kv_heads >= _PARALLEL_LANES else 1)
    return out if rc == 0 else None
