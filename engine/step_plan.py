"""One step as flat host lists: the one plan every forward pass is built from.

The scheduler's output (:func:`plan_step`), a draft model's proposal steps
(:meth:`StepPlan.from_feeds`) and the runner's timing steps all become a :class:`StepPlan`;
the eager path turns it into :class:`kernels.attention_metadata.AttentionMetadata` with
:meth:`StepPlan.attention_metadata`, and a CUDA graph fills its static buffers from it. Every
backend reads that one metadata type.

A request verifying a draft *tree* feeds its root (the one pending token) then the nodes in
topological order: row ``i`` writes its K/V to the slot of flat position ``base + i`` but is
rotated at position ``base + depth`` and attends through its ancestor bitmask
(``tree_mask``, see :mod:`kernels.attention_metadata`); every other row's mask is 0
(causal). A step without trees has ``tree_mask`` None.

Invariants (asserted by :meth:`StepPlan.check_invariants`, which the model runner calls on
every step, with the metadata's own check, when ``QUICKDRAFT_CHECK_INVARIANTS=1``: the test
suite sets it in ``tests/conftest.py``): the lists agree
in length (``num_tokens`` ids and positions, ``num_seqs`` sequences); sequence ``s`` owns
rows ``query_start_loc[s]:query_start_loc[s + 1]`` whose positions are the last ``q_len`` of
its ``seq_lens[s]``-token context, in order (a tree row: ``base`` + its depth, the number of
its ancestors); its block table covers that context; ``logits_indices`` are rows of the
step, increasing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.engine.scheduler import SchedulerOutput
from quickdraft.kernels.attention_metadata import AttentionMetadata, build_metadata

# Tests switch this on (tests/conftest.py): every step's plan and metadata are checked.
CHECK_INVARIANTS = os.environ.get("QUICKDRAFT_CHECK_INVARIANTS") == "1"


@dataclass(frozen=True)
class StepPlan:
    input_ids: list[int]  # [num_tokens]
    positions: list[int]  # [num_tokens]
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context length including the new tokens
    block_tables: list[Sequence[int]]  # [num_seqs][blocks], read and never edited
    logits_indices: list[int]  # rows of the flat batch to score
    sample_requests: list[int]  # indices into SchedulerOutput.requests that sample this step
    # [num_tokens] ancestor bitmasks (0 = causal row), or None when no request has a tree
    tree_mask: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        return max((b - a for a, b in itertools.pairwise(self.query_start_loc)), default=0)

    @property
    def all_rows_sampled(self) -> bool:
        return len(self.logits_indices) == len(self.input_ids)

    @classmethod
    def from_feeds(cls, feeds: Sequence[Sequence[int]], starts: Sequence[int],
                   block_tables: Sequence[Sequence[int]]) -> StepPlan:
        """Sequence ``i`` feeds tokens ``feeds[i]`` at positions ``starts[i]...``; the last
        row of each is scored (a draft model's step)."""
        query_start_loc = [0]
        positions: list[int] = []
        input_ids: list[int] = []
        for feed, start in zip(feeds, starts, strict=True):
            query_start_loc.append(query_start_loc[-1] + len(feed))
            positions += range(start, start + len(feed))
            input_ids += feed
        seq_lens = [s + len(f) for s, f in zip(starts, feeds, strict=True)]
        return cls(input_ids, positions, query_start_loc, seq_lens, list(block_tables),
                   [end - 1 for end in query_start_loc[1:]], list(range(len(feeds))))

    def attention_metadata(self, block_size: int,
                           device: torch.device | str | None = None) -> AttentionMetadata:
        """The step's attention metadata on ``device``, in one copy."""
        meta = build_metadata(self.query_start_loc, self.seq_lens, self.block_tables,
                              block_size, device, self.tree_mask)
        if CHECK_INVARIANTS:
            self.check_invariants(block_size)
            meta.check_invariants()
        return meta

    def check_invariants(self, block_size: int) -> None:
        n, qsl = self.num_tokens, self.query_start_loc
        assert len(self.positions) == n and qsl[0] == 0 and qsl[-1] == n, (n, qsl)
        assert len(qsl) == len(self.seq_lens) + 1 == len(self.block_tables) + 1
        masks = self.tree_mask or [0] * n
        assert len(masks) == n
        for s, (a, b) in enumerate(itertools.pairwise(qsl)):
            ctx = self.seq_lens[s]
            assert 0 <= b - a <= ctx <= len(self.block_tables[s]) * block_size, (s, a, b, ctx)
            base = ctx - (b - a)
            want = [base + i if not m else base + m.bit_count() - 1
                    for i, m in enumerate(masks[a:b])]
            assert self.positions[a:b] == want, s
        rows = self.logits_indices
        assert all(0 <= r < n for r in rows) and rows == sorted(set(rows)), rows


def plan_step(sched: SchedulerOutput) -> StepPlan:
    """The scheduler's step flattened: each request feeds its ``token_ids`` from
    ``start_pos``; a sampling request scores its last row and one row per draft token."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sample_requests: list[int] = []
    tree_mask: list[int] | None = None
    for i, req in enumerate(sched.requests):
        n = req.num_tokens
        input_ids += req.token_ids
        tree = req.draft_tree
        if tree is None:
            if tree_mask is not None:
                tree_mask += [0] * n  # causal rows
            positions += range(req.start_pos, req.start_pos + n)
        else:  # the root (the one pending token), then the tree's nodes
            assert tuple(req.token_ids[1:]) == tree.token_ids, "a tree follows one pending token"
            if tree_mask is None:
                tree_mask = [0] * len(positions)  # the causal rows before it
            tree_mask += tree.row_masks()
            positions += tree.positions(req.start_pos)
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(req.start_pos + n)
        if req.sample:
            end = query_start_loc[-1]
            logits_indices += range(end - 1 - req.num_draft_tokens, end)
            sample_requests.append(i)
    return StepPlan(input_ids, positions, query_start_loc, seq_lens,
                    [r.block_table for r in sched.requests], logits_indices, sample_requests,
                    tree_mask)
