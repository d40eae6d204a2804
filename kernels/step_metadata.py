"""Per-step attention metadata for the Triton kernels, built on the host and sent in one copy.

The Triton kernels need four int32 tensors on the device: ``slot_mapping [num_tokens]``,
``query_start_loc [num_seqs + 1]``, ``seq_lens [num_seqs]`` and ``block_tables [num_seqs,
max_blocks]``. They are packed into one int32 array (in that order) so a step costs one
host-to-device copy, and the device tensors are views into one buffer.

A :class:`MetadataLayout` fixes the sizes. For an eager step they are the step's own; for a
CUDA graph they are the graph's bucket (``num_tokens`` and ``num_seqs`` padded up): the
extra tokens belong to one *padding sequence* right after the real ones (its K/V writes are
skipped through slot -1; its context is one position, in block 0, so all but its first
query row see no key at all and give 0; its outputs are thrown away), and the sequences
after it are empty (their programs exit at once). The kernel grid depends only on the
layout, so a captured graph replays any step that fits its bucket.

No triton import here: the engine builds metadata whether or not the kernels are compiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
class DeviceAttentionMetadata:
    """What the Triton attention and KV-write kernels read; tensors are views of one buffer."""

    slot_mapping: torch.Tensor  # [num_tokens] int32, -1 = do not write
    query_start_loc_t: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_t: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    block_size: int
    max_query_len: int  # an upper bound of the longest query (picks the query tile)
    max_seq_len: int  # an upper bound of the longest context (picks split-KV)
    num_splits: int | None = None  # None: choose per call from the shapes

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def fill_packed(out: np.ndarray, layout: MetadataLayout, query_start_loc: Sequence[int],
                seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                block_size: int) -> None:
    """Write one step into ``out`` (int32, ``layout.size``), padding as the module says."""
    num_seqs, num_tokens = len(seq_lens), query_start_loc[-1]
    needed_seqs = num_seqs + (num_tokens < layout.num_tokens)  # + the padding sequence
    if num_tokens > layout.num_tokens or needed_seqs > layout.num_seqs:
        raise ValueError(f"{num_tokens} tokens / {num_seqs} sequences do not fit {layout}")
    o_slots, o_qsl, o_lens, o_tables = layout.offsets()
    slots = out[o_slots:o_qsl]
    qsl = out[o_qsl:o_lens]
    lens = out[o_lens:o_tables]
    tables = out[o_tables:].reshape(layout.num_seqs, layout.max_blocks)
    tables[:] = 0
    for s, table in enumerate(block_tables):
        if len(table) > layout.max_blocks:
            raise ValueError(f"block table of {len(table)} blocks > {layout.max_blocks}")
        row = np.asarray(table, dtype=np.int32)
        tables[s, : len(row)] = row
        start, end, ctx = query_start_loc[s], query_start_loc[s + 1], seq_lens[s]
        positions = np.arange(ctx - (end - start), ctx)
        slots[start:end] = row[positions // block_size] * block_size + positions % block_size
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


def unpack(buf: torch.Tensor, layout: MetadataLayout, block_size: int, max_query_len: int,
           max_seq_len: int, num_splits: int | None = None) -> DeviceAttentionMetadata:
    """Views of a packed int32 buffer (on any device) as metadata."""
    o_slots, o_qsl, o_lens, o_tables = layout.offsets()
    return DeviceAttentionMetadata(
        slot_mapping=buf[o_slots:o_qsl],
        query_start_loc_t=buf[o_qsl:o_lens],
        seq_lens_t=buf[o_lens:o_tables],
        block_tables=buf[o_tables:layout.size].view(layout.num_seqs, layout.max_blocks),
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
    )


def build_metadata(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                   block_tables: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str | None = None) -> DeviceAttentionMetadata:
    """An eager step's metadata, on ``device`` (default cpu), in one copy."""
    layout = MetadataLayout(query_start_loc[-1], len(seq_lens),
                            max((len(t) for t in block_tables), default=0) or 1)
    packed = np.empty(layout.size, dtype=np.int32)
    fill_packed(packed, layout, query_start_loc, seq_lens, block_tables, block_size)
    buf = torch.from_numpy(packed)
    if device is not None and torch.device(device).type != "cpu":
        buf = buf.to(device, non_blocking=True)
    q_lens = np.diff(np.asarray(query_start_loc))
    return unpack(buf, layout, block_size, int(q_lens.max(initial=0)),
                  int(max(seq_lens, default=0)))
