"""Tests for spec.tree_verification: exact greedy walks, agreement with the chain verifier,
reproducibility, logprobs, and chi-square checks that sampled trees are lossless."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from quickdraft.engine.sampler import SamplingBatch, apply_temperature_and_filters, sample
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.rejection_sampler import rejection_sample
from quickdraft.spec.token_tree import TokenTree
from quickdraft.spec.tree_verification import TreeVerifyOutput, tree_node_rows, verify_trees
from tests.spec.test_rejection_sampler import GREEDY, NGRAM_TOKENS, make_batch, peaked_rows, seeded
from tests.spec.test_token_tree import random_tree
from tests.spec.token_trees import merge_chains


def brute_greedy(tree: TokenTree, rows: torch.Tensor) -> tuple[list[int], int]:
    """The accepted nodes and final token of a greedy walk over ``rows`` ``[n + 1, V]``."""
    node, path = -1, list[int]()
    while True:
        t = int(rows[node + 1].argmax())
        match = [i for i in range(len(tree))
                 if tree.parents[i] == node and tree.token_ids[i] == t]
        if not match:
            return path, t
        node = match[0]
        path.append(node)


def test_greedy_matches_a_brute_force_walk() -> None:
    rng = random.Random(0)
    for it in range(30):
        vocab = rng.choice([2, 3, 5])
        trees = [random_tree(rng, rng.randrange(0, 20), vocab) for _ in range(8)]
        logits = torch.randn(sum(t.num_rows for t in trees), vocab, generator=seeded(it))
        out = verify_trees(logits, trees, make_batch([GREEDY] * len(trees)))
        start = 0
        for b, tree in enumerate(trees):
            path, final = brute_greedy(tree, logits[start:start + tree.num_rows])
            assert out.accepted_nodes[b] == path
            assert out.token_ids[b] == [*(tree.token_ids[i] for i in path), final]
            assert out.num_accepted[b] == len(path)
            start += tree.num_rows
        assert out.logprobs is None


@pytest.mark.parametrize("logprobs", [False, True])
def test_all_greedy_batches_equal_the_general_path(logprobs: bool) -> None:
    """An all-greedy batch skips the torch layout: its walks, tokens and logprobs equal
    those of the same requests verified beside a sampled one (the general path)."""
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0, logprobs=logprobs)
    for it in range(20):
        vocab = rng.choice([3, 5, 40])
        trees = [random_tree(rng, rng.randrange(0, 12), vocab) for _ in range(4)]
        rows = sum(t.num_rows for t in trees)
        logits = torch.randn(rows + 3, vocab, generator=seeded(it)).round()  # ties too
        alone = verify_trees(logits[:rows], trees, make_batch([greedy] * 4))
        mixed = verify_trees(logits, [*trees, TokenTree.from_chain([1, 0])],
                             make_batch([greedy] * 4 + [SamplingParams(temperature=1.0)],
                                        default_generator=seeded(it)))
        assert alone.token_ids == mixed.token_ids[:4]
        assert alone.accepted_nodes == mixed.accepted_nodes[:4]
        if logprobs:
            assert alone.logprobs is not None and mixed.logprobs is not None
            assert alone.logprobs == mixed.logprobs[:4]


def test_tree_node_rows_are_the_parent_rows() -> None:
    trees = [TokenTree((4, 5, 6), (-1, -1, 0)), TokenTree(), TokenTree.from_chain([1, 2])]
    assert tree_node_rows(trees) == [0, 0, 1, 5, 6]


@pytest.mark.parametrize("sampled", [False, True])
def test_chains_equal_the_chain_verifier(sampled: bool) -> None:
    """Greedy: token for token. Sampled one-hot chains: same draws, hence same output."""
    rng = random.Random(1)
    for it in range(25):
        vocab = rng.choice([3, 8])
        chains = [[rng.randrange(vocab) for _ in range(rng.randrange(6))] for _ in range(6)]
        params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]),
                                 top_k=rng.choice([0, 2]), seed=rng.choice([None, it]))
                  if sampled and rng.random() < 0.8 else GREEDY for _ in chains]
        logits = 3 * torch.randn(sum(len(c) + 1 for c in chains), vocab, generator=seeded(it))

        def batch(params: list[SamplingParams] = params, it: int = it) -> SamplingBatch:
            gens = [seeded(it * 100 + b) if p.seed is not None else None
                    for b, p in enumerate(params)]
            return make_batch(params, gens, default_generator=seeded(it))

        expected = rejection_sample(logits, chains, None, batch())
        out = verify_trees(logits, [TokenTree.from_chain(c) for c in chains], batch())
        assert out.token_ids == expected.token_ids
        assert out.num_accepted == expected.num_accepted
        assert out.accepted_nodes == [list(range(n)) for n in expected.num_accepted]


def test_mixed_batch_greedy_sampled_and_empty_trees() -> None:
    top1 = SamplingParams(temperature=0.8, top_k=1)  # p is one-hot at the argmax
    trees = [TokenTree((1, 2, 3), (-1, -1, 1)),  # greedy: accepts nodes 1, 2, bonus
             TokenTree(),  # greedy plain decode
             TokenTree((4, 0, 1), (-1, -1, 1)),  # sampled: node 0 rejected, node 1 accepted
             TokenTree(),  # sampled plain decode
             TokenTree((1, 2), (-1, -1))]  # sampled: every child rejected
    argmaxes = [2, 0, 3, 4,  0,  0, 1, 3, 2,  2,  4, 0, 0]
    params = [GREEDY, GREEDY, top1, top1, top1]
    gens = [None, None, seeded(1), None, seeded(2)]
    out = verify_trees(peaked_rows(argmaxes), trees, make_batch(params, gens))
    assert out == TreeVerifyOutput(token_ids=[[2, 3, 4], [0], [0, 3], [2], [4]],
                                   accepted_nodes=[[1, 2], [], [1], [], []],
                                   num_accepted=[2, 0, 1, 0, 0])


def test_empty_trees_next_to_trees_are_the_engine_sampler() -> None:
    """An empty tree is a plain decode step, penalties and seeds included, whatever else
    is in the batch."""
    penalised = [SamplingParams(temperature=1.2, top_k=7, repetition_penalty=1.3, seed=2),
                 SamplingParams(temperature=0.0, frequency_penalty=1.5, logprobs=True)]
    plain = [[4, 4, 5], [6, 6]]  # the penalised requests' outputs so far
    trees = [TokenTree(), merge_chains([[1, 2], [3]]), TokenTree(), TokenTree.from_chain([5])]
    params = [penalised[0], SamplingParams(seed=9), penalised[1], GREEDY]
    logits = torch.randn(8, 32, generator=seeded(0))
    for seed in range(5):
        out = verify_trees(logits, trees, make_batch(
            params, [seeded(seed), seeded(seed + 1), None, None],
            outputs=[plain[0], [], plain[1], []], default_generator=seeded(seed + 2)))
        expected = sample(logits[[0, 5]], make_batch(penalised, [seeded(seed), None],
                                                     outputs=plain))
        assert [out.token_ids[0], out.token_ids[2]] == [[t] for t in expected.token_ids.tolist()]
        assert out.logprobs is not None and expected.logprobs is not None
        assert [out.logprobs[0][0], out.logprobs[2][0]] == pytest.approx(
            expected.logprobs.tolist())


def test_logprobs_are_raw_log_softmax_at_each_emitted_row() -> None:
    trees = [TokenTree((0, 1, 2, 3), (-1, -1, 0, 1)), merge_chains([[1, 2], [0]])]
    logits = torch.randn(9, 4, generator=seeded(3))
    logits[0, 1] = logits[2, 3] = logits[5, 1] = logits[6, 2] = 9.0  # likely 1 -> 3; 1 -> 2
    params = [SamplingParams(temperature=2.0, logprobs=True), GREEDY]
    out = verify_trees(logits, trees, make_batch(params, default_generator=seeded(0)))
    assert out.logprobs is not None
    log_probs = torch.log_softmax(logits, dim=-1)
    for tree, nodes, tokens, values, start in zip(
            trees, out.accepted_nodes, out.token_ids, out.logprobs, [0, 5], strict=True):
        rows = [start + 1 + tree.parents[i] for i in nodes]
        rows.append(start + 1 + (nodes[-1] if nodes else -1))
        assert values == pytest.approx([log_probs[r, t].item()
                                        for r, t in zip(rows, tokens, strict=True)], abs=1e-6)
    assert out.token_ids[1] == [1, 2, int(logits[7].argmax())]


def test_seeded_request_reproducible_alone_or_batched() -> None:
    params = SamplingParams(temperature=1.5, seed=11)
    tree = merge_chains([[1, 2, 3], [1, 4], [5], [0, 0]])
    target = torch.randn(tree.num_rows, 8, generator=seeded(5))  # [n + 1, V]
    alone = [verify_trees(target, [tree], make_batch([params], [seeded(s)])) for s in range(30)]
    others = torch.randn(4, 8, generator=seeded(8))
    for s in range(30):
        batched = verify_trees(
            torch.cat([others[:1], target, others[1:]]),
            [TokenTree(), tree, TokenTree.from_chain([7, 6])],
            make_batch([SamplingParams(), params, SamplingParams(temperature=0.5)],
                       [None, seeded(s), None], default_generator=seeded(100 + s)))
        assert batched.token_ids[1] == alone[s].token_ids[0]
        assert batched.accepted_nodes[1] == alone[s].accepted_nodes[0]
    assert len({tuple(o.token_ids[0]) for o in alone}) > 1  # the seed matters
    again = verify_trees(target, [tree], make_batch([params], [seeded(3)]))
    assert again == alone[3]


@pytest.mark.parametrize(("rows", "trees", "params", "match"), [
    (3, [TokenTree.from_chain([1])], GREEDY, "target rows"),
    (2, [TokenTree.from_chain([5])], GREEDY, "vocabulary"),
    (2, [TokenTree.from_chain([1])], SamplingParams(presence_penalty=0.5), "penalties"),
])
def test_bad_inputs_are_refused(rows: int, trees: list[TokenTree], params: SamplingParams,
                                match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verify_trees(torch.zeros(rows, 5), trees, make_batch([params]))


def test_empty_batch() -> None:
    out = verify_trees(torch.zeros(0, 5), [], make_batch([]))
    assert out == TreeVerifyOutput(token_ids=[], accepted_nodes=[], num_accepted=[])


# ---------------------------------------------------------------------------------------
# Statistics: the first token and the first two tokens follow the target
# ---------------------------------------------------------------------------------------

VOCAB = 6
ROOT = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])  # [V] the root row
SECOND = 1.5 * torch.randn(VOCAB, VOCAB, generator=seeded(20))  # [V, V] row after token a
DEEPER = torch.randn(VOCAB, VOCAB, generator=seeded(21))  # [V, V] rows of depth >= 2 nodes
FILTERS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
}
NUM_TRIALS = 4000


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``softmax`` of ``logits`` ``[N, V]`` after the request's temperature and filters."""
    n = logits.shape[0]
    return torch.softmax(apply_temperature_and_filters(
        logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
        torch.full((n,), params.top_p), torch.full((n,), params.min_p)), dim=-1)


