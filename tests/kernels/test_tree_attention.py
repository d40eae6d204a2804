"""Tree-verification masks (``AttentionMetadata.tree_mask``) in the CPU C kernel and the
torch attention path: random trees in mixed steps (a prefill chunk, decodes, a causal
verification chain, tree sequences up to 64 rows), GQA, shuffled block tables, against the
oracle of ``tests/kernels/attention_oracle.py``; the C kernel's lossless-speculation property
(a tree row's bits equal those of a causal row over a cache holding its root-to-leaf path at
contiguous positions); malformed masks declined; no mask and all-zero masks unchanged."""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
from dataclasses import dataclass

import pytest
import torch

from quickdraft.kernels import cpu_attention, torch_attention
from quickdraft.kernels.attention_metadata import AttentionMetadata, build_metadata, slots_of
from tests.kernels import attention_oracle as oracle
from tests.kernels.attention_lanes import attention_lane  # noqa: F401 (autouse: every lane)

needs_kernel = pytest.mark.skipif(
    shutil.which("gcc") is None or not cpu_attention._cpu_supported(),
    reason="needs gcc and an AVX2/FMA CPU")

BF16 = torch.bfloat16
TOL = {torch.float32: 1e-5, BF16: 2e-2}  # atol and rtol against the oracle's fp32 result


def assert_near(got: torch.Tensor | None, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got is not None
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def random_tree(n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(parents, masks)`` of an n-node tree in flat order (parents[i] < i, root -1; half
    the nodes extend the previous one, so deep paths occur), masks unsigned."""
    parents, masks = [-1], [1]
    for i in range(1, n):
        parent = i - 1 if rng.random() < 0.5 else rng.randrange(i)
        parents.append(parent)
        masks.append(masks[parent] | 1 << i)
    return parents, masks


def root_path(parents: list[int], leaf: int) -> list[int]:
    """The rows from the root down to ``leaf``, increasing."""
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@dataclass
class Seq:
    q_len: int
    base: int  # context before the new tokens
    tree: tuple[list[int], list[int]] | None = None  # (parents, masks); None: causal rows


def tree_seq(n: int, base: int, seed: int) -> Seq:
    return Seq(n, base, random_tree(n, random.Random(seed)))


# a prefill chunk, two decodes, a causal verification chain of 5, and trees of 8 and 64 rows
MIXED = [Seq(20, 30), Seq(1, 37), tree_seq(8, 40, 1), Seq(5, 70), Seq(1, 5),
         tree_seq(64, 100, 2)]


@dataclass
class Step:
    query: torch.Tensor  # [num_tokens, heads, dim]
    kv: torch.Tensor  # [2, num_blocks, block_size, kv_heads, dim]
    meta: AttentionMetadata
    seqs: list[Seq]

    def start(self, s: int) -> int:
        return self.meta.host_query_start_loc()[s]

    def c_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
        m = self.meta
        return self.query, self.kv, m.block_tables, m.seq_lens, m.query_start_loc


def make_step(seqs: list[Seq], block_size: int, heads: int = 8, kv_heads: int = 2,
              dim: int = 64, dtype: torch.dtype = BF16, seed: int = 0) -> Step:
    """Random q and cache; each sequence owns shuffled (non-contiguous) blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = [s.base + s.q_len for s in seqs]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(seqs))]
    qsl = [0]
    for s in seqs:
        qsl.append(qsl[-1] + s.q_len)
    masks = [m for s in seqs for m in (s.tree[1] if s.tree else [0] * s.q_len)]
    meta = build_metadata(qsl, lens, tables, block_size, tree_mask=masks)
    meta.check_invariants()
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    query = torch.randn(qsl[-1], heads, dim, generator=g).to(dtype)
    return Step(query, kv, meta, seqs)


