"""Tests for spec.token_tree: validation, structure, masks, positions, merging and pruning."""

from __future__ import annotations

import random

import pytest

from quickdraft.spec.token_tree import MAX_TREE_NODES, TokenTree
from tests.spec.token_trees import merge_chains, path_tokens

# root -> 5 (0) -> 7 (1) -> 9 (3)
#      -> 6 (2) -> 7 (4)
#               -> 8 (5)
TREE = TokenTree((5, 7, 6, 9, 7, 8), (-1, 0, -1, 1, 2, 2))


def random_tree(rng: random.Random, n: int, vocab: int = 6) -> TokenTree:
    """A random valid tree of at most ``n`` nodes (duplicate siblings are skipped)."""
    tokens: list[int] = []
    parents: list[int] = []
    seen: set[tuple[int, int]] = set()
    for _ in range(n):
        parent, token = rng.randrange(-1, len(tokens)), rng.randrange(vocab)
        if (parent, token) not in seen:
            seen.add((parent, token))
            tokens.append(token)
            parents.append(parent)
    return TokenTree(tuple(tokens), tuple(parents))


def brute_ancestors(tree: TokenTree, node: int) -> set[int]:
    """Rows that node ``node``'s row sees: itself, its ancestors and the root (row 0)."""
    rows = {0}
    while node >= 0:
        rows.add(node + 1)
        node = tree.parents[node]
    return rows


