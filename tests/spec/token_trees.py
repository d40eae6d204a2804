"""Test helpers that build token trees from chains of candidate continuations (the
production proposers build their trees directly)."""

from __future__ import annotations

from collections.abc import Sequence

from quickdraft.spec.token_tree import MAX_TREE_NODES, TokenTree


def merge_chains(chains: Sequence[Sequence[int]], max_nodes: int = MAX_TREE_NODES) -> TokenTree:
    """The trie union of ``chains``: shared prefixes become one path, nodes numbered in
    first-seen order (chain by chain, token by token); once ``max_nodes`` nodes exist the
    rest is dropped (a prefix of a topological order is still a tree)."""
    if not 0 <= max_nodes <= MAX_TREE_NODES:
        raise ValueError(f"max_nodes must be in [0, {MAX_TREE_NODES}], got {max_nodes}")
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    for chain in chains:
        node = -1
        for token in chain:
            child = index.get((node, token))
            if child is None:
                if len(tokens) == max_nodes:
                    break
                child = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = child
    return TokenTree(tuple(tokens), tuple(parents))


def path_tokens(tree: TokenTree, node: int) -> tuple[int, ...]:
    """The tokens along ``tree.path_to(node)``: the continuation that node drafts."""
    return tuple(tree.token_ids[i] for i in tree.path_to(node))
