"""Plain-Python oracle of spec/suffix_tree.c (the semantics in its header comment): a dict
trie of substrings of length <= max_depth with occurrence counts. Test code only."""

from __future__ import annotations

import numpy as np

F32 = np.float32


class ReferenceSuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.count: dict[tuple[int, ...], int] = {}  # substring -> occurrences
        self.seqs: dict[int, list[int]] = {}

    def _add(self, tokens: list[int], start: int, delta: int) -> None:
        for end in range(start + 1, len(tokens) + 1):  # substrings ending at tokens[end - 1]
            for length in range(1, min(self.max_depth, end) + 1):
                key = tuple(tokens[end - length:end])
                self.count[key] = self.count.get(key, 0) + delta

    def append(self, seq_id: int, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        start = len(seq)
        seq += tokens
        self._add(seq, start, +1)

    def remove(self, seq_id: int) -> None:
        self._add(self.seqs.pop(seq_id), 0, -1)

    def num_live_nodes(self) -> int:
        return sum(1 for c in self.count.values() if c > 0)

    def _children(self, key: tuple[int, ...]) -> dict[int, int]:
        if len(key) >= self.max_depth:
            return {}
        return {k[-1]: c for k, c in self.count.items()
                if len(k) == len(key) + 1 and k[:-1] == key and c > 0}

    def speculate(self, ctx: list[int], max_tokens: int, factor: float, min_prob: float,
                  min_match: int = 1) -> tuple[list[int], float, int]:
        ctx = ctx[-self.max_depth:]
        best: tuple[list[int], F32, int] = ([], F32(0), 0)
        for m in range(max(min_match, 1), min(len(ctx), self.max_depth) + 1):
            key = tuple(ctx[len(ctx) - m:])
            if self.count.get(key, 0) <= 0:
                continue
            budget = min(max_tokens, int(F32(factor) * F32(m)))
            p, s, draft = F32(1), F32(0), []
            while len(draft) < budget:
                children = self._children(key)
                if not children:
                    break
                total = sum(children.values())
                token = min(children, key=lambda t: (-children[t], t))
                q = F32(F32(p * F32(children[token])) / F32(total))
                if q < F32(min_prob):
                    break
                draft.append(token)
                s = F32(s + q)
                p = q
                key = (*key, token)
            if draft and s >= best[1]:
                best = (draft, s, m)
        return best[0], float(best[1]), best[2]

    def speculate_tree(self, ctx: list[int], max_nodes: int, factor: float, min_prob: float,
                       min_match: int = 1) -> tuple[list[int], list[int], list[float], int]:
        """Best-first below speculate()'s match: tokens, parents, path probabilities, m."""
        chain, _, m = self.speculate(ctx, max_nodes, factor, min_prob, min_match)
        if not chain:
            return [], [], [], m
        ctx = ctx[-self.max_depth:]
        budget = min(max_nodes, int(F32(factor) * F32(m)))
        # candidate: (q, parent index, token, trie key, depth)
        cands: list[tuple[F32, int, int, tuple[int, ...], int]] = []

        def push(key: tuple[int, ...], parent: int, p: F32, depth: int) -> None:
            children = self._children(key)
            total = sum(children.values())
            for token, count in children.items():
                q = F32(F32(p * F32(count)) / F32(total))
                cands.append((q, parent, token, (*key, token), depth))

        push(tuple(ctx[len(ctx) - m:]), -1, F32(1), 1)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        while len(tokens) < max_nodes and cands:
            best = min(cands, key=lambda c: (-c[0], c[1], c[2]))
            cands.remove(best)
            q, parent, token, key, depth = best
            if q < F32(min_prob):
                break
            tokens.append(token)
            parents.append(parent)
            probs.append(float(q))
            if depth < budget:
                push(key, len(tokens) - 1, q, depth + 1)
        return tokens, parents, probs, m


def longest_continued_match(context: list[int], sequences: list[list[int]], max_depth: int,
                            min_match: int = 1) -> int:
    """The longest ``m`` (at least ``min_match``, below ``max_depth``: a depth-``max_depth``
    node has no children) such that ``context[-m:]`` occurs in one of ``sequences`` followed
    by a token, else 0: what ``SuffixTree.extend_propose`` reports as its third value (the
    request's own sequence, i.e. ``context``, among them: its last occurrence, at the end,
    is followed by nothing)."""
    best = 0
    for m in range(max(min_match, 1), min(len(context), max_depth - 1) + 1):
        pattern = context[-m:]
        if any(seq[i:i + m] == pattern for seq in sequences for i in range(len(seq) - m)):
            best = m
    return best
