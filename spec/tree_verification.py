"""Lossless verification of token trees (tree speculation) against the target's logits.

Each request ``b`` brings a :class:`~spec.token_tree.TokenTree` of ``n_b`` nodes and the target
scores ``n_b + 1`` rows for it (grouped per request in batch order): row 0 is the root's
logits, row ``1 + i`` node ``i``'s, i.e. the target distribution over node ``i``'s children.
An empty tree is a plain decode step (one row). Per request the output is the accepted path
(node tokens from a child of the root downwards) followed by exactly one more token, drawn
at the row of the path's last node (the root when nothing was accepted):

* **greedy** requests (temperature 0): at the current row, ``t = argmax``; if a child of the
  current node carries ``t`` it is accepted and the walk moves to its row, else the walk
  stops and emits ``t``. At a leaf, ``t`` is the bonus token. This is exactly plain greedy
  decoding, and for a chain exactly :func:`spec.rejection_sampler.rejection_sample`.
* **sampled** requests (multi-candidate rejection sampling, SpecInfer, Miao et al. 2023,
  with deterministic one-hot drafts as the model-free proposers make): ``p`` is the
  softmax of the current row after the request's temperature / top-k / top-p / min-p. Each
  child ``c`` is tried in index order and accepted when ``u_c * m < p(c)``, where ``u_c``
  is the node's uniform and ``m = 1 - sum of p over the siblings rejected before it``
  (i.e. ``u_c < p'(c)`` with ``p'`` = ``p`` with the rejected siblings zeroed and
  renormalised); the first accepted child becomes the current node. When every child is
  rejected the final token is drawn from ``p`` with the children's tokens zeroed (from
  ``p`` itself in the degenerate case where that leaves no mass); at a leaf the bonus token
  is drawn from ``p``. Every emitted token is then distributed exactly as the target at
  its position, whatever the tree (given the tree does not depend on the draws).
  Draft-model trees with a non-one-hot draft distribution are not supported here.

Randomness (fixed order, so a seeded request's output does not depend on its batch): every
node of a sampled request has one acceptance uniform, drawn by
:func:`spec.verification.draft_uniforms` (unseeded requests' nodes in one draw from
``batch.default_generator``, then each seeded request's nodes from its own generator); a
node's uniform is used only if the node is tried. Then the final tokens of all sampled
requests are drawn at once by :func:`engine.sampler.sample_from_probs`. For a chain these are
the chain verifier's draws and tests, so sampled chain results equal its results (up to
the float rounding of a row's logsumexp, which may depend on how many rows are reduced).

Validation, the float32 raw logits and the processed logits come from
:func:`spec.verification.prepare_verification`, given the flattened node tokens as drafts
(its :class:`~spec.verification.VerifyLayout` ``draft_rows`` are chain rows; the row that
scores node ``i`` is its parent's, ``start + 1 + parents[i]``: :func:`tree_node_rows`).
Per-row maths is batched torch ops: one argmax over the greedy requests' rows; the sampled
requests walk level by level, one logsumexp per level over the current row of every request
still walking (so only visited rows pay for it, not every node of a large tree); one
softmax over the sampled requests' final rows. Python walks the trees over scalars only,
never over a vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from quickdraft.engine.sampler import SamplingBatch, argmax_rows, sample_from_probs
from quickdraft.spec.token_tree import TokenTree
from quickdraft.spec.verification import (
    draft_uniforms,
    greedy_on_raw_logits,
    prepare_verification,
    validate_verification,
)

__all__ = ["TreeVerifyOutput", "tree_node_rows", "verify_trees"]


@dataclass(frozen=True)
class TreeVerifyOutput:
    """What tree verification emits for a batch: per request, the tokens to append."""

    token_ids: list[list[int]]  # per request: accepted path tokens, then one more token
    accepted_nodes: list[list[int]]  # per request: node indices of the accepted path
    num_accepted: list[int]  # per request: len(accepted_nodes)
    # Per request, aligned with token_ids: log_softmax of the RAW target logits (before
    # temperature / filters) at each emitted token's row; None when no request asked.
    logprobs: list[list[float]] | None = None


def tree_node_rows(trees: Sequence[TokenTree]) -> list[int]:
    """``[D]`` the target row that scores each node (its parent's row), flattened in request
    order; request ``b``'s rows start after the ``n + 1`` rows of every earlier request."""
    rows: list[int] = []
    for tree, start in zip(trees, _row_starts(trees), strict=True):
        rows.extend(start + 1 + p for p in tree.parents)
    return rows


def _row_starts(trees: Sequence[TokenTree]) -> list[int]:
    """``[B]`` each request's first target row (its root's): after every earlier request's
    ``n + 1`` rows."""
    return list(accumulate((tree.num_rows for tree in trees), initial=0))[:len(trees)]


@dataclass
class _Walk:
    """One request's walk: the accepted path, the final row and what it excludes."""

    accepted: list[int]
    final_row: int  # absolute row of the final token's draw
    rejected: tuple[int, ...] = ()  # tokens zeroed from the final row's p (sampled only)


def _greedy_argmax(logits: torch.Tensor, trees: Sequence[TokenTree], starts: list[int],
                   greedy: list[bool]) -> list[int]:
    """``[R]`` argmax of every greedy request's rows (-1 on sampled requests' rows)."""
    if all(greedy):  # no gather
        return argmax_rows(logits).tolist()
    argmax = [-1] * logits.shape[0]
    rows = [r for b, tree in enumerate(trees) if greedy[b]
            for r in range(starts[b], starts[b] + tree.num_rows)]
    if rows:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)  # [G]
        for r, t in zip(rows, argmax_rows(logits[index]).tolist(), strict=True):
            argmax[r] = t
    return argmax


