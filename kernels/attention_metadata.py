"""One step's attention metadata: the one type every attention backend consumes.

Every backend (the CPU C kernels, the torch path, the Triton kernels, eagerly or inside a
CUDA graph) reads the same four int32 arrays, packed in this order into one buffer so a step
costs one host-to-device copy, the device tensors being views into it:

* ``slot_mapping [num_tokens]``: the cache slot where each new token's K/V is written
  (-1: write nothing). A token at position ``p`` of a sequence with block table ``t`` lives
  in slot ``t[p // block_size] * block_size + p % block_size`` (:func:`slots_of`, the one
  place this formula is written);
* ``query_start_loc [num_seqs + 1]``: sequence ``s`` owns the step's rows
  ``query_start_loc[s]:query_start_loc[s + 1]``, the last ``q_len`` positions of its
  context, attending causally;
* ``seq_lens [num_seqs]``: context length including the new tokens;
* ``block_tables [num_seqs, max_blocks]``: padded with 0.

Tree verification adds one optional array, outside the packed buffer (eager steps only; a
CUDA graph never replays a tree step):

* ``tree_mask [num_tokens]`` int64, or None (every row causal). Row ``t`` of sequence ``s``
  (``i = t - query_start_loc[s]``, ``q_len`` rows, ``base = seq_len - q_len``): ``0`` means
  causal (positions ``[0, base + i]``); otherwise bit ``j`` set means the row also sees query
  row ``j`` of its sequence (cache position ``base + j``) besides the context ``[0, base)``.
  A nonzero mask has bit ``i`` set and no bit above ``i`` (a node sees itself and its
  ancestors, which come before it), so only sequences with ``q_len <= 64`` carry one. The
  slot of row ``i`` stays ``base + i`` (flat order); its RoPE position (the model's input,
  not the metadata) is ``base`` + the row's depth in its tree.

Cache layout (one tensor per layer): ``kv_cache[2, num_blocks, block_size, num_kv_heads,
head_dim]``, 0 = K, 1 = V.

A :class:`MetadataLayout` fixes the sizes. For an eager step they are the step's own; for a
CUDA graph they are the graph's bucket (``num_tokens`` and ``num_seqs`` padded up): the
extra tokens belong to one *padding sequence* right after the real ones (its K/V writes are
skipped through slot -1; its context is one position, in block 0, so all but its first
query row see no key at all and give 0; its outputs are thrown away), and the sequences
after it are empty. The Triton grid depends only on the layout, so a captured graph replays
any step that fits its bucket.

Invariants of a filled buffer (checked by :func:`fill_packed` on its inputs, and by
:meth:`AttentionMetadata.check_invariants`): ``query_start_loc`` starts at 0, never
decreases and ends at ``num_tokens``; ``q_len <= seq_len <= max_blocks * block_size``
(except the padding sequence, whose rows all have slot -1); every slot is the formula above
or -1.

No triton import here: the engine builds metadata whether or not the kernels are compiled.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class MetadataLayout:
    num_tokens: int
    num_seqs: int
    max_blocks: int  # columns of the block table

    @property
    def size(self) -> int:
        """int32 elements of the packed array."""
        return self.num_tokens + 2 * self.num_seqs + 1 + self.num_seqs * self.max_blocks

    def offsets(self) -> tuple[int, int, int, int]:
        """Start of slot_mapping, query_start_loc, seq_lens, block_tables in the packed array."""
        qsl = self.num_tokens
        lens = qsl + self.num_seqs + 1
        return 0, qsl, lens, lens + self.num_seqs


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step. The tensors are views of one int32 buffer on
    the backend's device; ``host`` is the packed step on the host they were copied from (the
    same memory on a CPU). A CUDA graph's metadata is built once over its static buffers,
    which are refilled before every replay: read ``host`` through the methods below, at
    the time of use."""

    layout: MetadataLayout
    host: np.ndarray  # [layout.size] int32
    slot_mapping: torch.Tensor  # [num_tokens] int32, -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    block_size: int
    max_query_len: int  # an upper bound of the longest real query (picks the Triton tile)
    max_seq_len: int  # an upper bound of the longest context (picks split-KV)
    num_splits: int | None = None  # Triton split-KV; None: chosen per call from the shapes
    # [num_tokens] int64 ancestor bitmasks of tree-verification rows (module docstring), on
    # the device; None: every row attends causally
    tree_mask: torch.Tensor | None = None
    # A backend's own per-step plan, made on first use by that backend alone (the torch
    # path's SDPA groups): keyed by the backend's name.
    plans: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def num_seqs(self) -> int:
        return self.layout.num_seqs

    def host_query_start_loc(self) -> list[int]:
        _, qsl, lens, _ = self.layout.offsets()
        return self.host[qsl:lens].tolist()

    def host_seq_lens(self) -> list[int]:
        _, _, lens, tables = self.layout.offsets()
        return self.host[lens:tables].tolist()

    def host_block_tables(self) -> torch.Tensor:  # [num_seqs, max_blocks] int32, on the host
        tables = self.layout.offsets()[3]
        view = self.host[tables:self.layout.size].reshape(self.num_seqs, self.layout.max_blocks)
        return torch.from_numpy(view)

    def host_slot_mapping(self) -> torch.Tensor:  # [num_tokens] int32, on the host
        return torch.from_numpy(self.host[: self.num_tokens])

    def check_invariants(self) -> None:
        """Assert what the module docstring promises of the packed step (tests run it)."""
        qsl, lens = self.host_query_start_loc(), self.host_seq_lens()
        tables, slots = self.host_block_tables(), self.host_slot_mapping().tolist()
        capacity = self.layout.max_blocks * self.block_size
        assert qsl[0] == 0 and qsl[-1] == self.num_tokens, qsl
        real_q_lens = [0]
        for s in range(self.num_seqs):
            q_len = qsl[s + 1] - qsl[s]
            assert q_len >= 0 and lens[s] <= capacity, (s, q_len, lens[s], capacity)
            if q_len and all(slot == -1 for slot in slots[qsl[s]:qsl[s + 1]]):
                assert lens[s] == 1, (s, lens[s])  # a CUDA graph's padding sequence
                continue
            assert q_len <= lens[s], (s, q_len, lens[s])
            real_q_lens.append(q_len)
            positions = np.arange(lens[s] - q_len, lens[s])
            want = slots_of(tables[s].numpy(), positions, self.block_size).tolist()
            for row, slot in zip(range(qsl[s], qsl[s + 1]), want, strict=True):
                assert slots[row] in (slot, -1), (row, slots[row], slot)
        assert self.max_query_len >= max(real_q_lens)
        assert self.max_seq_len >= max(lens, default=0)
        if self.tree_mask is not None:
            check_tree_mask(self.tree_mask.cpu().tolist(), qsl)