def tree_logits(tree: TokenTree) -> torch.Tensor:
    """``[n + 1, V]`` target rows: the root, SECOND[a] after a first token a, else DEEPER."""
    rows = [ROOT, *(SECOND[t] if d == 1 else DEEPER[t]
                    for t, d in zip(tree.token_ids, tree.depths, strict=True))]
    return torch.stack(rows)


def make_trees(shape: str, params: SamplingParams, n: int, gen: torch.Generator) -> list[TokenTree]:
    p1, p2 = processed(ROOT.unsqueeze(0), params)[0], processed(SECOND, params)  # [V], [V, V]
    if shape == "good":  # the two likeliest first tokens, each with its two likeliest next
        firsts = p1.argsort(descending=True)[:2].tolist()
        chains = [[a, b] for a in firsts for b in p2[a].argsort(descending=True)[:2].tolist()]
        return [merge_chains(chains)] * n
    if shape == "bad":  # the two least likely first tokens, each with its least likely next
        firsts = ROOT.argsort()[:2].tolist()
        return [merge_chains([[a, int(SECOND[a].argmin())] for a in firsts])] * n
    if shape == "chain":  # one-hot chains of two tokens, skewed unlike the target
        drafts = torch.multinomial(NGRAM_TOKENS, n, replacement=True, generator=gen).T
        return [TokenTree.from_chain(c) for c in drafts.tolist()]
    assert shape == "siblings"  # four siblings at the root, two of them with children
    return [merge_chains([[3, 2], [0, 0], [0, 4], [5], [1]])] * n


