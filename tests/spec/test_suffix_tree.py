"""spec/suffix_tree.c against its plain-Python oracle, on random sequences with small
vocabularies (many repeats), appended in chunks, some removed again."""

from __future__ import annotations

import random

import pytest

from quickdraft.spec import suffix_tree
from tests.spec.suffix_tree_reference import ReferenceSuffixTree, longest_continued_match

pytestmark = pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_depth", [1, 3, 8])
def test_matches_the_reference(seed: int, max_depth: int) -> None:
    rng = random.Random(seed * 31 + max_depth)
    vocab = rng.choice([3, 5, 12])
    tree, ref = suffix_tree.SuffixTree(max_depth), ReferenceSuffixTree(max_depth)
    alive: list[int] = []
    for step in range(40):
        action = rng.random()
        if action < 0.15 and alive:
            seq = alive.pop(rng.randrange(len(alive)))
            tree.remove(seq)
            ref.remove(seq)
        else:
            seq = rng.choice(alive) if alive and action < 0.6 else step
            if seq not in alive:
                alive.append(seq)
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
            tree.append(seq, tokens)
            ref.append(seq, tokens)
        assert tree.num_nodes(live=True) == ref.num_live_nodes()
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        k, factor, min_prob = rng.randint(0, 6), rng.choice([0.5, 1.0, 2.0]), \
            rng.choice([0.0, 0.1, 0.4])
        min_match = rng.choice([1, 1, 2, 3])
        got = tree.speculate(ctx, k, factor, min_prob, min_match)
        want_tokens, want_score, want_match = ref.speculate(ctx, k, factor, min_prob, min_match)
        assert (got.tokens, got.match_len) == (want_tokens, want_match), (ctx, k, factor)
        assert got.score == pytest.approx(want_score, rel=1e-6)
        nodes = rng.choice([0, 1, 4, 16])
        tree_got = tree.speculate_tree(ctx, nodes, factor * 2, min_prob, min_match)
        t, parents, probs, m = ref.speculate_tree(ctx, nodes, factor * 2, min_prob, min_match)
        assert (tree_got.tokens, tree_got.parents, tree_got.match_len) == (t, parents, m), \
            (ctx, nodes, factor)
        assert tree_got.probs == probs  # the same float32 operations


@pytest.mark.parametrize("seed", range(3))
def test_one_token_appends_match_the_reference(seed: int) -> None:
    """The engine's pattern: a prompt, then a token or a few a step (or none), several
    sequences interleaved (each append continues from the nodes its sequence's last append
    reached), an id removed and reused; drafting from a sequence's own context
    (``speculate_tree_of``) equals drafting from that context given."""
    rng = random.Random(seed)
    tree, ref = suffix_tree.SuffixTree(24), ReferenceSuffixTree(24)
    seqs: dict[int, list[int]] = {}
    for seq in range(3):
        prompt = [rng.randrange(6) for _ in range(rng.choice([5, 30]))]
        tree.append(seq, prompt)
        ref.append(seq, prompt)
        seqs[seq] = prompt
    for step in range(150):
        seq = rng.randrange(3)
        if step == 75:
            tree.remove(seq)
            ref.remove(seq)
            seqs[seq] = []
        tokens = [rng.randrange(6) for _ in range(rng.choice([0, 1, 1, 1, 3]))]
        tree.append(seq, tokens)
        ref.append(seq, tokens)
        seqs[seq] += tokens
        assert tree.num_nodes(live=True) == ref.num_live_nodes()
        ctx = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
        got = tree.speculate_tree(ctx, 16, 4.0, 0.0, 1)
        t, parents, probs, m = ref.speculate_tree(ctx, 16, 4.0, 0.0, 1)
        assert (got.tokens, got.parents, got.probs, got.match_len) == (t, parents, probs, m)
        # a sequence's own context, its matches read from its last append's nodes
        for other, own in seqs.items():
            if not own:
                continue
            min_match = rng.choice([1, 2, 3])
            got = tree.speculate_tree_of(other, 16, 4.0, 0.0, min_match)
            t, parents, probs, m = ref.speculate_tree(own[-24:], 16, 4.0, 0.0, min_match)
            assert (got.tokens, got.parents, got.probs, got.match_len) == \
                (t, parents, probs, m), (other, step)



