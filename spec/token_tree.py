"""A tree of draft tokens, verified in one target step (tree speculation).

A :class:`TokenTree` holds ``n`` draft tokens as a tree rooted at the request's last verified
token. The root itself is not stored: it is the step's first query row, the one before the
drafts. Node ``i`` has token ``token_ids[i]`` and parent ``parents[i]`` (-1: a child of the
root). The rules, checked on construction (ValueError otherwise):

* topological order: ``-1 <= parents[i] < i``, so every prefix of the nodes is a tree;
* no two children of one parent carry the same token (each path is a distinct continuation);
* at most :data:`MAX_TREE_NODES` = 63 nodes, so root + nodes fit the 64 query rows that an
  ancestor bitmask of one int64 can describe (see ``kernels/attention_metadata.py``).

Query rows of a verification step: row 0 is the root token, row ``1 + i`` is node ``i``; the
target logits of row ``r`` score the children of that row's token. A chain ``x_0 .. x_{k-1}``
(:meth:`TokenTree.from_chain`) is the tree with ``parents[i] = i - 1``, and then the rows are
exactly the chain verifier's.

Pure and small: every method is O(n) or O(n log n) Python over at most 63 nodes.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["MAX_TREE_NODES", "MAX_TREE_ROWS", "TokenTree"]

MAX_TREE_ROWS = 64  # root + nodes: one bit per query row in an int64 ancestor mask
MAX_TREE_NODES = MAX_TREE_ROWS - 1


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens as a tree below the root (the last verified token, not stored).

    ``token_ids`` and ``parents`` are ``[n]`` (any integer sequences, stored as tuples);
    ``parents[i]`` is -1 for a child of the root. See the module docstring for the rules.
    The empty tree (``TokenTree()``) is a plain decode step: one row, no drafts.
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        tokens = tuple(operator.index(t) for t in self.token_ids)
        parents = tuple(operator.index(p) for p in self.parents)
        object.__setattr__(self, "token_ids", tokens)
        object.__setattr__(self, "parents", parents)
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} token ids but {len(parents)} parents")
        if len(tokens) > MAX_TREE_NODES:
            raise ValueError(f"{len(tokens)} nodes: a tree has at most {MAX_TREE_NODES} "
                             f"({MAX_TREE_ROWS} rows with the root)")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            if token < 0:
                raise ValueError(f"node {i}: negative token id {token}")
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} must be -1 (the root) or an "
                                 f"earlier node (topological order)")
            if (parent, token) in seen:
                raise ValueError(f"node {i}: parent {parent} already has a child with "
                                 f"token {token}")
            seen.add((parent, token))

    def __len__(self) -> int:
        """Number of draft nodes ``n`` (the root is not counted)."""
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        """Query rows of the verification step: the root's plus one per node."""
        return len(self.token_ids) + 1

    # -------------------------------------------------------------------------------------
    # Construction
    # -------------------------------------------------------------------------------------

    @classmethod
    def from_chain(cls, tokens: Iterable[int]) -> TokenTree:
        """The chain ``tokens[0] -> tokens[1] -> ...`` below the root."""
        token_ids = tuple(tokens)
        return cls(token_ids, tuple(range(-1, len(token_ids) - 1)))

    # -------------------------------------------------------------------------------------
    # Structure
    # -------------------------------------------------------------------------------------

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """``[n]`` depth of every node: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        """Length of the longest path (0 for the empty tree)."""
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        """Whether every node is the only child of the previous one (true when empty)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        """``[n + 1]`` children of each row's token (row 0 = root), in index order."""
        table: list[list[int]] = [[] for _ in range(self.num_rows)]
        for i, parent in enumerate(self.parents):
            table[parent + 1].append(i)
        return tuple(tuple(kids) for kids in table)

    def _check_node(self, node: int, allow_root: bool = True) -> None:
        if not (-1 if allow_root else 0) <= node < len(self.token_ids):
            raise IndexError(f"node {node} outside [{-1 if allow_root else 0}, "
                             f"{len(self.token_ids)})")

    def children(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` (-1 = the root), in index order."""
        self._check_node(node)
        return self._children[node + 1]

    def path_to(self, node: int) -> tuple[int, ...]:
        """The nodes from a child of the root down to ``node`` inclusive (``()`` for -1)."""
        self._check_node(node)
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    # -------------------------------------------------------------------------------------
    # What the verification step consumes
    # -------------------------------------------------------------------------------------

    def row_masks(self) -> list[int]:
        """``[n + 1]`` ancestor bitmasks over the step's query rows (unsigned ints).

        Bit ``j`` of row ``r``'s mask is set when row ``r`` sees row ``j``: itself and its
        ancestors, root included. Row 0's mask is 1. This is the ``tree_mask`` of
        ``kernels.attention_metadata`` (which stores it as a signed int64).
        """
        masks = [1]
        for i, parent in enumerate(self.parents):
            masks.append(masks[parent + 1] | 1 << (i + 1))
        return masks

    def positions(self, base: int) -> list[int]:
        """``[n + 1]`` RoPE positions: the root at ``base``, node ``i`` at base + depth."""
        return [base, *(base + d for d in self.depths)]

    # -------------------------------------------------------------------------------------
    # Pruning
    # -------------------------------------------------------------------------------------

    def select(self, nodes: Iterable[int]) -> TokenTree:
        """The subtree made of ``nodes``, renumbered in their original (index) order.

        ``nodes`` must contain the parent of each of its nodes (ancestor-closed); new node
        ``j`` is ``sorted(set(nodes))[j]``.
        """
        kept = sorted(set(nodes))
        new_index = {-1: -1}
        for j, node in enumerate(kept):
            self._check_node(node, allow_root=False)
            parent = self.parents[node]
            if parent not in new_index:
                raise ValueError(f"node {node} is selected without its parent {parent}")
            new_index[node] = j
        return TokenTree(tuple(self.token_ids[i] for i in kept),
                         tuple(new_index[self.parents[i]] for i in kept))

    def prune(self, keep: int) -> TokenTree:
        """The first ``keep`` nodes (a tree, by topological order); all when ``keep >= n``."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        if keep >= len(self.token_ids):
            return self  # frozen: nothing to copy
        return TokenTree(self.token_ids[:keep], self.parents[:keep])

    def top_nodes(self, scores: Sequence[float], n: int) -> TokenTree:
        """The ``n`` best nodes whose ancestors are all kept, renumbered topologically.

        Best-first: starting from the root's children, repeatedly keep the highest-scored
        node among the children of kept nodes (ties: lower index). When scores never
        increase along a path (e.g. cumulative path probabilities), these are the ``n``
        highest-scored nodes. ``scores`` is ``[num nodes]``.
        """
        if len(scores) != len(self.token_ids):
            raise ValueError(f"{len(scores)} scores for {len(self.token_ids)} nodes")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        frontier = [(-scores[c], c) for c in self._children[0]]
        heapq.heapify(frontier)
        kept: list[int] = []
        while frontier and len(kept) < n:
            _, node = heapq.heappop(frontier)
            kept.append(node)
            for c in self._children[node + 1]:
                heapq.heappush(frontier, (-scores[c], c))
        return self.select(kept)