def check_counts(codes: list[int], expected: torch.Tensor, what: str) -> None:
    """Chi-square of observed ``codes`` against ``expected`` ``[C]`` probabilities; cells
    expecting fewer than 5 draws are pooled; zero-probability cells must never occur."""
    counts = torch.bincount(torch.tensor(codes), minlength=expected.numel()).double()
    support = expected > 0
    assert int(counts[~support].sum()) == 0, f"{what}: filtered-out tokens drawn"
    exp = expected[support].double()
    exp = exp / exp.sum() * len(codes)
    obs = counts[support]
    small = exp < 5
    if bool(small.any()):
        exp = torch.cat([exp[~small], exp[small].sum().unsqueeze(0)])
        obs = torch.cat([obs[~small], obs[small].sum().unsqueeze(0)])
    assert chisquare(obs, exp).pvalue > 1e-3, (what, obs.tolist(), exp.tolist())


def first_two_tokens(params: SamplingParams, trees: list[TokenTree],
                     generators: list[torch.Generator | None] | None,
                     gen: torch.Generator) -> list[tuple[int, int]]:
    """Verify ``trees``; where only one token came out, a plain decode step gives the next."""
    n = len(trees)
    batch = make_batch([params] * n, generators, default_generator=gen)
    out = verify_trees(torch.cat([tree_logits(t) for t in trees]), trees, batch)
    short = [b for b, t in enumerate(out.token_ids) if len(t) == 1]
    step = verify_trees(SECOND[[out.token_ids[b][0] for b in short]], [TokenTree()] * len(short),
                        make_batch([params] * len(short), default_generator=gen))
    seconds = dict(zip(short, (t[0] for t in step.token_ids), strict=True))
    return [(t[0], t[1] if len(t) > 1 else seconds[b]) for b, t in enumerate(out.token_ids)]


