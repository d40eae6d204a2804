"""The draft head's best-first tree search (host side), and what a proposal takes and gives.

One :class:`HeadSearch` per request of a :meth:`spec.draft_head_runner.DraftHeadRunner.propose`
call: the runner feeds it the head's distributions (the catch-up's, then each round's fed
nodes'), and it keeps the candidates in a heap scored by their path log-probability under the
head, chooses each round's nodes to feed and finally the tree. See the runner's module doc
for the rounds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import torch

from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.token_tree import TokenTree

ROUNDS = 3  # rounds after the catch-up (so a tree is at most ROUNDS + 1 deep)
CHILDREN = 4  # candidates taken from each fed node's distribution


@dataclass(frozen=True)
class HeadInput:
    """One request's share of a propose call."""

    features: torch.Tensor  # [m, 3h] target features of positions [start_pos, start_pos + m)
    next_token_ids: list[int]  # [m] the token after each of those positions
    start_pos: int
    k: int  # nodes wanted (slots reserved after the pending token)
    block_table: tuple[int, ...]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    tree: bool = True  # False: a chain even for a greedy request
    # deepest node of a greedy tree: the drafts the policy granted, priced as a chain of
    # that depth (None: ROUNDS + 1). A tree of depth d costs the catch-up and d - 1 rounds.
    max_depth: int | None = None


@dataclass(frozen=True)
class HeadOutput:
    tree: TokenTree  # at most k nodes (a chain for sampled requests)
    probs: torch.Tensor | None  # [nodes, vocab] the head's q (sampled requests), else None
    scores: tuple[float, ...] = ()  # greedy: each node's path log-probability under the head


class _Sampler(Protocol):
    """What the search asks of the runner (a sampled chain's draws)."""

    def sample_child(self, log_probs: torch.Tensor, inp: HeadInput
                     ) -> tuple[int, torch.Tensor]: ...


class HeadSearch:
    """One request's best-first tree search (host side)."""

    def __init__(self, inp: HeadInput, root_out: torch.Tensor) -> None:
        self.inp = inp
        self.greedy = inp.sampling_params.greedy
        self.branching = self.greedy and inp.tree
        depth = ROUNDS + 1 if inp.max_depth is None else max(inp.max_depth, 1)
        # rounds of feeding: a tree of depth d needs d - 1 (a chain of k nodes, k - 1)
        self.rounds = min(ROUNDS, depth - 1) if self.branching else inp.k - 1
        self.root_out = root_out  # the root pair's output: the first draft's distribution
        self.base = inp.start_pos + len(inp.next_token_ids) - 1  # the root pair's position
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.scores: list[float] = []  # log-probability of the node's path
        self.q: list[torch.Tensor] = []  # sampled chains: the head's q per node
        self.outputs: dict[int, torch.Tensor] = {}  # fed node -> its output o
        self.pending: list[int] = []  # fed this round, children not known yet
        # nodes fed in any round: always nodes [0, num_fed) (their K/V at node slots)
        self.num_fed = 0
        self.heap: list[tuple[float, int, int, int]] = []  # (-score, order, parent, token)
        self._order = 0

    def parent_out(self, node: int) -> torch.Tensor:
        parent = self.parents[node]
        return self.root_out if parent < 0 else self.outputs[parent]

    def sample_below(self, node: int, log_probs: torch.Tensor, runner: _Sampler) -> None:
        """A sampled chain's one candidate below ``node`` (-1: the root), drawn from its
        distribution ``log_probs [V_d]`` (greedy searches take theirs through
        :meth:`expand_top`, a round's rows batched by the runner)."""
        assert not self.greedy
        token, q = runner.sample_child(log_probs, self.inp)
        self._push(self.scores[node] if node >= 0 else 0.0, node, token)
        self.q.append(q)

    def expand_top(self, node: int, log_probs: list[float], tokens: list[int]) -> None:
        """A greedy search's candidates below ``node`` (-1: the root): the (at most
        ``CHILDREN``) likeliest tokens of its distribution (target ids), best first, with
        their log-probabilities; a chain keeps the first."""
        assert self.greedy and len(log_probs) == len(tokens) <= CHILDREN
        base = self.scores[node] if node >= 0 else 0.0
        for lp, token in zip(log_probs[:CHILDREN if self.branching else 1], tokens,
                             strict=False):
            self._push(base + lp, node, token)

    def _push(self, score: float, parent: int, token: int) -> None:
        heapq.heappush(self.heap, (-score, self._order, parent, token))
        self._order += 1

    def _add_best(self) -> int:
        neg, _, parent, token = heapq.heappop(self.heap)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.scores.append(-neg)
        return len(self.tokens) - 1

    def take_round(self, index: int) -> bool:
        """Add this round's best candidates to the tree and mark those with room left for
        children to be fed; False when nothing is to be fed. A greedy tree of ``k`` nodes
        takes ``k // (rounds + 1)`` a round (the rest are leaves), a chain one; after its
        ``rounds`` rounds (``index`` counts from 0), none."""
        k = self.inp.k
        if index >= self.rounds:
            return False
        limit = max(1, k // (self.rounds + 1)) if self.branching else 1
        while self.heap and len(self.pending) < limit and len(self.tokens) < k:
            node = self._add_best()
            if len(self.tokens) < k:  # room for its children: feed it (at most k - 1 fed)
                # invariant: fed nodes are a prefix (only the k-th node is ever left unfed,
                # and no node follows it), so a round's rows are nodes [0, num_fed)
                assert node == self.num_fed, (node, self.num_fed)
                self.pending.append(node)
                self.num_fed += 1
        return bool(self.pending)

    def finish(self) -> HeadOutput:
        while self.heap and len(self.tokens) < self.inp.k:
            self._add_best()
        tree = TokenTree(tuple(self.tokens), tuple(self.parents))
        probs = torch.stack(self.q[:len(self.tokens)]) if self.q and self.tokens else None
        return HeadOutput(tree, probs, tuple(self.scores) if self.greedy else ())
