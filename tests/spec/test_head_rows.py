"""How many target rows a draft head's granted draft takes: a tree of the likeliest token and
its siblings where a row costs little beside the step, a chain where rows are dear; and a
chain as deep as granted where that is deeper than the head's trees go. The policy decides
and prices it (``SpeculationPolicy.model_rows_per_draft``); the speculator and the drafting
follow."""

from __future__ import annotations

import torch

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.draft_head_runner import HeadInput, HeadOutput
from quickdraft.spec.head_search import ROUNDS
from quickdraft.spec.model_drafting import HEAD_TREE_DEPTH
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import HEAD_NODES_PER_DRAFT, Speculator
from quickdraft.spec.step_cost import StepCost
from quickdraft.spec.token_tree import TokenTree

FLAT = StepCost((1, 64), (1.0, 1.63))  # each row +1 % of a 1-row step (a GPU)
STEEP = StepCost((1, 2, 64), (1.0, 1.12, 8.56))  # each row +12 % (the 2-core CPUs)


def _policy(cost: StepCost, rows: int = HEAD_NODES_PER_DRAFT) -> SpeculationPolicy:
    return SpeculationPolicy(cost, max_k=8, draft_cost=StepCost((1, 2), (0.0, 0.0)),
                             rows_per_model_draft=rows)


def test_siblings_only_where_a_row_is_cheap():
    assert _policy(FLAT).model_rows_per_draft(1) == HEAD_NODES_PER_DRAFT
    assert _policy(STEEP).model_rows_per_draft(1) == 1
    assert _policy(FLAT, rows=1).model_rows_per_draft(1) == 1
    # the price is the decoding rows': a prompt chunk in the step does not make rows cheap
    step = StepCost((1, 2, 200, 201, 202), (1.0, 1.12, 24.9, 25.02, 25.14))
    assert _policy(step).model_rows_per_draft(200, num_prefill_tokens=199) == 1
    # a row at the threshold (+5 % of a 1-row step, under 5 % of the 2-row step it joins):
    # the tree
    edge = StepCost((1, 64), (1.0, 1.0 + 63 * 0.05))
    policy = _policy(edge)
    assert edge(3) / edge(2) - 1.0 <= policy.tree_max_row_price
    assert policy.model_rows_per_draft(1) == HEAD_NODES_PER_DRAFT


def test_drafts_are_priced_by_the_rows_they_take():
    """On a steep curve a head's drafts are chains and priced as one row each: the same
    allocation as a policy whose head drafts chains anyway; on a flat one, a tree of two rows a
    draft buys fewer drafts than a chain would where rows are not free."""
    for alpha in (0.5, 0.8, 0.95):
        chain = _policy(STEEP, rows=1).allocate_with_rate([alpha], [8], 1, uses_draft=[True])
        assert _policy(STEEP).allocate_with_rate([alpha], [8], 1, uses_draft=[True]) == chain
    slope = StepCost((1, 64), (1.0, 1.0 + 63 * 0.04))  # +4 % a row: cheap enough for a tree
    tree, chain_k = _policy(slope), _policy(slope, rows=1)
    assert tree.model_rows_per_draft(1) == HEAD_NODES_PER_DRAFT
    k_tree = tree.allocate([0.7], [8], 1, uses_draft=[True])[0]
    k_chain = chain_k.allocate([0.7], [8], 1, uses_draft=[True])[0]
    assert 0 < k_tree < k_chain


def _head_request(rid: str = "r") -> Request:
    request = Request(rid, list(range(1, 40)), SamplingParams(max_tokens=64, temperature=0.0),
                      frozenset())
    request.num_computed_tokens = request.num_tokens - 1
    return request


def _head_speculator(cost: StepCost) -> Speculator:
    spec = Speculator("head", max_k=8, ngram_min=2, ngram_max=4, policy=_policy(cost))
    spec.proposers.head = object()  # type: ignore[assignment]  # (only its presence matters)
    return spec


def test_the_speculator_asks_the_head_for_the_rows_the_policy_priced():
    for cost, per_draft in ((FLAT, HEAD_NODES_PER_DRAFT), (STEEP, 1)):
        spec = _head_speculator(cost)
        request = _head_request()
        spec.proposers.tracker(request, "head").alpha = 0.9
        spec.plan([request], [16], num_plain_tokens=1, budget=64)
        state = request.spec_state
        assert state.in_flight_source == "head" and state.in_flight_depth > 0
        assert state.model_k == per_draft * state.in_flight_depth


class _Kv:
    block_size = 16

    @staticmethod
    def block_table(request_id: str) -> list[int]:
        return [0, 1, 2, 3, 4]


class _RecordingHead:
    """Takes the inputs and drafts each a chain of its ``k`` nodes."""

    def __init__(self) -> None:
        self.inputs: list[HeadInput] = []

    def propose(self, inputs: list[HeadInput]) -> list[HeadOutput]:
        self.inputs += inputs
        return [HeadOutput(TokenTree.from_chain([7] * inp.k), None) for inp in inputs]


def test_a_chain_deeper_than_a_tree_goes_is_drafted_as_that_chain():
    """One node a draft and more drafts than the head's trees are deep (its rounds): the
    head drafts the chain the policy priced, not a tree that would spend its deeper nodes on
    siblings; up to a tree's depth, and with two nodes a draft, it drafts a tree."""
    assert HEAD_TREE_DEPTH == ROUNDS + 1
    for depth, model_k, want_tree in ((HEAD_TREE_DEPTH + 2, HEAD_TREE_DEPTH + 2, False),
                                      (HEAD_TREE_DEPTH, HEAD_TREE_DEPTH, True),
                                      (HEAD_TREE_DEPTH + 2, 2 * (HEAD_TREE_DEPTH + 2), True)):
        spec = _head_speculator(STEEP)
        head = _RecordingHead()
        spec.proposers.head = head  # type: ignore[assignment]
        spec.model_drafting.kv = _Kv()  # type: ignore[assignment]
        request = _head_request()
        state = request.spec_state
        state.add_features(0, torch.zeros(request.num_tokens - 1, 12))
        state.model_k, state.in_flight_depth, state.in_flight_source = model_k, depth, "head"
        spec.draft([request])
        (inp,) = head.inputs
        assert inp.k == model_k and inp.tree is want_tree and inp.max_depth == depth
        assert len(request.spec_token_ids) == model_k
