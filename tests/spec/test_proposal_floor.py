"""A free proposal whose best node cannot pay in this step is dropped before it is scored
and allocated (``Speculator._plan``'s floor, ``SpeculationPolicy.first_draft_threshold``):
the same drafts are granted, with less work."""

from __future__ import annotations

import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import suffix_tree
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import Speculator
from quickdraft.spec.step_cost import StepCost

# a repeated phrase: the suffix trie finds the continuation
PROMPT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]
# each row ~10 % of an 8-row step: at 8 requests a draft must be accepted ~75 % of the time
ROWS = StepCost((1, 2, 64), (5.0, 6.2, 81.8))


def test_the_threshold_is_where_one_draft_starts_to_raise_the_rate():
    policy = SpeculationPolicy(ROWS, max_k=4)
    for n in (1, 3, 8):
        bar = policy.first_draft_threshold(n, float(n))
        assert bar == pytest.approx(n * (ROWS(n + 1) / ROWS(n) - 1.0))
        for gain, granted in ((bar * 0.98, 0), (bar * 1.02, 1)):
            ks = policy.allocate([0.9] * n, [1] * n, num_plain_tokens=n,
                                 gains=[[gain]] + [[0.0]] * (n - 1))
            assert ks[0] == granted, (n, gain)
    assert policy.probe_pays(1, 1.0) and not policy.probe_pays(8, 8.0)
    # the floor the plan drops proposals below: 0 where a probe pays, else the threshold
    assert policy.free_draft_floor(1, 1.0) == 0.0
    assert policy.free_draft_floor(8, 8.0) == policy.first_draft_threshold(8, 8.0) > 0.5


def _requests(n: int) -> list[Request]:
    out = []
    for i in range(n):
        request = Request(f"r{i}", list(PROMPT), SamplingParams(max_tokens=64), frozenset())
        request.num_computed_tokens = request.num_tokens - 1
        out.append(request)
    return out


def _plan(alpha: float, floor: bool) -> tuple[list[list[int]], list[float], int]:
    """Eight decoding requests planned with every suffix kind's pooled acceptance at
    ``alpha``; the drafts, the min_gain each proposal was asked with, and how many
    proposals came back to be scored and allocated."""
    spec = Speculator("suffix", max_k=4, ngram_min=2, ngram_max=4,
                      policy=SpeculationPolicy(ROWS, max_k=4))
    for source in ("suffix", "corpus"):
        for bucket in ("1-3", "4-7", "8+"):
            spec.proposers.pool(f"{source}/{bucket}").alpha = alpha
    asked: list[float] = []
    found = 0
    real = spec._candidate

    def candidate(request, k, public=True, min_gain=0.0):  # type: ignore[no-untyped-def]
        nonlocal found
        asked.append(min_gain)
        out = real(request, k, public, min_gain if floor else 0.0)
        found += out is not None
        return out

    spec._candidate = candidate  # type: ignore[method-assign]
    requests = _requests(8)
    spec.plan(requests, [4] * 8, num_plain_tokens=8, budget=64)
    return [list(r.spec_token_ids) for r in requests], asked, found


@pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")
@pytest.mark.parametrize("alpha", [0.5, 0.95])
def test_dropping_proposals_below_the_floor_grants_the_same_drafts(alpha):
    with_floor, asked, found = _plan(alpha, floor=True)
    without, _, found_without = _plan(alpha, floor=False)
    bar = SpeculationPolicy(ROWS).free_draft_floor(8, 8.0)
    assert asked == [pytest.approx(bar)] * 8 and 0.5 < bar < 0.95
    assert with_floor == without
    assert found_without == 8  # the tries match every request's context
    # 0.5: nothing pays, and nothing is scored; 0.95: the tries' drafts do
    assert (any(with_floor), found) == ((False, 0) if alpha < bar else (True, 8))


@pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")
def test_no_floor_where_a_probe_could_pay():
    spec = Speculator("suffix", max_k=4, ngram_min=2, ngram_max=4,
                      policy=SpeculationPolicy(ROWS, max_k=4))
    asked: list[float] = []
    real = spec._candidate

    def candidate(request, k, public=True, min_gain=0.0):  # type: ignore[no-untyped-def]
        asked.append(min_gain)
        return real(request, k, public, min_gain)

    spec._candidate = candidate  # type: ignore[method-assign]
    spec.plan(_requests(1), [4], num_plain_tokens=1, budget=64)
    assert asked == [0.0]  # one request: a probe pays, so every proposal is scored