def check_tree_mask(masks: Sequence[int], query_start_loc: Sequence[int]) -> None:
    """Assert that ``masks`` (one per row) are causal (0) or ancestor sets as the module
    docstring says: bit ``i`` set for row ``i``, no higher bit, ``q_len <= 64``."""
    assert len(masks) == query_start_loc[-1], (len(masks), query_start_loc[-1])
    for s, (start, end) in enumerate(itertools.pairwise(query_start_loc)):
        for i, mask in enumerate(masks[start:end]):
            if mask == 0:
                continue
            bits = mask & ((1 << 64) - 1)  # int64 -> the unsigned 64-bit pattern
            assert end - start <= 64, (s, end - start)
            assert bits >> i == 1 and bits & (1 << i), (s, i, hex(bits))


def slots_of(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of ``positions`` of a sequence whose block table is ``table``."""
    return table[positions // block_size] * block_size + positions % block_size


def _check_query_start_loc(query_start_loc: Sequence[int], num_seqs: int) -> None:
    if len(query_start_loc) != num_seqs + 1 or query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc {list(query_start_loc)} for {num_seqs} sequences")


def _check_sequence(s: int, q_len: int, ctx: int, num_blocks: int, block_size: int) -> None:
    if not 0 <= q_len <= ctx <= num_blocks * block_size:
        raise ValueError(f"sequence {s}: {q_len} new tokens, context {ctx}, "
                         f"{num_blocks} blocks of {block_size}")


def fill_packed(out: np.ndarray, layout: MetadataLayout, query_start_loc: Sequence[int],
                seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                block_size: int) -> None:
    """Write one step into ``out`` (int32, ``layout.size``), padding as the module says.
    Raises ValueError for a step that does not fit ``layout`` or breaks the invariants."""
    num_seqs, num_tokens = len(seq_lens), query_start_loc[-1]
    needed_seqs = num_seqs + (num_tokens < layout.num_tokens)  # + the padding sequence
    if num_tokens > layout.num_tokens or needed_seqs > layout.num_seqs:
        raise ValueError(f"{num_tokens} tokens / {num_seqs} sequences do not fit {layout}")
    _check_query_start_loc(query_start_loc, num_seqs)
    o_slots, o_qsl, o_lens, o_tables = layout.offsets()
    slots = out[o_slots:o_qsl]
    qsl = out[o_qsl:o_lens]
    lens = out[o_lens:o_tables]
    tables = out[o_tables:].reshape(layout.num_seqs, layout.max_blocks)
    tables[:] = 0
    for s, table in enumerate(block_tables):
        start, end, ctx = query_start_loc[s], query_start_loc[s + 1], seq_lens[s]
        _check_sequence(s, end - start, ctx, len(table), block_size)
        if len(table) > layout.max_blocks:
            raise ValueError(f"block table of {len(table)} blocks > {layout.max_blocks}")
        row = np.asarray(table, dtype=np.int32)
        tables[s, : len(row)] = row
        positions = np.arange(ctx - (end - start), ctx)
        slots[start:end] = slots_of(row, positions, block_size)
    slots[num_tokens:] = -1
    qsl[: num_seqs + 1] = query_start_loc
    lens[:num_seqs] = seq_lens
    pad = layout.num_tokens - num_tokens
    if pad:  # the padding sequence: a context of one position (the cheapest valid one)
        qsl[num_seqs + 1] = layout.num_tokens
        lens[num_seqs] = 1
        num_seqs += 1
    qsl[num_seqs + 1:] = layout.num_tokens
    lens[num_seqs:] = 0


def unpack(buf: torch.Tensor, host: np.ndarray, layout: MetadataLayout, block_size: int,
           max_query_len: int, max_seq_len: int, num_splits: int | None = None,
           tree_mask: torch.Tensor | None = None) -> AttentionMetadata:
    """Views of a packed int32 buffer (on any device) as metadata; ``host`` is its host
    side (``buf``'s own memory on a CPU)."""
    o_slots, o_qsl, o_lens, o_tables = layout.offsets()
    # one call for the four views (each slice is a dispatcher call, slow once a model step
    # has left its code cold; with the cached layout and the mask below, a small step's
    # metadata took 0.75x the time right after a SmolLM2 step on the 2-core AMX Xeon, with a
    # tree mask, 0.91x without)
    whole = buf if buf.shape[0] == layout.size else buf[:layout.size]
    slots, qsl, lens, tables = whole.split_with_sizes(
        (o_qsl - o_slots, o_lens - o_qsl, o_tables - o_lens, layout.size - o_tables))
    return AttentionMetadata(
        layout=layout,
        host=host,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=tables.view(layout.num_seqs, layout.max_blocks),
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        tree_mask=tree_mask,
    )


@functools.lru_cache(maxsize=1024)
def _layout(num_tokens: int, num_seqs: int, max_blocks: int) -> MetadataLayout:
    """The layout of these sizes (one object per size: steps repeat a few sizes)."""
    return MetadataLayout(num_tokens, num_seqs, max_blocks)


# Steps whose packed array is at most this long are filled by plain Python (a decode or a
# drafting round: a few rows, a few blocks), where numpy's per-call cost would be most of it.
SMALL_STEP_SIZE = 256


def _fill_small(layout: MetadataLayout, query_start_loc: Sequence[int],
                seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                block_size: int) -> list[int]:
    """:func:`fill_packed`'s array as a list, for a step with no padding sequence (the
    layout is the step's own): the same checks and the same values (a test compares them)."""
    _check_query_start_loc(query_start_loc, len(seq_lens))
    slots: list[int] = []
    tables: list[int] = []
    width = layout.max_blocks
    for s, table in enumerate(block_tables):
        start, end, ctx = query_start_loc[s], query_start_loc[s + 1], seq_lens[s]
        _check_sequence(s, end - start, ctx, len(table), block_size)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx - (end - start), ctx)]
        tables += table
        tables += [0] * (width - len(table))
    return [*slots, *query_start_loc, *seq_lens, *tables]


