"""spec.draft_cost.ObservedDraftCost: the policy's proposal costs scaled by observed times."""

from __future__ import annotations

import math

import pytest

from quickdraft.spec.draft_cost import ObservedDraftCost
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.step_cost import StepCost

PER_DRAFT = StepCost((1, 2), (0.001, 0.0015))  # seconds a draft, by batch
FIXED = StepCost((1, 2), (0.0005, 0.0008))


def test_start_up_figures_until_enough_proposals_are_timed() -> None:
    cost = ObservedDraftCost(PER_DRAFT, FIXED, window=8, min_samples=3)
    assert cost.modeled(1, 2) == pytest.approx(0.0025)
    for _ in range(2):
        cost.observe(1, 2, 0.005)  # twice the start-up figure
    assert cost.ratio == 1.0 and cost.per_draft(1) == 0.001 and cost.fixed(2) == 0.0008
    cost.observe(1, 2, 0.005)
    assert cost.ratio == pytest.approx(2.0)
    assert cost.per_draft(2) == pytest.approx(0.003) and cost.fixed(1) == pytest.approx(0.001)


def test_the_median_of_the_recent_window_and_the_bounds() -> None:
    cost = ObservedDraftCost(PER_DRAFT, None, window=4, min_samples=1, bounds=(0.5, 4.0))
    for ratio in (1.5, 9.0, 1.5, 1.5):  # one stall does not move the median
        cost.observe(2, 1, ratio * 0.0015)
    assert cost.ratio == pytest.approx(1.5) and cost.fixed(1) == 0.0
    for _ in range(4):  # the window forgets: only the last 4 count
        cost.observe(1, 1, 0.1)  # 100x: held at the upper bound
    assert cost.ratio == 4.0 and cost.num_samples == 4
    for _ in range(4):
        cost.observe(1, 1, 0.0001)
    assert cost.ratio == 0.5


def test_nonsense_observations_are_ignored() -> None:
    cost = ObservedDraftCost(PER_DRAFT, FIXED, min_samples=1)
    for batch, depth, seconds in ((0, 1, 0.1), (1, 0, 0.1), (1, 1, 0.0), (1, 1, -1.0),
                                  (1, 1, math.inf), (1, 1, math.nan)):
        cost.observe(batch, depth, seconds)
    assert cost.num_samples == 0 and cost.ratio == 1.0
    with pytest.raises(ValueError):
        ObservedDraftCost(PER_DRAFT, window=2, min_samples=3)
    with pytest.raises(ValueError):
        ObservedDraftCost(PER_DRAFT, bounds=(1.5, 3.0))


def test_the_policy_stops_granting_drafts_that_cost_more_than_measured() -> None:
    """A draft accepted 60 % of the time pays at the start-up price and not once proposals
    are seen to take five times as long."""
    step = StepCost((1, 2, 4), (0.005, 0.0055, 0.0065))
    cost = ObservedDraftCost(StepCost((1,), (0.0005,)), StepCost((1,), (0.0002,)),
                             min_samples=2)
    policy = SpeculationPolicy(step, 4, draft_cost=cost.per_draft, draft_fixed_cost=cost.fixed)
    assert policy.allocate([0.6], [4], 1, uses_draft=[True]) != [0]
    for _ in range(2):
        cost.observe(1, 2, 5 * cost.modeled(1, 2))
    assert policy.allocate([0.6], [4], 1, uses_draft=[True]) == [0]


def test_ratios_are_forgotten_after_steps_without_a_proposal() -> None:
    """Priced out, a method makes no proposals: after stale_steps steps the start-up figure
    stands again until min_samples new proposals were timed."""
    cost = ObservedDraftCost(PER_DRAFT, FIXED, min_samples=2, stale_steps=3)
    for _ in range(2):
        cost.observe(1, 1, 6 * cost.modeled(1, 1))
    assert cost.ratio == pytest.approx(6.0)
    for _ in range(3):
        cost.tick()
    assert cost.ratio == pytest.approx(6.0)  # not stale yet
    cost.observe(1, 1, 6 * cost.modeled(1, 1))  # a proposal restarts the count
    for _ in range(3):
        cost.tick()
    assert cost.ratio == pytest.approx(6.0) and cost.num_samples == 3
    cost.tick()
    assert cost.ratio == 1.0 and cost.num_samples == 0
    cost.observe(1, 1, 2 * cost.modeled(1, 1))
    assert cost.ratio == 1.0  # one new ratio: not enough yet
    cost.observe(1, 1, 2 * cost.modeled(1, 1))
    assert cost.ratio == pytest.approx(2.0)
