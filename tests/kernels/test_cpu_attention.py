"""kernels.cpu_attention: attention over a paged bf16 KV cache (one C call per batch)
against the oracle of ``tests/kernels/attention_oracle.py`` (fp32 from the same bf16
inputs), with the KV written by the torch backend's ``write_kv`` on some cases."""

from __future__ import annotations

import functools
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
    context_lens,
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
def test_available() -> None:
    assert cpu_attention.available()


@needs_kernel
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_matches_reference(num_seqs: int, block_size: int, heads: int, kv_heads: int,
                           dim: int) -> None:
    lens = context_lens(num_seqs, block_size)
    if num_seqs == 1:
        lens = [517]  # > 500, not a multiple of any block size
    q, kv, bt, sl, _ = paged_case(num_seqs, lens, block_size, heads, kv_heads, dim,
                                  seed=num_seqs * 1000 + block_size * 10 + dim + heads)
    scale = 1 / math.sqrt(dim)
    got = cpu_attention.decode_attention(q, kv, bt, sl, scale)
    want = oracle.decode_attention(q, kv, bt, sl, scale)
    assert got.dtype == BF16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 31, 32, 33, 40, 513])
def test_lengths_around_chunk_and_block_edges(seq_len: int) -> None:
    q, kv, bt, sl, _ = paged_case(2, [seq_len, 5], 16, 8, 2, 64, seed=seq_len)
    got = cpu_attention.decode_attention(q, kv, bt, sl, 0.125)
    torch.testing.assert_close(got.float(),
                               oracle.decode_attention(q, kv, bt, sl, 0.125).float(),
                               **TOL)


@needs_kernel
def test_peaked_scores_and_threads() -> None:
    """Large scores (softmax near one-hot, max found late) and the OpenMP path."""
    q, kv, bt, sl, _ = paged_case(8, [300, 1, 900, 257, 64, 33, 600, 2], 16, 9, 3, 64, seed=7)
    for scale in (0.125, 2.0):
        want = oracle.decode_attention(q, kv, bt, sl, scale).float()
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = cpu_attention.decode_attention(q, kv, bt, sl, scale)
            finally:
                torch.set_num_threads(old)
            torch.testing.assert_close(got.float(), want, **TOL)