def pack_step(query_start_loc: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              ) -> tuple[MetadataLayout, list[int]]:
    """An eager step's layout and packed array as a plain list (what :func:`build_metadata`
    copies into its buffer; a native caller that takes the packed values as they are, e.g.
    the draft head's ``HeadStack``, skips the tensors): the same checks and values."""
    layout = _layout(query_start_loc[-1], len(seq_lens),
                     max((len(t) for t in block_tables), default=0) or 1)
    if len(block_tables) != len(seq_lens):
        raise ValueError(f"{len(block_tables)} block tables for {len(seq_lens)} sequences")
    return layout, _fill_small(layout, query_start_loc, seq_lens, block_tables, block_size)


def build_metadata(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                   block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str | None = None,
                   tree_mask: Sequence[int] | None = None) -> AttentionMetadata:
    """An eager step's metadata, on ``device`` (default cpu), in one copy (two with a
    ``tree_mask``, one non-negative bit pattern per row: see the module docstring). Block
    tables are read, never edited."""
    layout = _layout(query_start_loc[-1], len(seq_lens),
                     max((len(t) for t in block_tables), default=0) or 1)
    if layout.size <= SMALL_STEP_SIZE and len(block_tables) == len(seq_lens):
        packed = np.array(_fill_small(layout, query_start_loc, seq_lens, block_tables,
                                      block_size), dtype=np.int32)
    else:
        packed = np.empty(layout.size, dtype=np.int32)
        fill_packed(packed, layout, query_start_loc, seq_lens, block_tables, block_size)
    on_device = device is not None and torch.device(device).type != "cpu"
    buf = torch.from_numpy(packed)
    if on_device:
        buf = buf.to(device, non_blocking=True)
    mask = None
    if tree_mask is not None and any(tree_mask):
        # signed int64: a row at index 63 has its top bit set (numpy reinterprets the bits;
        # ~25 us less than torch.tensor of the signed values, after a model step)
        mask = torch.from_numpy(np.array(tree_mask, dtype=np.uint64).view(np.int64))
        if on_device:
            mask = mask.to(device, non_blocking=True)
    max_query = max((b - a for a, b in itertools.pairwise(query_start_loc)), default=0)
    return unpack(buf, packed, layout, block_size, max_query, max(seq_lens, default=0),
                  tree_mask=mask)
