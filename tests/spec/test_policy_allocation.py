"""The policy's draft allocation against its reference (tests/spec/policy_allocation_reference.py):
the same drafts and the same expected rate, exactly, over random steps mixing draft-model
(head) requests, model-free trees and chains, weights, other requests and prompt tokens, on
several cost curves."""

from __future__ import annotations

import random

import pytest

from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.step_cost import ObservedStepCost, StepCost
from tests.spec.policy_allocation_reference import allocate_with_rate_reference

CURVES = {
    "memory bound": StepCost.memory_bound(0.01),
    "second row free": StepCost((1, 2, 3, 4, 8, 16), (8.7, 8.7, 9.9, 11.0, 22.3, 38.0)),
    "steep": StepCost((1, 2, 4, 8, 16), (1.0, 1.3, 1.9, 3.2, 6.0)),
}


def _observed() -> ObservedStepCost:
    cost = ObservedStepCost(CURVES["second row free"], min_samples=1)
    for n, seconds in ((1, 9.0), (2, 9.6), (3, 10.4), (9, 25.0)):
        cost.observe(n, seconds, overhead=0.4)
    return cost


def _random_step(rng: random.Random) -> dict[str, object]:
    n = rng.randint(1, 9)
    alphas = [rng.choice([0.0, 0.03, rng.random()]) for _ in range(n)]
    available = [rng.randint(0, 10) for _ in range(n)]
    uses_draft = [rng.random() < 0.4 for _ in range(n)]
    gains: list[list[float] | None] = []
    for a, k in zip(alphas, available, strict=True):
        if rng.random() < 0.5 or k == 0:
            gains.append(None)
        else:  # a tree's nodes best-first: non-increasing path probabilities
            gains.append(sorted((rng.random() * a for _ in range(k)), reverse=True))
    return {"alphas": alphas, "available": available,
            "num_plain_tokens": n + rng.choice([0, 0, 3, 40]),
            "uses_draft": uses_draft if rng.random() < 0.8 else None,
            "weights": [rng.choice([1.0, 0.25]) for _ in range(n)] if rng.random() < 0.5
            else None,
            "gains": gains if rng.random() < 0.8 else None,
            "other_tokens": rng.choice([0.0, 0.0, 2.0, 5.25]),
            "num_prefill_tokens": rng.choice([0, 0, 3])}


@pytest.mark.parametrize("curve", [*CURVES, "observed"])
@pytest.mark.parametrize("max_k", [1, 4, 8])
def test_allocation_matches_its_reference(curve: str, max_k: int) -> None:
    cost = _observed() if curve == "observed" else CURVES[curve]
    policies = [
        SpeculationPolicy(cost, max_k=max_k),
        SpeculationPolicy(cost, max_k=max_k, draft_cost=lambda b: 0.3 + 0.05 * b),
        SpeculationPolicy(cost, max_k=max_k, draft_cost=lambda b: 0.05 * b,
                          draft_fixed_cost=lambda b: 0.4 + 0.1 * b, rows_per_model_draft=2),
    ]
    rng = random.Random(f"{curve}-{max_k}")
    granted = 0
    for _ in range(400):
        step = _random_step(rng)
        for policy in policies:
            got = policy.allocate_with_rate(**step)  # type: ignore[arg-type]
            want = allocate_with_rate_reference(policy, **step)  # type: ignore[arg-type]
            assert got == want, step
            granted += sum(got[0]) > 0
    assert granted > 100  # the steps exercise granted drafts, not only refusals


def test_returned_drafts_are_the_callers_own() -> None:
    """Where nothing is granted the plain plan's list is returned: a new one every call."""
    policy = SpeculationPolicy(CURVES["steep"], max_k=4)
    first, _ = policy.allocate_with_rate([0.0], [4], 1, [True])
    first.append(7)
    assert policy.allocate_with_rate([0.0], [4], 1, [True])[0] == [0]
