"""``combined`` speculation: every model-free proposal (n-gram chain, suffix chain,
token-recycling tree) is merged into one token tree — a continuation proposed by several
sources is one path, scored by the best of them — and the step's acceptance is credited to
the source with the most expected accepted tokens."""

from __future__ import annotations

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import Speculator

# a repeated phrase: the n-gram and suffix proposers both find the continuation
PROMPT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]


def make() -> tuple[Speculator, Request]:
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=64), frozenset())
    request.num_computed_tokens = request.num_tokens - 1
    return spec, request


def test_shared_continuations_merge_into_one_path_and_the_best_source_is_credited():
    spec, request = make()
    ngram = spec._chain(request, "ngram", spec._ngram(request, 4))
    assert spec.suffix is not None  # (the suffix trie builds with gcc)
    suffix = spec._chain(request, "suffix", spec.suffix.propose(request, 4).tokens)
    assert ngram is not None and suffix is not None and ngram.tree is not None
    for favoured in ("ngram", "suffix"):
        for source in ("ngram", "suffix"):
            spec._tracker(request, source).alpha = 0.9 if source == favoured else 0.2
        merged = spec._combined(request, 4)
        assert merged is not None and merged.tree is not None
        # both found 8 9 10 11 after "... 6 7": one chain, not two
        assert merged.tree.is_chain and merged.tree.token_ids == ngram.tree.token_ids
        assert merged.scores == [0.9 ** d for d in range(1, len(merged.scores) + 1)]
        assert merged.source == favoured
        assert merged.tracker is spec._tracker(request, favoured)


def test_different_continuations_branch():
    spec, request = make()
    spec.suffix = None
    recycling_tree = ([1, 3], [-1, -1], [0, 1])  # two root children: 1 (top-1) and 3

    class Table:
        @staticmethod
        def propose_tree(req: Request, max_nodes: int) -> tuple[list[int], list[int], list[int]]:
            return recycling_tree

    spec.recycling = Table()  # type: ignore[assignment]
    merged = spec._combined(request, 4)
    assert merged is not None and merged.tree is not None
    tree = merged.tree
    root_children = [tree.token_ids[c] for c in tree.children(-1)]
    assert sorted(root_children) == [1, 3, 8]  # n-gram's 8 ..., recycling's 1 and 3
    assert all(s <= 1.0 for s in merged.scores)
    for node, parent in enumerate(tree.parents):  # never more likely than its parent
        if parent >= 0:
            assert merged.scores[node] <= merged.scores[parent]


def test_nothing_to_draft_and_no_draft_model_gives_no_candidate():
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), frozenset())
    request.num_computed_tokens = 2
    assert spec._candidate(request, 4) is None


def test_a_tree_never_outgrows_the_room_the_scheduler_leaves():
    """Near the context limit or max_tokens the scheduler leaves little room: a tree's node
    count (and so its depth) stays within it, and within a request's own k."""
    from quickdraft.spec.params import SpeculationParams

    spec = Speculator("recycling", max_k=4, ngram_min=2, ngram_max=4,
                      policy=SpeculationPolicy())
    chain = list(range(10, 20))

    class Table:
        @staticmethod
        def propose_tree(req: Request, max_nodes: int) -> tuple[list[int], list[int], list[int]]:
            return chain, list(range(-1, 9)), [0] * 10  # a 10-deep chain-shaped "tree"

    spec.recycling = Table()  # type: ignore[assignment]
    for room, k, want in ((2, None, 2), (16, 3, 3), (0, None, 0)):
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), frozenset(),
                          spec_params=SpeculationParams(k=k) if k is not None else None)
        request.num_computed_tokens = 2
        request.spec_state.tracker("recycling").alpha = 0.99
        spec.plan([request], [room], num_plain_tokens=1, budget=64)
        assert len(request.spec_token_ids) == want
        spec.cancel(request)
