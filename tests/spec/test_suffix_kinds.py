"""Suffix drafts are scored by the acceptance of their kind: how long a context suffix they
continue. A request's estimate per kind starts from the estimate over earlier requests."""

from __future__ import annotations

import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.proposals import POOLED_DECAY, match_kind
from quickdraft.spec.speculator import Speculator

# "1 2 3 4 5 6 7 8 9 10 11 12" then its first 9 tokens again: a 9-token match
LONG = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 1, 2, 3, 4, 5, 6, 7, 8, 9]
# "... 20 21 22 ..." then "20 21": a 2-token match
SHORT = [20, 21, 22, 23, 30, 31, 32, 20, 21]


def request(rid: str, prompt: list[int]) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64), frozenset())
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_match_kinds():
    assert [match_kind(n) for n in (1, 2, 3, 4, 7, 8, 24)] == [
        "suffix/1-3", "suffix/1-3", "suffix/1-3", "suffix/4-7", "suffix/4-7", "suffix/8+",
        "suffix/8+"]


def test_a_copy_run_under_way_is_its_own_kind():
    assert match_kind(2, after_full=True) == "suffix/1-3+run"
    assert match_kind(9, public=True, after_full=True) == "corpus/8++run"


def test_a_fully_accepted_verification_makes_the_next_drafts_run_kinds():
    spec = Speculator("suffix", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    if spec.suffix is None:
        pytest.skip("the suffix trie needs gcc")
    req = request("a", LONG)
    state = req.spec_state
    assert spec.proposers._suffix_tree(req).tracker is state.trackers["suffix/8+"]
    state.in_flight_depth = 3
    spec.record(req, num_drafted=3, num_accepted=3)  # every draft accepted: a run
    assert state.after_full
    assert spec.proposers._suffix_tree(req).tracker is state.trackers["suffix/8++run"]
    state.in_flight_depth = 3
    spec.record(req, num_drafted=3, num_accepted=2)
    assert not state.after_full
    spec.record(req, num_drafted=0, num_accepted=0)  # a step without drafts ends a run too
    assert not state.after_full
    state.after_full = True
    state.on_preempt()
    assert not state.after_full


ROUNDS = 30


def test_drafts_are_scored_by_their_kinds_acceptance_and_new_requests_start_from_the_pool():
    spec = Speculator("suffix", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    if spec.suffix is None:
        pytest.skip("the suffix trie needs gcc")
    long_req, short_req = request("a", LONG), request("b", SHORT)
    long_draft = spec.proposers._suffix_tree(long_req)
    short_draft = spec.proposers._suffix_tree(short_req)
    assert long_draft is not None and short_draft is not None
    assert long_draft.tree is not None and long_draft.tree.token_ids[0] == 10
    assert short_draft.tree is not None and short_draft.tree.token_ids[0] == 22
    long_tracker = long_req.spec_state.trackers["suffix/8+"]
    assert long_draft.tracker is long_tracker
    assert short_draft.tracker is short_req.spec_state.trackers["suffix/1-3"]
    assert long_draft.source == short_draft.source == "suffix"  # (credited to the source)
    # long matches keep being accepted, short ones rejected: the chains' scores follow
    # (once the pool's say in the requests' estimates has faded: spec.policy.POOL_STRENGTH)
    for _ in range(ROUNDS):
        long_tracker.update(num_drafted=3, num_accepted=3)
        short_draft.tracker.update(num_drafted=3, num_accepted=0)
    proposers = spec.proposers
    long_again = proposers._suffix_tree(long_req)
    short_again = proposers._suffix_tree(short_req)
    assert long_again is not None and short_again is not None
    assert long_again.scores[0] > 0.95 and short_again.scores[0] < 0.05
    # a new request's estimates start from every earlier request's (the pools)
    newcomer_long, newcomer_short = request("c", LONG), request("d", SHORT)
    first_long = spec.proposers._suffix_tree(newcomer_long)
    first_short = spec.proposers._suffix_tree(newcomer_short)
    assert first_long is not None and first_short is not None
    pooled = POOLED_DECAY ** ROUNDS  # the verifications of each kind moved the pools from 0.6
    # (accepted over tested drafts, each averaged; the prior counts as one tested draft)
    assert first_long.tracker.alpha == pytest.approx(
        (0.6 * pooled + 3 * (1 - pooled)) / (pooled + 3 * (1 - pooled)))
    assert first_short.tracker.alpha == pytest.approx(0.6 * pooled)
    assert first_long.tracker is not long_tracker  # per request, seeded from the pool


def test_deeper_drafts_are_scored_and_credited_by_the_longer_match_they_extend():
    """SHORT's draft continues a 2-token match: its drafts at depths 1-2 extend a 2-3 token
    match ("1-3"), at 3-6 a 4-7 token one, from 7 an 8+ one; each depth's kind's alpha
    scores it, and a verification credits each kind with its own depths' outcome."""
    spec = Speculator("suffix", max_k=8, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    if spec.suffix is None:
        pytest.skip("the suffix trie needs gcc")
    req = request("a", SHORT)
    trackers = req.spec_state.trackers
    proposers = spec.proposers
    first = proposers._suffix_tree(req)
    assert first is not None and first.tree is not None
    assert first.tree.token_ids == (22, 23, 30, 31, 32, 20, 21)
    for kind, alpha in (("suffix/1-3", 0.5), ("suffix/4-7", 0.8), ("suffix/8+", 0.9)):
        trackers[kind].alpha = alpha
    draft = proposers._suffix_tree(req)
    assert draft is not None
    assert draft.trackers_by_depth == ((1, trackers["suffix/1-3"]),
                                       (3, trackers["suffix/4-7"]),
                                       (7, trackers["suffix/8+"]))
    assert draft.scores == pytest.approx([0.5, 0.25, 0.2, 0.16, 0.128, 0.1024, 0.09216])
    updates = {kind: trackers[kind].num_updates for kind in trackers}
    req.spec_state.verifying = draft.trackers_by_depth
    req.spec_state.in_flight_depth = 5
    spec.record(req, num_drafted=5, num_accepted=3)
    assert {kind: trackers[kind].num_updates - updates[kind] for kind in trackers} == {
        "suffix/1-3": 1, "suffix/4-7": 1, "suffix/8+": 0}
    assert trackers["suffix/1-3"].alpha > 0.5  # its two drafts were accepted
    # a long match's drafts are all of its own kind
    long_draft = proposers._suffix_tree(request("b", LONG))
    assert long_draft is not None and long_draft.deeper == ()


def test_the_nodes_at_a_depth_share_the_chance_the_tree_gets_through_it():
    """After "20 21" the context went on with 22 three times and 23 once: the two first
    drafts split the depth's alpha 3:1 (not 22 at alpha and 23 at a third of it on top); a
    depth's scores add up to at most the chance that the tree gets through it (the product
    of its depths' kinds' alphas: what the depth-wise trackers measure), and a node never
    scores above its parent."""
    spec = Speculator("suffix", max_k=8, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    if spec.suffix is None:
        pytest.skip("the suffix trie needs gcc")
    branchy = [20, 21, 22, 5, 20, 21, 22, 6, 20, 21, 23, 7, 20, 21, 22, 8, 20, 21]
    draft = spec.proposers._suffix_tree(request("a", branchy))
    assert draft is not None and draft.tree is not None
    tree, scores = draft.tree, draft.scores
    alpha_from = dict(draft.trackers_by_depth)  # first depth -> its tracker
    reach, alpha = [1.0], 0.0
    for depth in range(1, max(tree.depths) + 1):
        alpha = alpha_from[depth].alpha if depth in alpha_from else alpha
        reach.append(reach[-1] * alpha)
    by_depth: dict[int, float] = {}
    for score, depth in zip(scores, tree.depths, strict=True):
        by_depth[depth] = by_depth.get(depth, 0.0) + score
    first = {tok: score for tok, score, depth in zip(tree.token_ids, scores, tree.depths,
                                                      strict=True) if depth == 1}
    assert first == pytest.approx({22: 0.75 * reach[1], 23: 0.25 * reach[1]})
    assert by_depth[1] == pytest.approx(reach[1]) and by_depth[2] == pytest.approx(reach[2])
    assert all(by_depth[d] <= reach[d] + 1e-9 for d in by_depth)
    assert all(score <= scores[parent] + 1e-12
               for score, parent in zip(scores, tree.parents, strict=True) if parent >= 0)
