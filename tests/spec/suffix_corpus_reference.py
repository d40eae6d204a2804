"""Plain-Python oracle of spec/suffix_corpus.c (the semantics in its header comment): sorts
the continuation starts by their reversed contexts with Python tuples and counts the
matched starts' continuations in a dict trie. Test code only."""

from __future__ import annotations

import numpy as np

F32 = np.float32
SEP = -1


def _context(tokens: list[int], p: int, depth: int) -> tuple[int, ...]:
    """p's context, most recent first, at most ``depth`` tokens, cut at its sequence start;
    padded with SEP so that an ended context sorts first."""
    out: list[int] = []
    for d in range(1, depth + 1):
        if p - d < 0 or tokens[p - d] == SEP:
            break
        out.append(tokens[p - d])
    return tuple(out) + (SEP,) * (depth - len(out))


def reference_tree(tokens: list[int], ctx: list[int], max_depth: int, max_nodes: int,
                   factor: float, min_prob: float, min_match: int, max_sources: int,
                   ) -> tuple[list[int], list[int], list[float], int]:
    """(tokens, parents, probs, match length) as qd_sc_speculate_tree returns them."""
    starts = [p for p in range(1, len(tokens)) if tokens[p] != SEP and tokens[p - 1] != SEP]
    starts.sort(key=lambda p: (_context(tokens, p, max_depth), p))
    ctx = ctx[-max_depth:]
    m, run = 0, starts
    for length in range(1, len(ctx) + 1):
        want = tuple(reversed(ctx[len(ctx) - length:]))
        matched = [p for p in run if _context(tokens, p, length) == want]
        if not matched:
            break
        m, run = length, matched
    if m == 0 or m < min_match:
        return [], [], [], 0
    budget = min(max_nodes, int(F32(factor) * F32(m)))
    if budget < 1:
        return [], [], [], m
    sources = min(len(run), max_sources)
    counts: dict[tuple[int, ...], int] = {}
    for s in range(sources):
        p = run[s * len(run) // sources]
        for d in range(budget):
            if p + d >= len(tokens) or tokens[p + d] == SEP:
                break
            key = tuple(tokens[p:p + d + 1])
            counts[key] = counts.get(key, 0) + 1

    def children(path: tuple[int, ...], p: np.float32, parent: int) -> list[tuple]:
        kids = {k[-1]: c for k, c in counts.items() if len(k) == len(path) + 1
                and k[:-1] == path}
        total = sum(kids.values())
        return [(F32(p * F32(c) / F32(total)), parent, t, (*path, t))
                for t, c in kids.items()]

    out_t: list[int] = []
    out_p: list[int] = []
    out_q: list[float] = []
    cands = children((), F32(1.0), -1)
    while len(out_t) < max_nodes and cands:
        best = min(cands, key=lambda c: (-c[0], c[1], c[2]))
        cands.remove(best)
        q, parent, token, path = best
        if q < F32(min_prob):
            break
        out_t.append(token)
        out_p.append(parent)
        out_q.append(float(q))
        if len(path) < budget:
            cands += children(path, q, len(out_t) - 1)
    return out_t, out_p, out_q, m