def test_oracle_chain_masks_are_causal_and_tree_rows_skip_siblings() -> None:
    """The oracle: a full-chain mask reads like mask 0; a tree row ignores other branches."""
    seqs = [Seq(4, 6)]
    step = make_step(seqs, 4, dtype=torch.float32)
    args, scale = step.c_args(), 0.3
    causal = oracle.ragged_attention(*args, scale)
    chain = torch.tensor([(1 << (i + 1)) - 1 for i in range(4)])
    torch.testing.assert_close(oracle.ragged_attention(*args, scale, chain), causal,
                               atol=0, rtol=0)
    # rows 1 and 2 are siblings under 0, row 3 under 2: row 3 must not see row 1
    tree = torch.tensor([0b1, 0b11, 0b101, 0b1101])
    kv = step.kv.clone()
    got = oracle.ragged_attention(step.query, kv, *args[2:], scale, tree)
    flat = kv.view(2, -1, *kv.shape[3:])
    slot = slots_of(step.meta.host_block_tables()[0].numpy(), torch.tensor([7]).numpy(), 4)
    flat[:, slot] = 1e3  # row 1's K/V (position 6 + 1): rows 0, 2, 3 are blind to it
    again = oracle.ragged_attention(step.query, kv, *args[2:], scale, tree)
    torch.testing.assert_close(again[[0, 2, 3]], got[[0, 2, 3]], atol=0, rtol=0)
    assert not torch.allclose(again[1], got[1])


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_torch_path_matches_oracle(dtype: torch.dtype, block_size: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch groups (SDPA / fp32 math, single and padded) honour the tree rows; bf16 with
    the C kernel turned off, so its torch path runs."""
    monkeypatch.setattr(cpu_attention, "ragged_attention", lambda *a, **k: None)
    step = make_step(MIXED, block_size, dtype=dtype, seed=block_size)
    scale = 64 ** -0.5
    got = torch_attention.paged_attention(step.query, step.kv, step.meta, scale)
    assert "torch" in step.meta.plans
    want = oracle.naive_attention(step.query, step.kv, step.meta, scale)
    assert got.dtype == dtype
    assert_near(got, want, dtype)


@pytest.mark.parametrize("long_context", [False, True])
def test_torch_bf16_long_tree_takes_fp32_math(long_context: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone small tree over a long context (the fp32-math group) or a short one (SDPA)."""
    monkeypatch.setattr(cpu_attention, "ragged_attention", lambda *a, **k: None)
    base = torch_attention.LONG_CONTEXT + 20 if long_context else 50
    step = make_step([tree_seq(12, base, 3)], 16, heads=6, kv_heads=3, seed=4)
    group, = torch_attention.plan_attention(step.meta)
    fn = torch_attention._attend_fn(BF16, group)
    assert (fn is torch_attention._attend_group_fp32_math) == long_context
    got = torch_attention.paged_attention(step.query, step.kv, step.meta, 0.125)
    assert_near(got, oracle.naive_attention(step.query, step.kv, step.meta, 0.125), BF16)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (9, 3, 128), (4, 4, 64)])
def test_c_kernel_matches_oracle(block_size: int, heads: int, kv_heads: int,
                                 dim: int) -> None:
    step = make_step(MIXED, block_size, heads, kv_heads, dim, seed=block_size + heads)
    scale = 1 / math.sqrt(dim)
    got = cpu_attention.ragged_attention(*step.c_args(), scale, step.meta.tree_mask)
    assert got is not None
    assert_near(got, oracle.naive_attention(step.query, step.kv, step.meta, scale), BF16)
    # the torch backend's bf16 CPU path is this call
    assert torch.equal(torch_attention.paged_attention(step.query, step.kv, step.meta, scale),
                       got)


def _with_threads(threads: int, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(old)


def _path_cache(step: Step, s: int, path: list[int]) -> torch.Tensor:
    """A copy of the cache where sequence s's path rows' K/V sit at base, base + 1, ..."""
    base, block_size = step.seqs[s].base, step.kv.shape[2]
    table = step.meta.host_block_tables()[s].numpy()
    src = slots_of(table, torch.tensor([base + r for r in path]).numpy(), block_size)
    dst = slots_of(table, torch.arange(base, base + len(path)).numpy(), block_size)
    kv = step.kv.clone()
    flat, old = kv.view(2, -1, *kv.shape[3:]), step.kv.view(2, -1, *kv.shape[3:])
    flat[:, torch.from_numpy(dst)] = old[:, torch.from_numpy(src)]
    return kv


@needs_kernel
# (8, 124): tree rows across a softmax segment boundary (QD_SEGMENT, 128); (8, 600),
# (12, 517): few enough rows, and context enough, that with 2 threads the kernel splits the
# sequence by positions
@pytest.mark.parametrize("n,base", [(8, 0), (8, 3), (64, 30), (64, 517), (40, 33), (8, 124),
                                    (8, 600), (12, 517)])
@pytest.mark.parametrize("others", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 5),
                                                           (4, 4, 64, 1)])