@pytest.mark.parametrize("seed", range(4))
def test_extend_propose_is_append_then_the_better_of_both_tries(seed: int) -> None:
    """``extend_propose`` (one native call) equals appending, drafting from the sequence's
    own context and from another trie with the same context, and keeping the draft whose
    probabilities sum higher (ties: the own trie's); a request's trie against a tenant's."""
    rng = random.Random(100 + seed)
    own, mirror = suffix_tree.SuffixTree(24), suffix_tree.SuffixTree(24)
    other = suffix_tree.SuffixTree(24)
    tenant_sequences = [[rng.randrange(5) for _ in range(rng.choice([10, 60]))]
                        for _ in range(4)]  # the tenant's earlier outputs
    for seq, tokens in enumerate(tenant_sequences):
        other.append(seq, tokens)
    prompt = [rng.randrange(5) for _ in range(rng.choice([3, 40]))]
    context = list(prompt)
    new: list[int] = prompt
    for step in range(120):
        min_match, min_prob = rng.choice([1, 2, 3]), rng.choice([0.0, 0.2])
        tenant = other if step % 3 else None
        got, from_other, longest = own.extend_propose(0, new, tenant, 16, 4.0, min_prob,
                                                      min_match)
        mirror.append(0, new)
        want = mirror.speculate_tree_of(0, 16, 4.0, min_prob, min_match)
        want_other = False
        if tenant is not None:
            alt = tenant.speculate_tree(context[-24:], 16, 4.0, min_prob, min_match)
            if sum(alt.probs) > sum(want.probs):
                want, want_other = alt, True
        assert (got.tokens, got.parents, got.probs, got.match_len, from_other) == \
            (want.tokens, want.parents, want.probs, want.match_len, want_other), step
        sequences = [context] + (tenant_sequences if tenant is not None else [])
        assert longest == longest_continued_match(context, sequences, 24, min_match), step
        new = [rng.randrange(5) for _ in range(rng.choice([0, 1, 1, 2, 4, 70]))]
        context += new
    assert own.num_nodes() == mirror.num_nodes()
    with pytest.raises(ValueError, match="append"):
        own.extend_propose(0, [3, -1], None, 4)
    with pytest.raises(ValueError, match="max_nodes"):
        own.extend_propose(0, [], other, 300)

def test_drafts_the_most_frequent_continuation() -> None:
    tree = suffix_tree.SuffixTree(8)
    tree.append(0, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    draft = tree.speculate([9, 1, 2, 3], max_tokens=3, max_spec_factor=1.0, min_token_prob=0.1)
    assert draft.tokens[0] == 4 and draft.match_len >= 3
    tree.remove(0)
    assert tree.num_nodes(live=True) == 0
    assert tree.speculate([1, 2, 3], 3).tokens == []


def test_tree_drafts_branch_where_the_context_did() -> None:
    """After "1 2" the text went on with 3 twice and with 4 once: the tree drafts 3 (2/3)
    and its sibling 4 (1/3), each followed by what came after it."""
    tree = suffix_tree.SuffixTree(8)
    tree.append(0, [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 5])
    draft = tree.speculate_tree([9, 1, 2], 8, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft.match_len == 2
    paths = {}
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        paths[i] = (*paths[parent], token) if parent >= 0 else (token,)
    assert set(paths.values()) >= {(3,), (3, 5), (4,), (4, 6)}
    assert draft.probs[0] == pytest.approx(2 / 3) and draft.tokens[0] == 3
    with pytest.raises(ValueError, match="max_nodes"):
        tree.speculate_tree([1, 2], 300)


def test_bad_input_is_refused() -> None:
    tree = suffix_tree.SuffixTree(4)
    with pytest.raises(ValueError):
        tree.append(0, [1, -2])
    with pytest.raises(KeyError):
        tree.remove(7)
    with pytest.raises(KeyError):
        tree.speculate_tree_of(7, 4)
    with pytest.raises(ValueError):
        suffix_tree.SuffixTree(0)