def _walk_greedy(tree: TokenTree, start: int, argmax: list[int]) -> _Walk:
    """Follow the children that are the argmax of their parent's row (``argmax`` ``[R]``)."""
    children = {(p, t): i for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents,
                                                         strict=True))}
    node, accepted = -1, []
    while (child := children.get((node, argmax[start + 1 + node]))) is not None:
        accepted.append(child)
        node = child
    return _Walk(accepted, start + 1 + node)


def _try_children(kids: tuple[int, ...], p: list[float], u: list[float]) -> int | None:
    """The first accepted child of ``kids`` (None: all rejected); ``p`` / ``u`` per child."""
    mass = 1.0  # p mass left after rejecting the earlier siblings
    for c, pc, uc in zip(kids, p, u, strict=True):
        if mass > 0.0 and uc * mass < pc:
            return c
        mass -= pc
    return None


def _walk_sampled(logits: torch.Tensor, trees: Sequence[TokenTree], starts: list[int],
                  offsets: list[int], sampled: list[int], u: list[float]) -> dict[int, _Walk]:
    """Multi-candidate rejection walks of the ``sampled`` requests, one tree level at a time.

    Each level gathers the current row of every request still walking (``A`` rows), so only
    visited rows pay a logsumexp; ``logits`` ``[R, V]`` processed, ``u`` ``[D]`` per node.
    """
    walks: dict[int, _Walk] = {}
    node = dict.fromkeys(sampled, -1)
    accepted: dict[int, list[int]] = {b: [] for b in sampled}
    active = sampled
    device = logits.device
    while active:
        for b in active:
            if not trees[b].children(node[b]):  # a leaf: the bonus row
                walks[b] = _Walk(accepted[b], starts[b] + 1 + node[b])
        active = [b for b in active if b not in walks]
        if not active:
            break
        kids = [trees[b].children(node[b]) for b in active]
        rows = torch.tensor([starts[b] + 1 + node[b] for b in active], device=device)  # [A]
        local = torch.tensor([j for j, k in enumerate(kids) for _ in k], device=device)  # [C]
        ids = torch.tensor([trees[b].token_ids[c] for b, k in zip(active, kids, strict=True)
                            for c in k], device=device)  # [C] children's tokens
        picked = logits[rows]  # [A, V]
        lse = torch.logsumexp(picked, dim=-1)  # [A]
        p = torch.exp(picked[local, ids] - lse[local]).tolist()  # [C] p(child) at its row
        at, walking = 0, []
        for b, k in zip(active, kids, strict=True):
            child = _try_children(k, p[at:at + len(k)], [u[offsets[b] + c] for c in k])
            at += len(k)
            if child is None:
                walks[b] = _Walk(accepted[b], starts[b] + 1 + node[b],
                                 tuple(trees[b].token_ids[c] for c in k))
            else:
                accepted[b].append(child)
                node[b] = child
                walking.append(b)
        active = walking
    return walks