def test_c_tree_rows_bit_identical_to_contiguous_path(n: int, base: int, others: bool,
                                                      heads: int, kv_heads: int, dim: int,
                                                      block_size: int) -> None:
    """The lossless-speculation property: every row on a root-to-leaf path gives exactly the
    bits of the causal chain (and of a lone decode) over a cache where that path's K/V were
    copied to contiguous positions, whatever else is in the step, with 1 or 2 threads."""
    parents, masks = random_tree(n, random.Random(n + base))
    tree = Seq(n, base, (parents, masks))
    seqs, s = ([Seq(1, 700), tree, Seq(3, 0)], 1) if others else ([tree], 0)
    step = make_step(seqs, block_size, heads, kv_heads, dim, seed=base + heads)
    start, mask = step.start(s), step.meta.tree_mask
    leaves = [i for i in range(n) if i not in parents]
    deepest = max(leaves, key=lambda leaf: len(root_path(parents, leaf)))
    for scale in (dim ** -0.5, 16 * dim ** -0.5):  # 16: peaked softmax, late running max
        for threads in (1, 2):
            got = _with_threads(threads, cpu_attention.ragged_attention, *step.c_args(),
                                scale, mask)
            for leaf in {deepest, leaves[0], leaves[-1]}:
                path = root_path(parents, leaf)
                kv = _path_cache(step, s, path)
                table = step.meta.block_tables[s:s + 1].clone()
                q = step.query[[start + r for r in path]].contiguous()
                chain = cpu_attention.ragged_attention(
                    q, kv, table, torch.tensor([base + len(path)], dtype=torch.int32),
                    torch.tensor([0, len(path)], dtype=torch.int32), scale)
                assert chain is not None
                for m, r in enumerate(path):
                    assert torch.equal(got[start + r], chain[m]), (threads, leaf, m)
                lone = _with_threads(3 - threads, cpu_attention.decode_attention, q[-1:], kv,
                                     table, torch.tensor([base + len(path)], dtype=torch.int32),
                                     scale)
                assert torch.equal(got[start + leaf], lone[0])


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 5])
def test_c_write_kv_and_attend_tree(block_size: int) -> None:
    """The one-call KV write + attention with a tree mask: bit-equal to write_kv then the
    masked ragged_attention, and its path rows bit-equal to a causal write + attention of
    the path alone (the K/V verification writes, seen by the steps after it)."""
    heads, kv_heads, dim, scale = 9, 3, 64, 0.125
    step = make_step(MIXED, block_size, heads, kv_heads, dim, seed=11)
    meta, s = step.meta, 5  # the 64-row tree
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(meta.num_tokens, (heads + 2 * kv_heads) * dim, generator=g).to(BF16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    kv_ref = step.kv.clone()
    torch_attention.write_kv(k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim),
                             kv_ref, meta.slot_mapping)
    want = cpu_attention.ragged_attention(q.reshape(-1, heads, dim).contiguous(), kv_ref,
                                          meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, scale, meta.tree_mask)
    kv_got = step.kv.clone()
    got = torch_attention.write_kv_and_attend(qkv, heads, kv_heads, kv_got, meta, scale)
    assert got is not None and want is not None
    assert torch.equal(kv_got, kv_ref) and torch.equal(got, want)
    tree = MIXED[s].tree
    assert tree is not None
    parents, start, base = tree[0], step.start(s), MIXED[s].base
    for leaf in (63, 19, 8):  # the last row, and two more (any row ends a root path)
        path = root_path(parents, leaf)
        table = meta.block_tables[s:s + 1].clone()
        slots = slots_of(table[0].numpy(), torch.arange(base, base + len(path)).numpy(),
                         block_size)
        kv_chain = step.kv.clone()
        chain = cpu_attention.write_kv_and_attend(
            qkv[[start + r for r in path]], heads, kv_heads, kv_chain,
            torch.from_numpy(slots).int(), table,
            torch.tensor([base + len(path)], dtype=torch.int32),
            torch.tensor([0, len(path)], dtype=torch.int32), scale)
        assert chain is not None
        for m, r in enumerate(path):
            assert torch.equal(got[start + r], chain[m]), (leaf, m)


