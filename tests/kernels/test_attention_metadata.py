"""The one attention-metadata type: slots by the rule, one buffer, padding as documented,
and refusal of a step that breaks the invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from quickdraft.kernels.attention_metadata import (
    SMALL_STEP_SIZE,
    MetadataLayout,
    build_metadata,
    fill_packed,
    pack_step,
    unpack,
)

QSL = [0, 3, 4, 9]  # a verification (3 rows), a decode, a prefill chunk of 5
SEQ_LENS = [10, 6, 5]
TABLES = [[7, 2, 9], [4, 1], [3, 0]]
BLOCK = 4


def _slots_by_hand() -> list[int]:
    """Position p of a sequence lives in table[p // BLOCK] * BLOCK + p % BLOCK."""
    out = []
    for s, table in enumerate(TABLES):
        q_len = QSL[s + 1] - QSL[s]
        for p in range(SEQ_LENS[s] - q_len, SEQ_LENS[s]):
            out.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    return out


def test_build_metadata_slots_tables_and_one_buffer():
    got = build_metadata(QSL, SEQ_LENS, TABLES, BLOCK)
    got.check_invariants()
    assert got.slot_mapping.tolist() == _slots_by_hand()
    assert got.query_start_loc.tolist() == QSL and got.seq_lens.tolist() == SEQ_LENS
    assert got.block_tables.tolist() == [[7, 2, 9], [4, 1, 0], [3, 0, 0]]
    assert got.max_query_len == 5 and got.max_seq_len == 10 and got.num_tokens == 9
    assert {t.dtype for t in (got.slot_mapping, got.query_start_loc, got.seq_lens,
                              got.block_tables)} == {torch.int32}
    # one buffer: every tensor is a view of the same storage (one host-to-device copy)
    storage = got.slot_mapping.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (
        got.query_start_loc, got.seq_lens, got.block_tables))
    # host side: the same step
    assert got.host_query_start_loc() == QSL and got.host_seq_lens() == SEQ_LENS
    assert torch.equal(got.host_block_tables(), got.block_tables)


def test_padding_sequence_and_empty_sequences():
    layout = MetadataLayout(num_tokens=16, num_seqs=6, max_blocks=4)
    packed = np.full(layout.size, 99, dtype=np.int32)
    fill_packed(packed, layout, QSL, SEQ_LENS, TABLES, BLOCK)
    meta = unpack(torch.from_numpy(packed), packed, layout, BLOCK, 5, 10)
    meta.check_invariants()
    slots = meta.slot_mapping.tolist()
    assert slots[:9] == _slots_by_hand() and slots[9:] == [-1] * 7  # no KV writes
    # the padding sequence owns rows 9..15 with a one-position context; then empty sequences
    assert meta.query_start_loc.tolist() == [0, 3, 4, 9, 16, 16, 16]
    assert meta.seq_lens.tolist() == [10, 6, 5, 1, 0, 0]
    assert meta.block_tables.tolist() == [[7, 2, 9, 0], [4, 1, 0, 0], [3, 0, 0, 0],
                                          [0] * 4, [0] * 4, [0] * 4]


def test_exact_fit_needs_no_padding_sequence():
    layout = MetadataLayout(num_tokens=9, num_seqs=3, max_blocks=3)
    packed = np.empty(layout.size, dtype=np.int32)
    fill_packed(packed, layout, QSL, SEQ_LENS, TABLES, BLOCK)
    assert unpack(torch.from_numpy(packed), packed, layout, BLOCK, 5, 10).seq_lens.tolist() \
        == SEQ_LENS


@pytest.mark.parametrize("layout", [
    MetadataLayout(num_tokens=8, num_seqs=8, max_blocks=4),  # too many tokens
    MetadataLayout(num_tokens=16, num_seqs=3, max_blocks=4),  # no room for the padding seq
    MetadataLayout(num_tokens=16, num_seqs=8, max_blocks=2),  # a block table too long
])
def test_a_step_that_does_not_fit_is_refused(layout):
    with pytest.raises(ValueError):
        fill_packed(np.empty(layout.size, dtype=np.int32), layout, QSL, SEQ_LENS, TABLES, BLOCK)


@pytest.mark.parametrize("qsl,lens,tables", [
    ([1, 3], [5], [[0, 1]]),  # query_start_loc does not start at 0
    ([0, 3], [2], [[0]]),  # more new tokens than context
    ([0, 1], [9], [[0, 1]]),  # context beyond the block table
    ([0, 1, 2], [1], [[0]]),  # query_start_loc of the wrong length
])
def test_a_step_breaking_the_invariants_is_refused(qsl, lens, tables):
    with pytest.raises(ValueError):
        build_metadata(qsl, lens, tables, BLOCK)
    with pytest.raises(ValueError):
        pack_step(qsl, lens, tables, BLOCK)


def test_invariant_check_catches_a_wrong_slot():
    meta = build_metadata(QSL, SEQ_LENS, TABLES, BLOCK)
    meta.host[0] += 1  # on a CPU the host array is the tensors' memory
    with pytest.raises(AssertionError):
        meta.check_invariants()


def test_small_steps_pack_as_fill_packed_does():
    """build_metadata fills steps of at most SMALL_STEP_SIZE ints in plain Python: the same
    array as fill_packed's on random steps (decodes, trees, chunks, several block sizes)."""
    rng = random.Random(3)
    small = 0
    for _ in range(500):
        block = rng.choice([1, 4, 16])
        qsl, lens, tables = [0], [], []
        for _ in range(rng.randint(1, 6)):
            q_len = rng.randint(0, 6)
            ctx = q_len + rng.randint(0, 40)
            tables.append(rng.sample(range(500), -(-ctx // block) + rng.randint(0, 2)))
            lens.append(ctx)
            qsl.append(qsl[-1] + q_len)
        layout = MetadataLayout(qsl[-1], len(lens), max(len(t) for t in tables) or 1)
        want = np.empty(layout.size, dtype=np.int32)
        fill_packed(want, layout, qsl, lens, tables, block)
        small += layout.size <= SMALL_STEP_SIZE
        assert np.array_equal(build_metadata(qsl, lens, tables, block).host, want)
        packed_layout, packed = pack_step(qsl, lens, tables, block)  # any size, as a list
        assert packed_layout == layout and packed == want.tolist()
    assert small > 100
