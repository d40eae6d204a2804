"""The packed metadata of the Triton path equals the reference metadata, and pads as documented."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import paged_attention_ref as ref
from kernels.step_metadata import MetadataLayout, build_metadata, fill_packed, unpack

QSL = [0, 3, 4, 9]  # a verification (3 rows), a decode, a prefill chunk of 5
SEQ_LENS = [10, 6, 5]
TABLES = [[7, 2, 9], [4, 1], [3, 0]]
BLOCK = 4


def test_build_metadata_matches_the_reference():
    got = build_metadata(QSL, SEQ_LENS, TABLES, BLOCK)
    want = ref.build_metadata(QSL, SEQ_LENS, TABLES, BLOCK)
    assert got.slot_mapping.tolist() == want.slot_mapping.tolist()
    assert got.query_start_loc_t.tolist() == QSL and got.seq_lens_t.tolist() == SEQ_LENS
    assert torch.equal(got.block_tables, want.block_tables)
    assert got.max_query_len == 5 and got.max_seq_len == 10 and got.num_tokens == 9
    assert got.slot_mapping.dtype == torch.int32
    # one buffer: every tensor is a view of the same storage (one host-to-device copy)
    storage = got.slot_mapping.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (
        got.query_start_loc_t, got.seq_lens_t, got.block_tables))


def test_padding_sequence_and_empty_sequences():
    layout = MetadataLayout(num_tokens=16, num_seqs=6, max_blocks=4)
    packed = np.full(layout.size, 99, dtype=np.int32)
    fill_packed(packed, layout, QSL, SEQ_LENS, TABLES, BLOCK)
    meta = unpack(torch.from_numpy(packed), layout, BLOCK, 5, 10)
    want = ref.build_metadata(QSL, SEQ_LENS, TABLES, BLOCK)
    slots = meta.slot_mapping.tolist()
    assert slots[:9] == want.slot_mapping.tolist() and slots[9:] == [-1] * 7  # no KV writes
    # the padding sequence owns rows 9..15 with a one-position context; then empty sequences
    assert meta.query_start_loc_t.tolist() == [0, 3, 4, 9, 16, 16, 16]
    assert meta.seq_lens_t.tolist() == [10, 6, 5, 1, 0, 0]
    assert meta.block_tables.tolist() == [[7, 2, 9, 0], [4, 1, 0, 0], [3, 0, 0, 0],
                                          [0] * 4, [0] * 4, [0] * 4]


def test_exact_fit_needs_no_padding_sequence():
    layout = MetadataLayout(num_tokens=9, num_seqs=3, max_blocks=3)
    packed = np.empty(layout.size, dtype=np.int32)
    fill_packed(packed, layout, QSL, SEQ_LENS, TABLES, BLOCK)
    assert unpack(torch.from_numpy(packed), layout, BLOCK, 5, 10).seq_lens_t.tolist() == SEQ_LENS


@pytest.mark.parametrize("layout", [
    MetadataLayout(num_tokens=8, num_seqs=8, max_blocks=4),  # too many tokens
    MetadataLayout(num_tokens=16, num_seqs=3, max_blocks=4),  # no room for the padding seq
    MetadataLayout(num_tokens=16, num_seqs=8, max_blocks=2),  # a block table too long
])
def test_a_step_that_does_not_fit_is_refused(layout):
    with pytest.raises(ValueError):
        fill_packed(np.empty(layout.size, dtype=np.int32), layout, QSL, SEQ_LENS, TABLES, BLOCK)