def _bad(variant: str) -> tuple[list[Seq], torch.Tensor]:
    """A step and a mask the kernel must refuse (int64 [num_tokens] unless said)."""
    parents_masks = random_tree(6, random.Random(5))
    seqs = [Seq(1, 9), Seq(6, 20, parents_masks), Seq(65 if variant == "q_len_65" else 3, 12)]
    masks = [0, *parents_masks[1], *[0] * seqs[2].q_len]
    if variant == "bit_above_row":
        masks[2] |= 1 << 3  # row 1 of the tree sees row 2, after it
    elif variant == "missing_own_bit":
        masks[4] &= ~(1 << 3)  # row 3 of the tree
    elif variant == "q_len_65":
        masks[-1] = (1 << 63) | 1  # row 64 of a 65-row sequence
    mask = torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks])
    if variant == "int32":
        mask = mask.int()
    elif variant == "short":
        mask = mask[:-1]
    elif variant == "strided":
        mask = torch.stack([mask, mask], 1)[:, 0]
    return seqs, mask


@needs_kernel
@pytest.mark.parametrize("variant", ["bit_above_row", "missing_own_bit", "q_len_65", "int32",
                                     "short", "strided"])
def test_bad_masks_are_declined(variant: str) -> None:
    """A malformed mask (or one not int64, [num_tokens], contiguous): both entry points
    return None, nothing written; the torch path refuses a malformed one."""
    seqs, mask = _bad(variant)
    step = make_step(seqs, 4, 4, 2, 64, seed=6)
    meta = step.meta
    assert cpu_attention.ragged_attention(*step.c_args(), 0.1, mask) is None
    assert cpu_attention.ragged_attention(*step.c_args(), 0.1) is not None
    qkv = torch.randn(meta.num_tokens, 8 * 64).to(BF16)
    kv = step.kv.clone()
    assert cpu_attention.write_kv_and_attend(qkv, 4, 2, kv, meta.slot_mapping,
                                             meta.block_tables, meta.seq_lens,
                                             meta.query_start_loc, 0.1, mask) is None
    assert torch.equal(kv, step.kv)
    if variant in ("bit_above_row", "missing_own_bit", "q_len_65"):
        bad_meta = dataclasses.replace(meta, tree_mask=mask, plans={})
        with pytest.raises(ValueError):
            torch_attention.paged_attention(step.query, step.kv, bad_meta, 0.1)


@needs_kernel
def test_no_mask_and_zero_mask_change_nothing() -> None:
    """Causal steps: no argument, None and an all-zero mask give the same bits, on both entry
    points and through the torch backend."""
    seqs = [Seq(20, 30), Seq(1, 517), Seq(5, 70), Seq(3, 0)]
    step = make_step(seqs, 16, 9, 3, 64, seed=9)
    meta, zeros = step.meta, torch.zeros(step.meta.num_tokens, dtype=torch.int64)
    assert meta.tree_mask is None  # build_metadata drops an all-zero mask
    plain = cpu_attention.ragged_attention(*step.c_args(), 0.125)
    assert plain is not None
    for mask in (None, zeros):
        again = cpu_attention.ragged_attention(*step.c_args(), 0.125, mask)
        assert again is not None and torch.equal(again, plain)
    zero_meta = dataclasses.replace(meta, tree_mask=zeros, plans={})
    assert torch.equal(torch_attention.paged_attention(step.query, step.kv, zero_meta, 0.125),
                       plain)
    qkv = torch.randn(meta.num_tokens, 15 * 64).to(BF16)
    outs, caches = [], []
    for m in (meta, zero_meta):
        caches.append(step.kv.clone())
        out = torch_attention.write_kv_and_attend(qkv, 9, 3, caches[-1], m, 0.125)
        assert out is not None
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