@pytest.mark.parametrize(("tokens", "parents", "match"), [
    ((1, 2), (-1,), "2 token ids but 1 parents"),
    ((1, 2), (-1, 1), "parent 1 must be -1"),
    ((1, 2), (-1, -2), "parent -2"),
    ((1,), (0,), "parent 0 must be -1"),
    ((1, 1), (-1, -1), "already has a child with token 1"),
    ((1, 2, 2), (-1, 0, 0), "already has a child with token 2"),
    ((-3,), (-1,), "negative token"),
    (tuple(range(MAX_TREE_NODES + 1)), tuple([-1] * (MAX_TREE_NODES + 1)), "at most 63"),
])
def test_invalid_trees_are_refused(
    tokens: tuple[int, ...], parents: tuple[int, ...], match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        TokenTree(tokens, parents)


def test_construction_coerces_to_tuples_and_compares_by_value() -> None:
    tree = TokenTree([5, 7], [-1, 0])  # type: ignore[arg-type]
    assert tree.token_ids == (5, 7) and tree.parents == (-1, 0)
    assert tree == TokenTree.from_chain([5, 7])
    assert hash(tree) == hash(TokenTree.from_chain((5, 7)))
    full = TokenTree(tuple(range(MAX_TREE_NODES)), tuple([-1] * MAX_TREE_NODES))
    assert len(full) == 63 and full.num_rows == 64
    with pytest.raises(TypeError):
        TokenTree((1.5,), (-1,))  # type: ignore[arg-type]


def test_structure_of_a_small_tree() -> None:
    assert len(TREE) == 6 and TREE.num_rows == 7
    assert TREE.depths == (1, 2, 1, 3, 2, 2)
    assert TREE.max_depth == 3
    assert not TREE.is_chain
    assert TREE.children(-1) == (0, 2)
    assert TREE.children(2) == (4, 5)
    assert TREE.children(3) == ()
    assert TREE.path_to(3) == (0, 1, 3)
    assert TREE.path_to(-1) == ()
    assert path_tokens(TREE, 5) == (6, 8)
    with pytest.raises(IndexError):
        TREE.children(6)
    with pytest.raises(IndexError):
        TREE.path_to(-2)


def test_empty_tree_and_chains() -> None:
    empty = TokenTree()
    assert len(empty) == 0 and empty.num_rows == 1 and empty.is_chain
    assert empty.row_masks() == [1] and empty.positions(10) == [10]
    assert empty.depths == () and empty.max_depth == 0 and empty.children(-1) == ()
    chain = TokenTree.from_chain([3, 3, 1])
    assert chain.parents == (-1, 0, 1) and chain.is_chain
    assert chain.depths == (1, 2, 3)
    assert chain.row_masks() == [0b1, 0b11, 0b111, 0b1111]
    assert chain.positions(4) == [4, 5, 6, 7]
    assert not TokenTree((1, 2), (-1, -1)).is_chain


def test_row_masks_and_positions_match_a_brute_force_walk() -> None:
    rng = random.Random(0)
    for _ in range(200):
        tree = random_tree(rng, rng.randrange(0, MAX_TREE_NODES + 1), vocab=rng.choice([2, 50]))
        masks = tree.row_masks()
        assert len(masks) == tree.num_rows and masks[0] == 1
        for i in range(len(tree)):
            bits = {j for j in range(tree.num_rows) if masks[i + 1] >> j & 1}
            assert bits == brute_ancestors(tree, i)
            assert masks[i + 1] < 1 << (i + 2)  # no bit above the row itself
            assert tree.depths[i] == len(tree.path_to(i))
        base = rng.randrange(100)
        assert tree.positions(base) == [base, *(base + len(brute_ancestors(tree, i)) - 1
                                                for i in range(len(tree)))]
    full = TokenTree.from_chain(range(MAX_TREE_NODES))
    assert full.row_masks()[-1] == (1 << 64) - 1  # the top row has all 64 bits


def test_merge_shares_prefixes_in_first_seen_order() -> None:
    tree = merge_chains([[5, 7, 9], [6, 7], [5, 7, 1], [6, 8], [5], []])
    assert tree.token_ids == (5, 7, 9, 6, 7, 1, 8)
    assert tree.parents == (-1, 0, 1, -1, 3, 1, 3)
    for chain in ([5, 7, 9], [6, 7], [5, 7, 1], [6, 8], [5]):
        leaf = next(i for i in range(len(tree)) if path_tokens(tree, i) == tuple(chain))
        assert tree.path_to(leaf)[-1] == leaf
    assert merge_chains([]) == TokenTree()
    assert merge_chains([[1, 2, 3]]) == TokenTree.from_chain([1, 2, 3])
    assert merge_chains([[1, 2], [1, 2]]) == TokenTree.from_chain([1, 2])


def test_merge_stops_at_the_node_limit() -> None:
    chains = [[i, i + 100, i + 200] for i in range(30)]  # 90 distinct nodes
    tree = merge_chains(chains)
    assert len(tree) == MAX_TREE_NODES
    assert tree == merge_chains(chains[:21])  # 21 whole chains = 63 nodes
    small = merge_chains([[1, 2, 3], [1, 4, 5]], max_nodes=4)
    assert small.token_ids == (1, 2, 3, 4) and small.parents == (-1, 0, 1, 0)
    with pytest.raises(ValueError, match="max_nodes"):
        merge_chains([[1]], max_nodes=64)


def test_merge_of_random_chains_holds_every_chain() -> None:
    rng = random.Random(1)
    for _ in range(100):
        chains = [[rng.randrange(3) for _ in range(rng.randrange(5))] for _ in range(6)]
        tree = merge_chains(chains)
        paths = {path_tokens(tree, i) for i in range(len(tree))}
        prefixes = {tuple(c[:j]) for c in chains for j in range(1, len(c) + 1)}
        assert paths == prefixes  # every path is a prefix of a chain and vice versa
        assert len(paths) == len(tree)  # no path twice


def test_prune_keeps_a_prefix() -> None:
    assert TREE.prune(3) == TokenTree((5, 7, 6), (-1, 0, -1))
    assert TREE.prune(0) == TokenTree()
    assert TREE.prune(100) == TREE
    with pytest.raises(ValueError):
        TREE.prune(-1)


def test_select_renumbers_and_requires_ancestors() -> None:
    assert TREE.select([5, 2, 0]) == TokenTree((5, 6, 8), (-1, -1, 1))
    with pytest.raises(ValueError, match="without its parent"):
        TREE.select([3, 0])
    with pytest.raises(IndexError):
        TREE.select([7])


def test_top_nodes_is_best_first() -> None:
    scores = [0.5, 0.4, 0.45, 0.3, 0.2, 0.44]
    assert TREE.top_nodes(scores, 3) == TREE.select([0, 2, 5])
    assert TREE.top_nodes(scores, 0) == TokenTree()
    assert TREE.top_nodes(scores, 6) == TREE
    # A high score below a low one waits for its parent.
    assert TREE.top_nodes([0.1, 0.9, 0.2, 0.9, 0.0, 0.0], 2) == TREE.select([2, 0])
    with pytest.raises(ValueError, match="scores"):
        TREE.top_nodes([1.0], 1)


def test_top_nodes_with_path_probabilities_keeps_the_global_best() -> None:
    rng = random.Random(2)
    for _ in range(100):
        tree = random_tree(rng, 30)
        scores: list[float] = []
        for parent in tree.parents:  # decreasing along every path, all distinct
            scores.append((1.0 if parent < 0 else scores[parent]) * rng.uniform(0.1, 0.99))
        n = rng.randrange(len(tree) + 1)
        pruned = tree.top_nodes(scores, n)
        best = sorted(range(len(tree)), key=lambda i: -scores[i])[:n]
        assert pruned == tree.select(best)
        assert len(pruned) == n