@needs_kernel
def test_agrees_with_naive_attention() -> None:
    """The engine's reference (decode: one new token per sequence, K/V written by write_kv)."""
    block_size, heads, kv_heads, dim = 16, 9, 3, 64
    lens = [1, 16, 517]
    q, kv, _, sl, tables = paged_case(3, lens, block_size, heads, kv_heads, dim, seed=11)
    meta = build_metadata(list(range(4)), lens, tables, block_size)
    g = torch.Generator().manual_seed(12)
    new_k = torch.randn(3, kv_heads, dim, generator=g).to(BF16)
    new_v = torch.randn(3, kv_heads, dim, generator=g).to(BF16)
    torch_attention.write_kv(new_k, new_v, kv, meta.slot_mapping)
    scale = dim ** -0.5
    want = oracle.naive_attention(q, kv, meta, scale)
    got = cpu_attention.decode_attention(q, kv, meta.block_tables, sl, scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@pytest.mark.parametrize("variant", ["float32", "strided_query", "int64_tables", "dim_12"])
def test_declined_inputs_run_the_torch_path(variant: str) -> None:
    """Inputs the kernel does not take: the kernel returns None, and the torch backend's
    paged_attention (which tries the kernel first) gives the oracle's result."""
    dim = 12 if variant == "dim_12" else 64
    lens = [4, 20, 9]
    q, kv, bt, sl, tables = paged_case(3, lens, 4, 4, 2, dim, seed=5)
    if variant == "float32":
        q, kv = q.float(), kv.float()
    elif variant == "strided_query":
        q = torch.cat([q, q], dim=-1)[..., :dim]
        assert not q.is_contiguous()
    elif variant == "int64_tables":
        bt, sl = bt.long(), sl.long()
    assert cpu_attention.decode_attention(q, kv, bt, sl, 0.2) is None
    meta = build_metadata(list(range(4)), lens, tables, 4)
    got = torch_attention.paged_attention(q, kv, meta, 0.2)
    want = oracle.decode_attention(q, kv, bt, sl, 0.2)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
def test_bad_block_id_is_declined() -> None:
    """The C side rejects out-of-range block ids: nothing computed."""
    q, kv, bt, sl, _ = paged_case(2, [20, 3], 16, 4, 4, 64, seed=9)
    bt[0, 1] = kv.shape[1] + 5
    assert cpu_attention.decode_attention(q, kv, bt, sl, 0.125) is None


@needs_kernel
def test_all_groupings_small() -> None:
    """Every (heads, kv_heads) grouping up to 8 heads at a short context."""
    for heads, kv_heads in itertools.product(range(1, 9), range(1, 9)):
        if heads % kv_heads:
            continue
        q, kv, bt, sl, _ = paged_case(2, [7, 12], 5, heads, kv_heads, 64,
                                      seed=heads * 10 + kv_heads)
        torch.testing.assert_close(
            cpu_attention.decode_attention(q, kv, bt, sl, 0.125).float(),
            oracle.decode_attention(q, kv, bt, sl, 0.125).float(), **TOL)


# ------------------------------------------------------------------------------------------
# Ragged queries (k+1 verification tokens, short prefill chunks): causal within the new tokens


@needs_kernel
def test_lane_switch_and_choice(monkeypatch: pytest.MonkeyPatch,
                                request: pytest.FixtureRequest) -> None:
    current = request.node.callspec.params["attention_lane"]
    assert cpu_attention.lane() == current
    runs = cpu_attention.runnable_lanes()  # asking each lane of the kernel keeps this one
    assert cpu_attention.lane() == current and runs[0] == "fp32" and current in runs
    assert ("dot" in runs) == cpu_attention.dot_supported()
    with pytest.raises(ValueError, match="lane must be one of"):
        cpu_attention.set_lane("fp16")
    assert cpu_attention.lane() == current  # a refused switch changes nothing
    monkeypatch.setenv("QUICKDRAFT_ATTENTION", "fp32")
    assert cpu_attention._default_lane() == "fp32"
    monkeypatch.setenv("QUICKDRAFT_ATTENTION", "nonsense")
    best = cpu_attention._best_lane()  # the fastest lane this CPU's flags allow
    assert best in runnable_lanes() or best == "amx"  # (Linux may refuse AMX's tiles)
    assert cpu_attention._default_lane() == best  # ignored, with a warning
    for name in cpu_attention.LANES:  # a lane the CPU lacks: the best it has
        monkeypatch.setenv("QUICKDRAFT_ATTENTION", name)
        lacks = cpu_attention.LANES.index(name) > cpu_attention.LANES.index(best)
        assert cpu_attention._default_lane() == (best if lacks else name)
        if name not in runnable_lanes():
            with pytest.raises(RuntimeError, match="cannot run"):
                cpu_attention.set_lane(name)
            assert cpu_attention.lane() == current  # refused: the lane stays


def _decode_per_lane(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """decode_attention's result in each lane this CPU runs."""
    results = {}
    for name in runnable_lanes():
        before = cpu_attention.set_lane(name)
        try:
            got = cpu_attention.decode_attention(q, kv, tables, lens, scale)
        finally:
            cpu_attention.set_lane(before)
        assert got is not None
        results[name] = got
    return results


@needs_kernel
@pytest.mark.skipif(len(runnable_lanes()) < 2, reason="needs AVX512-BF16")
@pytest.mark.parametrize("dim,runs_own", [(64, True), (128, True), (48, False)])
def test_lanes_run_where_head_dim_allows(dim: int, runs_own: bool) -> None:
    """The dot and AMX lanes take head_dim % 32 == 0 (else the fp32 lane's bits, exactly);
    where they run, each result differs from the fp32 lane's in the last bits only."""
    q, kv, tables, lens, _ = paged_case(2, [300, 77], 16, 9, 3, dim, seed=5)
    results = _decode_per_lane(q, kv, tables, lens, dim ** -0.5)
    fp32 = results.pop("fp32")
    for name, got in results.items():  # (the dot and AMX lanes round P to bf16 alike: they
        # differ only where an fp32 sum's last bit moves a bf16 rounding, rarely)
        assert torch.equal(fp32, got) is not runs_own, name
        torch.testing.assert_close(got.float(), fp32.float(), atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("heads", [16, 17])
def test_sixteen_and_more_heads_a_kv_head(heads: int) -> None:
    """A tile multiply of the AMX lane takes 16 query heads: 16 a kv head fill one, more run
    the dot lane's code; in every lane the rows of a verification match the oracle."""
    q, kv, bt, sl, qsl, _ = ragged_case([3, 1], [300, 45], 16, heads, 1, 64, seed=heads)
    got = cpu_attention.ragged_attention(q, kv, bt, sl, qsl, 0.125)
    want = oracle.ragged_attention(q, kv, bt, sl, qsl, 0.125)
    assert got is not None
    torch.testing.assert_close(got.float(), want.float(), **TOL)


@needs_kernel
def test_loaded_lane_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_attention.available()
    assert cpu_attention.loaded_lane() == cpu_attention.lane()  # loaded: the lane
    not_loaded = functools._CacheInfo(hits=0, misses=0, maxsize=1, currsize=0)  # type: ignore[attr-defined]
    monkeypatch.setattr(cpu_attention._lib, "cache_info", lambda: not_loaded)
    assert cpu_attention.loaded_lane() is None  # not loaded: None, nothing built


@needs_kernel
@pytest.mark.parametrize("ctx", [2000, 40000])
def test_verification_rows_keep_their_bits_split_or_not(ctx: int) -> None:
    """8 rows of one sequence on 2 threads: after 2,000 positions the kernel cuts the sequence
    by positions, after 40,000 its segment states would pass QD_SPLIT_FLOATS and it does not;
    either way each row has the bits of that row decoded alone on 1 thread."""
    q, kv, bt, sl, qsl, _ = ragged_case([8], [ctx], 16, 8, 1, 128, seed=ctx)
    ragged = with_threads(2, cpu_attention.ragged_attention, q, kv, bt, sl, qsl, 0.09)
    assert ragged is not None
    for i in (0, 7):
        one_sl = torch.tensor([ctx - 8 + 1 + i], dtype=torch.int32)
        dec = with_threads(1, cpu_attention.decode_attention, q[i:i + 1].clone(), kv, bt,
                           one_sl, 0.09)
        assert dec is not None and torch.equal(ragged[i], dec[0]), i
