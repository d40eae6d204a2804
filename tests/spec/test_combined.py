"""``combined`` speculation: per request and step, the proposal expected to accept the most
drafts, the suffix tries' tree (free to draft) or the draft head's / draft model's chain at
its acceptance; a source's first tracker in a request starts from the pooled estimate over
earlier requests."""

from __future__ import annotations

import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import suffix_tree
from quickdraft.spec.policy import SpeculationPolicy, expected_accepted
from quickdraft.spec.speculator import Speculator

# a repeated phrase: the suffix trie finds the continuation
PROMPT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]


def make(prompt: list[int] = PROMPT, rid: str = "r") -> tuple[Speculator, Request]:
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    spec.proposers.draft_model = object()  # type: ignore[assignment]  # (only its presence matters here)
    return spec, _request(prompt, rid)


def _request(prompt: list[int], rid: str) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=64), frozenset())
    request.num_computed_tokens = request.num_tokens - 1
    return request


@pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")
def test_the_suffix_tree_unless_the_model_chain_expects_more():
    spec, request = make()
    tree = spec._candidate(request, 4)  # the pooled priors are alike: the free tree wins
    assert tree is not None and tree.source == "suffix" and tree.tree is not None
    assert tree.tree.token_ids[:4] == (8, 9, 10, 11)
    model = spec.proposers.tracker(request, "draft")
    for alpha, want in ((0.99, "draft"), (0.2, "suffix")):
        model.alpha = alpha
        picked = spec._candidate(request, 4)
        assert picked is not None and picked.source == want
        if want == "draft":
            assert picked.tree is None and picked.available == 4
            assert expected_accepted(alpha, 4) > sum(sorted(tree.scores)[-4:])


def test_the_model_chain_when_the_tries_match_nothing():
    spec, request = make([1, 2, 3, 4, 5, 6, 7])
    picked = spec._candidate(request, 4)
    assert picked is not None and picked.source == "draft" and picked.tree is None


def test_a_new_request_starts_from_the_pooled_acceptance():
    spec, first = make([1, 2, 3, 4, 5, 6, 7])
    spec.plan([first], [4], num_plain_tokens=1, budget=64)
    assert first.spec_state.model_k > 0  # the draft model owes drafts
    before = spec.proposers.pool("draft").alpha
    first.spec_state.model_k = 0
    spec.record(first, 4, 0)  # all rejected
    assert spec.proposers.tracker(first, "draft").alpha < before
    assert spec.proposers.pool("draft").alpha < before  # the pool moved with it (more slowly)
    second = _request([1, 2, 3, 4, 5, 6, 7], "s")
    assert spec.proposers.tracker(second, "draft").alpha == spec.proposers.pool("draft").alpha
    assert spec.proposers.tracker(second, "draft") is not spec.proposers.tracker(first, "draft")


def test_nothing_to_draft_and_no_draft_model_gives_no_candidate():
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    assert spec._candidate(_request([1, 2, 3], "r"), 4) is None


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

    spec.proposers.recycling = Table()  # type: ignore[assignment]
    for room, k, want in ((2, None, 2), (16, 3, 3), (0, None, 0)):
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), frozenset(),
                          spec_params=SpeculationParams(k=k) if k is not None else None)
        request.num_computed_tokens = 2
        request.spec_state.tracker("recycling").alpha = 0.99
        spec.plan([request], [room], num_plain_tokens=1, budget=64)
        assert len(request.spec_token_ids) == want
        spec.cancel(request)


def test_a_seeded_sampled_request_starts_from_the_fixed_prior():
    """Its output must depend on its seed and prompt alone, not on earlier requests."""
    from quickdraft.spec.policy import AcceptanceTracker

    spec, greedy = make([1, 2, 3, 4, 5, 6, 7])
    spec.proposers.pool("draft").alpha = 0.1
    seeded = Request("s", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.8, seed=1),
                     frozenset())
    unseeded = Request("u", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.8),
                       frozenset())
    assert spec.proposers.tracker(greedy, "draft").alpha == 0.1
    assert spec.proposers.tracker(unseeded, "draft").alpha == 0.1
    assert spec.proposers.tracker(seeded, "draft").alpha == AcceptanceTracker.alpha


def test_head_features_are_kept_in_order_and_restart_after_a_gap():
    """Feature rows arrive a step at a time and are joined only when the head drafts."""
    import torch

    from quickdraft.spec.state import RequestSpecState

    state = RequestSpecState()
    assert state.head_features() is None
    rows = torch.arange(12.0).reshape(6, 2)
    state.add_features(10, rows[:3])
    state.add_features(13, rows[3:4])
    state.add_features(14, rows[4:])
    assert len(state.head_feature_chunks) == 3 and state.num_head_features == 6
    feats = state.head_features()
    assert feats is not None and torch.equal(feats, rows) and state.head_features_start == 10
    state.add_features(20, rows[:1])  # a gap: only the new rows are kept
    assert state.head_features_start == 20 and state.num_head_features == 1
    state.drop_features(21)
    assert state.head_features() is None and state.head_features_start == 21


@pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")
def test_a_model_chain_that_does_not_pay_falls_back_to_the_free_tree():
    """combined keeps the suffix tree beside a better-expected model chain; when drafting
    with the model costs more than it returns this step, the tree is verified instead of
    nothing."""
    from quickdraft.spec.step_cost import StepCost

    spec, request = make()
    spec.proposers.tracker(request, "draft").alpha = 0.99
    picked = spec._candidate(request, 4)
    assert picked is not None and picked.source == "draft" and picked.fallback is not None
    spec.policy = SpeculationPolicy(draft_cost=StepCost((1, 16), (10.0, 10.0)))
    spec.plan([request], [4], num_plain_tokens=1, budget=64)
    assert request.spec_state.model_k == 0  # the model drafts nothing ...
    assert request.spec_token_ids[:4] == [8, 9, 10, 11]  # ... the tree is verified
    assert request.spec_state.in_flight_source.startswith("suffix")
