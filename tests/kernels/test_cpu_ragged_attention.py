"""kernels.cpu_attention over ragged query rows (prefill, verification and decode rows in one
call) against the oracle of ``tests/kernels/attention_oracle.py``: row by row equal to
sequential decoding, the same bits on one thread or two, inputs it declines, and the one-call
KV write + attention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from quickdraft.kernels import cpu_attention, torch_attention
from quickdraft.kernels.attention_metadata import build_metadata
from tests.kernels import attention_oracle as oracle
from tests.kernels.attention_cases import (
    BF16,
    TOL,
    needs_kernel,
    paged_case,
    ragged_case,
    with_threads,
)
from tests.kernels.attention_lanes import (
    attention_lane,  # noqa: F401 (autouse: every lane)
    runnable_lanes,
)


@needs_kernel
@pytest.mark.parametrize("q_lens,ctx_extra", [
    ([1, 5, 3, 1], [0, 0, 40, 700]),   # fresh prefill of 1 and 5, then longer contexts
    ([1, 5, 3, 1], [300, 517, 0, 31]),
    ([17], [0]),
    ([17], [600]),
    ([2, 2], [0, 95]),
])
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_ragged_matches_reference(q_lens: list[int], ctx_extra: list[int], block_size: int,
                                  heads: int, kv_heads: int, dim: int) -> None:
    lens = [q + c for q, c in zip(q_lens, ctx_extra, strict=True)]
    q, kv, bt, sl, qsl, _ = ragged_case(q_lens, lens, block_size, heads, kv_heads, dim,
                                        seed=sum(lens) + block_size * 7 + heads + dim)
    scale = 1 / math.sqrt(dim)
    got = cpu_attention.ragged_attention(q, kv, bt, sl, qsl, scale)
    want = oracle.ragged_attention(q, kv, bt, sl, qsl, scale)
    assert got.dtype == BF16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
def test_ragged_agrees_with_naive_attention_and_empty_sequences() -> None:
    """The engine's reference over a mixed step; a sequence with no new tokens is skipped."""
    block_size, heads, kv_heads, dim = 16, 8, 2, 64
    q_lens, lens = [3, 0, 1, 6], [3, 20, 517, 40]
    q, kv, bt, sl, qsl, tables = ragged_case(q_lens, lens, block_size, heads, kv_heads, dim,
                                             seed=21)
    meta = build_metadata(qsl.tolist(), lens, tables, block_size)
    scale = dim ** -0.5
    want = oracle.naive_attention(q, kv, meta, scale)
    got = cpu_attention.ragged_attention(q, kv, bt, sl, qsl, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL)
    torch.testing.assert_close(
        oracle.ragged_attention(q, kv, bt, sl, qsl, scale).float(), want.float(),
        **TOL)


@needs_kernel
@pytest.mark.parametrize("ctx", [5, 33, 300, 517])
@pytest.mark.parametrize("others", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (9, 3, 64, 16), (8, 1, 128, 5), (4, 4, 64, 1), (6, 2, 96, 7),
    (12, 2, 128, 16), (16, 1, 64, 16), (17, 1, 64, 16)])  # AMX: 2, 1 rows a tile, none
def test_verify_is_bit_identical_to_sequential_decode(ctx: int, others: bool, heads: int,
                                                      kv_heads: int, dim: int,
                                                      block_size: int) -> None:
    """The speculative-decoding property: attending 5 new tokens in one ragged call gives
    exactly the bits of 5 decode calls at contexts ctx-4 .. ctx (same cache, same query rows),
    whatever else is in the batch and with 1 or 2 threads."""
    q_len = 5
    if others:  # the verified sequence sits between a long decode and a prefill chunk
        q_lens, lens, target = [1, q_len, 3], [700, ctx, 3], 1
    else:
        q_lens, lens, target = [q_len], [ctx], 0
    q, kv, bt, sl, qsl, _ = ragged_case(q_lens, lens, block_size, heads, kv_heads, dim,
                                        seed=ctx + heads + 100 * others)
    start = int(qsl[target])
    scale = dim ** -0.5
    for scale_mul in (1.0, 16.0):  # 16: peaked softmax, the running max moves late
        s = scale * scale_mul
        for threads in (1, 2):
            ragged = with_threads(threads, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, s)
            for i in range(q_len):
                row = q[start + i:start + i + 1].clone()
                one_bt = bt[target:target + 1].clone()
                one_sl = torch.tensor([ctx - q_len + 1 + i], dtype=torch.int32)
                for dec_threads in (1, 2):
                    dec = with_threads(dec_threads, cpu_attention.decode_attention, row, kv,
                                       one_bt, one_sl, s)
                    assert torch.equal(ragged[start + i], dec[0]), (threads, dec_threads, i)
            # and a batched decode of the 5 rows (one "sequence" per token) matches too
            rows = q[start:start + q_len].clone()
            many_bt = bt[target:target + 1].repeat(q_len, 1).contiguous()
            many_sl = torch.arange(ctx - q_len + 1, ctx + 1, dtype=torch.int32)
            dec = with_threads(threads, cpu_attention.decode_attention, rows, kv, many_bt,
                               many_sl, s)
            assert torch.equal(ragged[start:start + q_len], dec)