def check_first_two(params: SamplingParams, pairs: list[tuple[int, int]]) -> None:
    p1 = processed(ROOT.unsqueeze(0), params)[0]  # [V]
    joint = p1.unsqueeze(1) * processed(SECOND, params)  # [V, V] P(a) P(b | a)
    check_counts([a for a, _ in pairs], p1, "first token")
    check_counts([a * VOCAB + b for a, b in pairs], joint.flatten(), "first two tokens")


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("shape", ["good", "bad", "chain", "siblings"])
def test_sampled_trees_follow_the_target(filters: str, shape: str) -> None:
    params = FILTERS[filters]
    gen = seeded(len(filters) * 10 + len(shape))
    trees = make_trees(shape, params, NUM_TRIALS, gen)
    check_first_two(params, first_two_tokens(params, trees, None, gen))


def test_seeded_generators_give_the_target_distribution() -> None:
    params = SamplingParams(temperature=1.1, top_p=0.9)
    gen = seeded(7)
    n = 3000
    trees = make_trees("siblings", params, n, gen)
    check_first_two(params, first_two_tokens(params, trees, [seeded(i) for i in range(n)], gen))


def test_good_trees_accept_more_than_bad_ones() -> None:
    params = FILTERS["temperature"]
    gen = seeded(8)
    accepted = {}
    for shape in ("good", "bad"):
        trees = make_trees(shape, params, 2000, gen)
        out = verify_trees(torch.cat([tree_logits(t) for t in trees]), trees,
                           make_batch([params] * 2000, default_generator=gen))
        accepted[shape] = sum(out.num_accepted) / 2000
    assert accepted["good"] > 1.0 > 0.2 > accepted["bad"]
