"""Token Recycling (arXiv 2408.08696): a model-free proposer that drafts from the target
model's own recent predictions.

Every decode or verification step already computes logits at rows we sample from: the row
whose *input* token is ``t`` holds the target's prediction of what follows ``t`` in that
row's context. Those predictions are thrown away after sampling, the rejected drafts' rows
included. Token Recycling keeps them: an **adjacency table** ``[vocab, width]`` (int32) that
holds, for every token ``t``, the ``width`` (8) most likely next tokens the target predicted
the last time ``t`` was an input row, in decreasing logit order (``-1``: ``t`` never was).
After each step the rows of that step overwrite their input tokens' entries in one
vectorised scatter (:func:`update_table`; when a token is the input of several rows, the
last row wins).

Drafting (:func:`draft_chain`) starts at the request's newest token and follows column 0 of
the table: a CHAIN of top-1 successors, up to the ``k`` drafts the speculator allows,
stopping at a token never seen as an input and (``stop_on_cycle``) before the chain closes
a 2-cycle ``a -> b -> a``: past that point it would only alternate between two stale
predictions (a self-loop ``a -> a`` is followed: runs of one token are real). The engine
can verify a chain; like the paper, :func:`draft_tree` drafts a TREE instead: a
breadth-first expansion of each token's top successors along a static template of widths
per depth (``TREE_WIDTHS``), verified in one step with tree attention. Each node carries its
rank among its siblings, from which the speculator scores it.

Tenants. The table is derived from other requests' contexts: the entry of ``t`` is what the
model predicted after ``t`` *in the latest context containing t*, which copies that
context's content (the name after "Project", the digit after "March"). Drafts are verified,
so another tenant's text can never be emitted, but how fast a guessed continuation is
accepted would tell a prober whether someone else's context predicted it: the suffix
proposer's timing side channel, with one token of context. So the tables are per tenant
(``cache_salt``, ``None`` being one tenant), like the suffix partitions: a request reads and
feeds only its tenant's table. A table costs ``vocab * width * 4`` bytes (1.5 MB for
SmolLM2's 49k vocabulary, 4.9 MB for Qwen2.5's 152k); at most ``max_tenants`` are kept,
least recently used dropped first (that tenant starts cold again).

A seeded sampled request gets no recycling drafts: the random draws verification consumes
depend on its drafts, and its output must depend on its seed and prompt alone, not on what
other requests of its tenant computed before (the suffix proposer's rule too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from quickdraft.engine.request import Request
from quickdraft.engine.step_plan import StepPlan

UNSEEN = -1  # table entry of a token never seen as an input row


@dataclass(frozen=True)
class RecyclingConfig:
    width: int = 8  # successors kept per token (the tree's branching; the chain uses 1)
    max_tenants: int = 16  # tables kept (least recently used dropped)
    stop_on_cycle: bool = True  # end a chain before it closes a 2-cycle a -> b -> a

    def __post_init__(self) -> None:
        if not 1 <= self.width <= 64 or self.max_tenants < 1:
            raise ValueError("width must be in [1, 64] and max_tenants >= 1")


def new_table(vocab_size: int, width: int) -> np.ndarray:
    """An empty adjacency table: ``[vocab_size, width]`` int32, every entry ``UNSEEN``."""
    return np.full((vocab_size, width), UNSEEN, dtype=np.int32)


def update_table(table: np.ndarray, tokens: np.ndarray, successors: np.ndarray) -> None:
    """Row ``r`` saw input token ``tokens[r]`` and predicted ``successors[r]``: write it into
    ``table`` (in place), the last row winning where a token repeats.

    ``table``: ``[vocab, width]`` int32; ``tokens``: ``[R]`` ints; ``successors``:
    ``[R, width]`` ints (ranked, ``UNSEEN``-padded)."""
    if tokens.shape[0] == 0:
        return
    # the last occurrence of each token: first occurrence in the reversed rows
    _, first_reversed = np.unique(tokens[::-1], return_index=True)  # [U]
    last = tokens.shape[0] - 1 - first_reversed  # [U] row indices
    table[tokens[last]] = successors[last]


def draft_chain(table: np.ndarray, start: int, k: int, stop_on_cycle: bool = True) -> list[int]:
    """Up to ``k`` drafts after token ``start``: each the top-1 successor of the one before,
    ending at an unseen token or (``stop_on_cycle``) before closing a 2-cycle ``a -> b -> a``
    (a self-loop ``a -> a`` is followed: a repetition run)."""
    chain = [start]
    for _ in range(k):
        nxt = int(table[chain[-1], 0])
        if nxt == UNSEEN or (stop_on_cycle and len(chain) >= 2 and nxt == chain[-2]
                             and nxt != chain[-1]):
            break
        chain.append(nxt)
    return chain[1:]


# Successors expanded per depth (depth 1 = the root's children): a CPU-sized template. The
# speculator keeps the best-scored nodes the row-cost curve pays for (4-16 on a CPU).
TREE_WIDTHS = (3, 2, 2, 1, 1, 1, 1, 1)


def draft_tree(table: np.ndarray, start: int, max_nodes: int,
               widths: Sequence[int] = TREE_WIDTHS,
               ) -> tuple[list[int], list[int], list[int]]:
    """A breadth-first tree of successors below token ``start``: node ``i`` has token
    ``tokens[i]``, parent ``parents[i]`` (-1: the root) and ``ranks[i]`` (its column in the
    table). Depth ``d`` expands the top ``widths[d - 1]`` successors of each node, skipping
    unseen tokens and a child that would close a 2-cycle ``a -> b -> a`` (as the chain
    does); at most ``max_nodes`` nodes, in BFS (topological) order."""
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []
    frontier = [(-1, start, -1)]  # (node, token, its parent's token)
    for width in widths:
        nxt: list[tuple[int, int, int]] = []
        for node, token, parent_token in frontier:
            for rank in range(min(width, table.shape[1])):
                child = int(table[token, rank])
                if child == UNSEEN or (child == parent_token and child != token):
                    continue
                if len(tokens) == max_nodes:
                    return tokens, parents, ranks
                tokens.append(child)
                parents.append(node)
                ranks.append(rank)
                nxt.append((len(tokens) - 1, child, token))
        if not nxt:
            break
        frontier = nxt
    return tokens, parents, ranks


def top_successors(logits: torch.Tensor, width: int) -> np.ndarray:
    """The ``width`` highest-scoring token ids of each row, best first: ``[rows, width]``
    int32 on the host, ``UNSEEN``-padded when the vocabulary is narrower than ``width``.
    ``logits``: ``[rows, vocab]`` on any device."""
    rows, vocab = logits.shape
    k = min(width, vocab)
    with torch.no_grad():
        ids = torch.topk(logits, k, dim=1, sorted=True).indices  # [rows, k]
    out = ids.to(torch.int32).cpu().numpy()
    if k < width:
        out = np.concatenate([out, np.full((rows, width - k), UNSEEN, dtype=np.int32)], axis=1)
    return out


def scored_rows(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """For each logits row of ``plan``'s step: the sequence it belongs to (index into the
    scheduler output's requests) and its input token. Two ``[num_sample_rows]`` int64
    arrays; logits row ``r`` scores flat row ``plan.logits_indices[r]``."""
    flat = np.asarray(plan.logits_indices, dtype=np.int64)  # [R]
    qsl = np.asarray(plan.query_start_loc, dtype=np.int64)  # [num_seqs + 1]
    seqs = np.searchsorted(qsl, flat, side="right") - 1  # [R]
    tokens = np.asarray(plan.input_ids, dtype=np.int64)[flat]  # [R]
    return seqs, tokens


class RecyclingProposer:
    """Per-tenant adjacency tables; the only writer of them."""

    def __init__(self, vocab_size: int, config: RecyclingConfig | None = None) -> None:
        self.vocab_size = vocab_size
        self.config = config or RecyclingConfig()
        self._tables: OrderedDict[str | None, np.ndarray] = OrderedDict()

    def observe(self, tenant: str | None, tokens: np.ndarray, successors: np.ndarray) -> None:
        """One step's rows of ``tenant``'s requests: ``tokens`` ``[R]`` their input tokens,
        ``successors`` ``[R, width]`` their ranked predictions."""
        if tokens.shape[0] == 0:
            return
        table = self._tables.get(tenant)
        if table is None:
            table = self._tables[tenant] = new_table(self.vocab_size, self.config.width)
            while len(self._tables) > self.config.max_tenants:
                self._tables.popitem(last=False)
        self._tables.move_to_end(tenant)
        update_table(table, tokens, successors)

    def observe_step(self, logits: torch.Tensor, plan: StepPlan,
                     tenants: Sequence[str | None], wanted: Sequence[bool]) -> None:
        """Feed the step's logits ``[num_sample_rows, vocab]``: the rows of every sequence
        ``s`` with ``wanted[s]`` go to the table of ``tenants[s]`` (one top-k, on the
        logits' device, for all of them; one scatter per tenant)."""
        seqs, tokens = scored_rows(plan)
        keep = np.flatnonzero(np.asarray(wanted, dtype=bool)[seqs])  # [R'] logits rows
        if keep.size == 0:
            return
        index = torch.from_numpy(keep).to(logits.device, non_blocking=True)
        successors = top_successors(logits.index_select(0, index), self.config.width)
        owners = [tenants[s] for s in seqs[keep].tolist()]
        for tenant in dict.fromkeys(owners):
            mine = np.fromiter((o == tenant for o in owners), dtype=bool, count=len(owners))
            self.observe(tenant, tokens[keep][mine], successors[mine])

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` drafts for ``request`` from its tenant's table (none for a seeded
        sampled request, or a tenant with no table yet)."""
        params = request.sampling_params
        table = self._tables.get(request.cache_salt)
        if k <= 0 or table is None or (not params.greedy and params.seed is not None):
            return []
        last = request.token_ids_slice(request.num_tokens - 1, request.num_tokens)[0]
        return draft_chain(table, last, k, self.config.stop_on_cycle)

    def propose_tree(self, request: Request, max_nodes: int,
                     ) -> tuple[list[int], list[int], list[int]]:
        """:func:`draft_tree` for ``request`` from its tenant's table (tokens, parents,
        ranks; empty under :meth:`propose`'s rules)."""
        params = request.sampling_params
        table = self._tables.get(request.cache_salt)
        if max_nodes <= 0 or table is None or (not params.greedy and params.seed is not None):
            return [], [], []
        last = request.token_ids_slice(request.num_tokens - 1, request.num_tokens)[0]
        return draft_tree(table, last, max_nodes)

    def tenants(self) -> list[str | None]:
        """The tables' tenants, least recently used first."""
        return list(self._tables)