@needs_kernel
@pytest.mark.parametrize("decodes", [0, 4])
def test_long_query_chunk_is_computed_row_by_row(decodes: int) -> None:
    """A 40-row chunk (a prefill chunk, or a sequence among 4 others so that the kernel's
    tasks take all kv heads and cut its rows into several groups) gives each row exactly the
    bits of that row decoded alone, with 1 or 2 threads."""
    q_lens, lens = [40] + [1] * decodes, [300] + [90] * decodes
    q, kv, bt, sl, qsl, _ = ragged_case(q_lens, lens, 16, 9, 3, 64, seed=11 + decodes)
    for threads in (1, 2):
        ragged = with_threads(threads, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.125)
        for i in range(40):
            one_sl = torch.tensor([300 - 40 + 1 + i], dtype=torch.int32)
            dec = cpu_attention.decode_attention(q[i:i + 1].clone(), kv, bt[:1].clone(), one_sl,
                                                 0.125)
            assert dec is not None and torch.equal(ragged[i], dec[0]), (threads, i)


@needs_kernel
def test_ragged_threads_do_not_change_bits() -> None:
    q, kv, bt, sl, qsl, _ = ragged_case([1, 5, 3, 1, 16], [300, 517, 40, 900, 600], 16, 9, 3,
                                        64, seed=4)
    one = with_threads(1, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.125)
    two = with_threads(2, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.125)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("lane", cpu_attention.LANES)
@pytest.mark.parametrize("ctx", [100, 300, 1024])
def test_one_decode_row_on_two_threads_keeps_its_bits(ctx: int, lane: str) -> None:
    """A lone decode row of a 3-kv-head model (3 lanes: since 2026-11-27 enough to be
    offered threads, `_PARALLEL_LANES`) gives the same bits on 1 and 2 threads, in each
    attention lane this CPU has: after 100 positions (threaded since the kernel's
    QD_PAR_CTX became 64; one-head tasks), 300 and 1,024 (cut by positions)."""
    if lane not in runnable_lanes():
        pytest.skip(f"this CPU cannot run the {lane} lane")
    q, kv, bt, sl, qsl, _ = ragged_case([1], [ctx], 16, 9, 3, 64, seed=6)
    assert cpu_attention._PARALLEL_LANES <= 3
    before = cpu_attention.set_lane(lane)
    try:
        one = with_threads(1, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.125)
        two = with_threads(2, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.125)
    finally:
        cpu_attention.set_lane(before)
    assert one is not None and torch.equal(one, two)


@pytest.mark.parametrize("variant", ["float32", "strided_query", "int64_qsl", "dim_12",
                                     "dim_264", "strided_qsl"])
def test_ragged_declines_inputs_it_does_not_take(variant: str) -> None:
    """Inputs the kernel does not take: None, nothing computed (the torch backend's
    fallback is tested above and in test_torch_attention)."""
    dim = {"dim_12": 12, "dim_264": 264}.get(variant, 64)
    q, kv, bt, sl, qsl, _ = ragged_case([2, 1, 4], [4, 20, 9], 4, 4, 2, dim, seed=5)
    if variant == "float32":
        q, kv = q.float(), kv.float()
    elif variant == "strided_query":
        q = torch.cat([q, q], dim=-1)[..., :dim]
        assert not q.is_contiguous()
    elif variant == "int64_qsl":
        qsl = qsl.long()
    elif variant == "strided_qsl":
        qsl = torch.stack([qsl, qsl], dim=1)[:, 0]
        assert not qsl.is_contiguous()
    assert cpu_attention.ragged_attention(q, kv, bt, sl, qsl, 0.2) is None


@needs_kernel
@pytest.mark.parametrize("bad", ["q_len_over_ctx", "qsl_not_ending_at_tokens",
                                 "qsl_decreasing", "qsl_not_starting_at_0"])