def _final_tokens(logits: torch.Tensor, walks: list[_Walk], greedy: list[bool],
                  argmax: list[int], batch: SamplingBatch) -> list[int]:
    """Each request's final token: the argmax (greedy) or a draw from its final row's p with
    the rejected tokens zeroed (sampled, all sampled requests in one draw)."""
    tokens = [argmax[w.final_row] if g else -1 for w, g in zip(walks, greedy, strict=True)]
    sampled = [b for b, g in enumerate(greedy) if not g]
    if not sampled:
        return tokens
    device = logits.device
    rows = torch.tensor([walks[b].final_row for b in sampled], device=device)  # [S]
    probs = torch.softmax(logits[rows], dim=-1)  # [S, V]
    which = [j for j, b in enumerate(sampled) for _ in walks[b].rejected]
    if which:
        zero_rows = torch.tensor(which, device=device)  # [X]
        zero_ids = torch.tensor([t for b in sampled for t in walks[b].rejected],
                                device=device)  # [X]
        kept = probs[zero_rows, zero_ids]  # [X]
        probs[zero_rows, zero_ids] = 0.0  # the residual; the race normalises
        empty = (probs.sum(dim=-1) <= 0)[zero_rows]  # [X] rows left with no mass
        if bool(empty.any()):  # rounding only: fall back to p
            probs[zero_rows[empty], zero_ids[empty]] = kept[empty]
    generators = [batch.generators[b] for b in sampled]
    drawn = sample_from_probs(probs, generators, batch.default_generator).tolist()  # [S]
    for b, t in zip(sampled, drawn, strict=True):
        tokens[b] = t
    return tokens


def _logprobs(raw: torch.Tensor, trees: Sequence[TokenTree], starts: list[int],
              walks: list[_Walk], tokens: list[list[int]]) -> list[list[float]]:
    """Raw log_softmax at every emitted token: accepted node ``i`` at its parent's row, the
    final token at the final row. ``raw`` ``[R, V]`` float32."""
    rows: list[int] = []
    for tree, start, walk in zip(trees, starts, walks, strict=True):
        rows.extend(start + 1 + tree.parents[i] for i in walk.accepted)
        rows.append(walk.final_row)
    device = raw.device
    picked = raw[torch.tensor(rows, dtype=torch.long, device=device)]  # [E, V]
    ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=device)  # [E]
    chosen = picked.gather(1, ids.unsqueeze(1)).squeeze(1)  # [E]
    values = (chosen - torch.logsumexp(picked, dim=-1)).tolist()  # [E]
    out, at = [], 0
    for ts in tokens:
        out.append(values[at:at + len(ts)])
        at += len(ts)
    return out


def verify_trees(target_logits: torch.Tensor, trees: Sequence[TokenTree],
                 batch: SamplingBatch) -> TreeVerifyOutput:
    """Verify every request's tree and emit its accepted path + one more token.

    ``target_logits`` ``[R, V]`` (any float dtype, computed in float32): ``len(tree) + 1``
    rows per request, grouped in batch order (row 0 the root's, row ``1 + i`` node ``i``'s).
    ``batch`` has one row per request. See the module docstring for the rules and the order
    of the random draws. Raises ValueError on inconsistent inputs (row count, a token
    outside the vocabulary, a request with penalties and a non-empty tree).
    """
    drafts = [list(tree.token_ids) for tree in trees]
    greedy = [p.greedy for p in batch.params]
    if greedy_on_raw_logits(batch.params):
        # no torch layout (~15 small ops: 0.2-0.4 ms on a 2-core CPU, more than the argmax);
        # the same walks and tokens as below
        validate_verification(target_logits, drafts, None, batch)
        raw = logits = target_logits.float()  # [R, V]
        starts = _row_starts(trees)
        offsets: list[int] = []  # (only sampled walks read them)
    else:
        prep = prepare_verification(target_logits, drafts, None, batch)
        raw, logits = prep.raw, prep.logits  # [R, V] raw, processed
        starts = prep.layout.starts.tolist()
        offsets = prep.layout.draft_offsets.tolist()

    argmax = _greedy_argmax(logits, trees, starts, greedy)  # [R]
    sampled = [b for b, g in enumerate(greedy) if not g]
    u = (draft_uniforms([len(t) for t in trees], batch, logits.device).tolist()
         if any(len(trees[b]) for b in sampled) else [])  # [D]
    walks_of = _walk_sampled(logits, trees, starts, offsets, sampled, u)
    walks = [_walk_greedy(tree, starts[b], argmax) if greedy[b] else walks_of[b]
             for b, tree in enumerate(trees)]
    final = _final_tokens(logits, walks, greedy, argmax, batch)
    token_ids = [[*(tree.token_ids[i] for i in w.accepted), t]
                 for tree, w, t in zip(trees, walks, final, strict=True)]
    logprobs = None
    if any(p.logprobs for p in batch.params):
        logprobs = _logprobs(raw, trees, starts, walks, token_ids)
    return TreeVerifyOutput(token_ids=token_ids,
                            accepted_nodes=[w.accepted for w in walks],
                            num_accepted=[len(w.accepted) for w in walks],
                            logprobs=logprobs)