def test_ragged_bad_layout_is_rejected_by_the_kernel(bad: str) -> None:
    """The C side rejects an inconsistent query layout: the call returns None (the torch
    backend then runs its torch path)."""
    q, kv, bt, sl, qsl, _ = ragged_case([2, 3], [10, 20], 4, 4, 2, 64, seed=8)
    if bad == "q_len_over_ctx":
        sl[0] = 1
    elif bad == "qsl_not_ending_at_tokens":
        qsl[-1] = 4
    elif bad == "qsl_decreasing":
        qsl[1] = 6
        qsl[2] = 5
    else:
        qsl[0] = 1
    assert cpu_attention.ragged_attention(q, kv, bt, sl, qsl, 0.1) is None
    # the well-formed layout takes the kernel
    _, _, _, sl2, qsl2, _ = ragged_case([2, 3], [10, 20], 4, 4, 2, 64, seed=8)
    assert cpu_attention.ragged_attention(q, kv, bt, sl2, qsl2, 0.1) is not None


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv_and_attend_equals_write_then_attend(block_size: int) -> None:
    """The one-call KV write + attention over a qkv matrix (prefill, verification and decode
    rows mixed) is bit-equal to write_kv then ragged_attention; a row with slot -1 writes
    nothing (the cache's K/V there are attended to); a bad slot or query layout declines the
    call with the cache untouched."""
    heads, kv_heads, dim = 9, 3, 64
    seq_lens = [40, 70, 9]
    q_lens = [40, 5, 1]  # a fresh prefill, a verification of 4 drafts, a decode
    _, kv, block_tables, lens, tables = paged_case(3, seq_lens, block_size, heads, kv_heads, dim,
                                                   seed=7)
    qsl = [0, *itertools.accumulate(q_lens)]
    tokens = qsl[-1]
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(BF16)
    slots = torch.tensor([tables[s][p // block_size] * block_size
                          + p % block_size for s in range(3)
                          for p in range(seq_lens[s] - q_lens[s], seq_lens[s])],
                         dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)

    def reference(written: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache after write_kv of the ``written`` rows, and ragged_attention over it."""
        ref = kv.clone()
        torch_attention.write_kv(k[written].reshape(-1, kv_heads, dim),
                                 v[written].reshape(-1, kv_heads, dim), ref, slots[written])
        return ref, cpu_attention.ragged_attention(q.reshape(-1, heads, dim).contiguous(), ref,
                                                   block_tables, lens, qsl_t, 0.125)

    def one_call(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = kv.clone()
        return cache, cpu_attention.write_kv_and_attend(qkv, heads, kv_heads, cache,
                                                        slot_mapping, block_tables, lens,
                                                        qsl_t, 0.125)

    kv_ref, want = reference(torch.ones(tokens, dtype=torch.bool))
    kv_got, got = one_call(slots)
    assert got is not None
    assert torch.equal(kv_got, kv_ref)
    assert torch.equal(got, want)
    bad = slots.clone()
    bad[-1] = kv.shape[1] * block_size  # one past the end
    untouched = kv.clone()
    assert cpu_attention.write_kv_and_attend(qkv, heads, kv_heads, untouched, bad,
                                             block_tables, lens, qsl_t, 0.125) is None
    assert torch.equal(untouched, kv)
    bad_qsl = qsl_t.clone()
    bad_qsl[-1] -= 1  # does not end at num_tokens
    assert cpu_attention.write_kv_and_attend(qkv, heads, kv_heads, untouched, slots,
                                             block_tables, lens, bad_qsl, 0.125) is None
    assert torch.equal(untouched, kv)
    bad[-1] = -2  # -1 is the only negative slot
    assert cpu_attention.write_kv_and_attend(qkv, heads, kv_heads, untouched, bad,
                                             block_tables, lens, qsl_t, 0.125) is None
    assert torch.equal(untouched, kv)
    # slot -1: that row's K/V are not written (the cache's stay and are attended to)
    skipped = [0, 3, 41, 43, tokens - 1]  # rows of the prefill, the verification, the decode
    skip = slots.clone()
    skip[skipped] = -1
    kv_ref, want = reference(skip >= 0)
    kv_got, got = one_call(skip)
    assert got is not None
    assert torch.equal(kv_got, kv_ref) and torch.equal(got, want)
    at = slots[skipped].long()
    cached = kv_got.flatten(1, 2)[:, at]  # [2, rows, kv_heads, dim]: the old K/V there
    assert torch.equal(cached, kv.flatten(1, 2)[:, at])
    assert not torch.equal(cached, torch.stack([k[skipped], v[skipped]]).view_as(cached))
