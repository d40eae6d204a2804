"""The adaptive speculation policy: acceptance tracking, draft allocation under a cost curve."""

from __future__ import annotations

import random

import pytest

from quickdraft.spec.policy import (
    POOL_STRENGTH,
    POOL_STRENGTH_DECAY,
    AcceptanceTracker,
    SpeculationPolicy,
    expected_accepted,
    update_by_depth,
)
from quickdraft.spec.step_cost import StepCost, measure_step_cost


def test_step_cost_interpolates_and_extrapolates():
    cost = StepCost((1, 3, 5), (1.0, 1.0, 3.0))
    assert cost(1) == 1.0 and cost(2) == 1.0 and cost(4) == 2.0 and cost(7) == 5.0
    with pytest.raises(ValueError):
        StepCost((2, 4), (1.0, 1.0))
    one = StepCost((1,), (0.5,))  # one size measured: flat, not an IndexError
    assert one(1) == one(4) == 0.5


def test_measure_step_cost_is_monotone_best_of_three_rounds():
    # rounds (1, 2), (2, 1), (1, 2): n=1 gets 5, 2, 2.5 (best 2) and n=2 gets 3, 4, 1.5
    calls = iter([5.0, 3.0, 4.0, 2.0, 2.5, 1.5])
    cost = measure_step_cost(lambda n: next(calls), sizes=(1, 2), budget_s=100.0)
    assert cost.seconds == (2.0, 2.0)  # n=2's best 1.5, raised to 2


def test_the_rounds_alternate_their_order():
    """Each size after a round's first is timed right after a size next to it: the smallest
    sizes never come right after the largest (on an AMX CPU a 1-row step timed after 64-row
    steps came out ~1.7x its time in a loop of small steps)."""
    seen: list[int] = []

    def run(n: int) -> float:
        seen.append(n)
        return float(n)

    measure_step_cost(run, sizes=(1, 2, 4, 8), budget_s=1e9)
    assert seen == [1, 2, 4, 8, 8, 4, 2, 1, 1, 2, 4, 8]


def test_a_slow_spell_does_not_bend_the_measured_curve():
    """A neighbour slows the host for a while: timed in interleaved rounds, each size keeps
    its quiet round, so the curve has the quiet shape (each size's repeats in a row would
    have timed the first sizes only inside the spell)."""
    quiet = {1: 5.0, 2: 6.0, 8: 13.5, 9: 14.8}
    calls = 0

    def run(n: int) -> float:
        nonlocal calls
        calls += 1
        return quiet[n] * (1.6 if calls <= 5 else 1.0)  # the first five calls: busy

    cost = measure_step_cost(run, sizes=(1, 2, 8, 9), budget_s=1e9)
    assert cost.seconds == (5.0, 6.0, 13.5, 14.8) and calls == 12


def test_measure_step_cost_stops_at_its_budget():
    cost = measure_step_cost(lambda n: 0.02, sizes=(1, 2, 4, 8), budget_s=0.0)
    assert cost.num_tokens == (1, 2)  # two sizes at least, each timed once


def test_memory_bound_batch_takes_all_drafts_of_good_requests():
    policy = SpeculationPolicy(StepCost.memory_bound(0.001), max_k=4)
    assert policy.allocate([0.9, 0.8], [4, 3], num_plain_tokens=2) == [4, 3]


def test_low_acceptance_turns_speculation_off():
    policy = SpeculationPolicy(StepCost.memory_bound(0.05), max_k=4)
    assert policy.allocate([0.02, 0.04], [4, 4], num_plain_tokens=2) == [0, 0]


def test_compute_bound_batch_caps_total_drafts():
    # Flat up to 8 tokens, then every token costs as much as a whole step.
    cost = StepCost((1, 8, 9, 1024), (1.0, 1.0, 2.0, 1017.0))
    policy = SpeculationPolicy(cost, max_k=4)
    ks = policy.allocate([0.9] * 4, [4] * 4, num_plain_tokens=4)
    assert sum(ks) == 4  # only the free slots (8 - 4 plain tokens) are used
    assert max(ks) - min(ks) <= 1  # spread by marginal gain, first drafts first


def test_marginal_gain_prefers_the_better_request():
    cost = StepCost((1, 3, 4, 1024), (1.0, 1.0, 1.5, 600.0))
    ks = SpeculationPolicy(cost, max_k=4).allocate([0.95, 0.3], [4, 4], num_plain_tokens=2)
    assert ks[0] >= 1 and ks[0] >= ks[1]


def test_requests_without_drafts_count_in_the_steps_rate():
    """8 requests decode and 2 have something to draft: the step emits 8 tokens without
    drafts, so a draft must pay against all 8, not against the 2 that draft."""
    cost = StepCost((1, 8, 9, 1024), (1.0, 1.0, 1.2, 204.0))  # +20% a token past 8
    policy = SpeculationPolicy(cost, max_k=4)
    assert sum(policy.allocate([0.6, 0.6], [4, 4], num_plain_tokens=8)) > 0  # 2 tokens alone
    assert policy.allocate([0.6, 0.6], [4, 4], num_plain_tokens=8, other_tokens=6.0) == [0, 0]
    assert sum(policy.allocate([0.95, 0.95], [4, 4], num_plain_tokens=8,
                               other_tokens=0.5)) > 0  # 6 background ones weigh less


def test_a_probe_pays_only_where_a_fair_draft_would():
    cost = StepCost((1, 8, 9, 1024), (1.0, 1.0, 1.2, 204.0))  # flat to 8, then +20% a token
    policy = SpeculationPolicy(cost, probe_alpha=0.5)
    assert policy.probe_pays(num_tokens=2, tokens=2.0)  # a free slot
    assert not policy.probe_pays(num_tokens=8, tokens=8.0)  # 8.5 / 1.2 < 8 / 1.0
    assert policy.probe_pays(num_tokens=8, tokens=1.0)  # the rest are drafts, not tokens


def test_a_prompt_in_the_step_leaves_the_drafts_to_the_decoding_rows_rate():
    """8 requests decode beside a 400-token prompt. Rows cost 1 each past 8 (compute-bound):
    a draft row costs what a decoding row emits, so a draft accepted 0.3 of the time does
    not pay, prompt or not. Against the whole step's rate (8 tokens in 400 rows' time) it
    looked as if it did: the prompt's time is not this step's price of a token."""
    cost = StepCost((1, 8, 1024), (8.0, 8.0, 1024.0))
    policy = SpeculationPolicy(cost, max_k=4)
    args = ([0.3] * 8, [4] * 8)
    assert policy.allocate(*args, num_plain_tokens=8) == [0] * 8
    assert sum(policy.allocate(*args, num_plain_tokens=408)) > 0  # the prompt not named
    assert policy.allocate(*args, num_plain_tokens=408, num_prefill_tokens=400) == [0] * 8
    assert policy.first_draft_threshold(408, 8.0, 400) == pytest.approx(1.0)
    assert not policy.probe_pays(408, 8.0, num_prefill_tokens=400)
    assert policy.free_draft_floor(408, 8.0, 400) == pytest.approx(1.0)


@pytest.mark.parametrize("prompt", [1, 57, 400])
def test_where_rows_cost_the_same_a_prompt_changes_no_draft(prompt: int):
    """On a linear cost curve a draft row costs the same whatever the step's size, and the
    decoding rows' rate is the same with the prompt left out: the same drafts either way."""
    cost = StepCost((1, 1024), (3.0, 3.0 + 0.4 * 1023))
    policy = SpeculationPolicy(cost, max_k=4)
    alphas, available = [0.95, 0.7, 0.5, 0.2], [4, 4, 3, 4]
    gains = [[0.9, 0.6, 0.3, 0.1], None, None, None]
    plain = policy.allocate_with_rate(alphas, available, 6, gains=gains, other_tokens=2.0)
    mixed = policy.allocate_with_rate(alphas, available, 6 + prompt, gains=gains,
                                      other_tokens=2.0, num_prefill_tokens=prompt)
    assert mixed[0] == plain[0] and sum(plain[0]) > 0
    assert mixed[1] == pytest.approx(plain[1])


def test_tracker_counts_only_tested_drafts():
    t = AcceptanceTracker(alpha=0.5, decay=0.0)
    t.update(num_drafted=4, num_accepted=1)  # accepted 1, rejected the 2nd: 1 of 2 tested
    assert t.alpha == pytest.approx(0.5)
    t.update(num_drafted=4, num_accepted=4)
    assert t.alpha == pytest.approx(1.0)
    t.update(num_drafted=3, num_accepted=0)
    assert t.alpha == pytest.approx(0.0)


class _Counting(AcceptanceTracker):
    """Records what it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[int, int]] = []

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.told.append((num_drafted, num_accepted))


@pytest.mark.parametrize(("depth", "accepted", "first", "second", "third"), [
    (5, 0, [(2, 0)], [], []),  # rejected at depth 1: nothing deeper was tested
    (5, 1, [(2, 1)], [], []),  # rejected at depth 2
    (5, 2, [(2, 2)], [(3, 0)], []),  # rejected at depth 3, the second tracker's first
    (5, 4, [(2, 2)], [(3, 2)], []),
    (6, 6, [(2, 2)], [(3, 3)], [(1, 1)]),  # all accepted
    (2, 2, [(2, 2)], [], []),  # shallower than the second tracker's first depth
    (4, 3, [(2, 2)], [(2, 1)], []),  # the second tracker's drafts end at the path's depth
])
def test_a_verification_is_split_across_the_depths_trackers(depth, accepted, first, second,
                                                            third):
    a, b, c = _Counting(), _Counting(), _Counting()
    update_by_depth([(1, a), (3, b), (6, c)], depth, accepted)
    assert (a.told, b.told, c.told) == (first, second, third)
    # tested drafts (accepted ones and the rejected one) add up to the path's
    tested = sum(min(n_acc + 1, n) for t in (a, b, c) for n, n_acc in t.told)
    assert tested == min(accepted + 1, depth)
    assert sum(n_acc for t in (a, b, c) for _, n_acc in t.told) == accepted


def test_one_tracker_for_every_depth_is_a_plain_update():
    split, plain = AcceptanceTracker(alpha=0.5), AcceptanceTracker(alpha=0.5)
    for depth, accepted in ((4, 1), (3, 3), (6, 0), (2, 1)):
        update_by_depth([(1, split)], depth, accepted)
        plain.update(depth, accepted)
    assert split == plain


def test_background_requests_lose_drafts_first_when_the_batch_is_saturated():
    # Flat up to 8 tokens, then every token costs as much as a whole step.
    cost = StepCost((1, 8, 9, 1024), (1.0, 1.0, 2.0, 1017.0))
    policy = SpeculationPolicy(cost, max_k=4)
    ks = policy.allocate([0.7, 0.9, 0.9], [4, 4, 4], num_plain_tokens=3,
                         weights=[1.0, 0.25, 0.25])
    assert ks[0] == 4 and sum(ks) == 5  # the interactive request first, then the best rest
    assert policy.allocate([0.9] * 3, [4] * 3, 3, weights=[1.0] * 3) != ks


@pytest.mark.parametrize("curve", [StepCost((1, 2, 64), (1.0, 1.13, 9.2)),  # +13 % a row
                                   StepCost((1, 4, 5, 64), (1.0, 1.0, 1.3, 18.0)),
                                   StepCost.memory_bound(0.02)])
@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
def test_a_lone_request_gets_the_drafts_that_maximise_its_tokens_per_second(curve, alpha):
    """Against every draft count: one at a time while the rate rises finds the best."""
    policy = SpeculationPolicy(curve, max_k=8)
    ks, rate = policy.allocate_with_rate([alpha], [8], num_plain_tokens=1)
    best = max(range(9), key=lambda k: (1.0 + expected_accepted(alpha, k)) / curve(1 + k))
    assert ks == [best]
    assert rate == pytest.approx((1.0 + expected_accepted(alpha, best)) / curve(1 + best))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.95, 1.0])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 16])
def test_expected_accepted_is_the_chain_sum(alpha, n):
    """``combined`` ranks drafts by this: the expected accepted drafts of an n-chain."""
    reference = sum(alpha ** i for i in range(1, n + 1))
    assert expected_accepted(alpha, n) == pytest.approx(reference, abs=1e-12)


def test_a_pooled_estimate_follows_every_request_and_seeds_new_ones():
    pool = AcceptanceTracker(alpha=0.6, decay=0.5)
    first = AcceptanceTracker.from_pool(pool)
    assert first.alpha == 0.6 and first.pooled is pool
    first.update(num_drafted=4, num_accepted=4)  # the request's own estimate and the pool's
    # the pool: accepted over tested, each averaged; the prior counts as one tested draft
    assert pool.alpha == pytest.approx((0.5 * 0.6 + 0.5 * 4) / (0.5 + 0.5 * 4))  # 0.92
    # the request: its sums, with the pool's estimate counting POOL_STRENGTH * decay drafts
    strength = POOL_STRENGTH * POOL_STRENGTH_DECAY
    assert first.alpha == pytest.approx((4 + strength * 0.92) / (4 + strength))
    second = AcceptanceTracker.from_pool(pool)  # a later request starts where the pool is
    assert second.alpha == pytest.approx(0.92)
    second.update(num_drafted=2, num_accepted=0)
    pooled = 0.5 * 0.92 * 2.5 / (0.5 * 2.5 + 0.5 * 1)
    assert pool.alpha == pytest.approx(pooled)
    assert second.alpha == pytest.approx(strength * pooled / (1 + strength))
    assert first.alpha == pytest.approx((4 + strength * 0.92) / (4 + strength))  # untouched


def test_a_requests_estimate_is_shrunk_toward_the_pool_then_its_own():
    """Early on a request's lucky chains count for less (drafts go where the estimate is
    high, by chance too); a request whose drafts are never accepted still stops drafting."""
    pool = AcceptanceTracker(alpha=0.5, decay=1.0)  # a pool that does not move
    lucky = AcceptanceTracker.from_pool(pool)
    lucky.update(num_drafted=3, num_accepted=3)
    strength = POOL_STRENGTH * POOL_STRENGTH_DECAY
    assert lucky.alpha == pytest.approx((3 + strength * 0.5) / (3 + strength))  # not 1.0
    assert lucky.alpha < 0.75
    never = AcceptanceTracker.from_pool(pool)
    for _ in range(20):
        never.update(num_drafted=2, num_accepted=0)
    assert pool.alpha == pytest.approx(0.5)
    assert never.alpha < 0.1  # the pool's strength has faded: its own zeros decide


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("length", [1, 3, 8])
def test_the_estimate_converges_to_the_acceptance_rate(rate, length):
    """Chains of ``length`` drafts, each accepted with probability ``rate`` once the ones
    before it were: the estimate ends near ``rate`` (an average of each verification's
    accepted / tested ratio ends well below it: 0.31 for a long chain at 0.5)."""
    rng = random.Random(0)
    t = AcceptanceTracker(decay=0.995)
    for _ in range(4000):
        accepted = 0
        while accepted < length and rng.random() < rate:
            accepted += 1
        t.update(num_drafted=length, num_accepted=accepted)
    assert t.alpha == pytest.approx(rate, abs=0.06)


def test_a_fixed_drafting_cost_must_be_earned_back():
    """A draft head's catch-up costs the same whatever the depth: worth paying for a long
    likely chain, not for one unlikely draft."""
    cost = StepCost((1, 64), (1.0, 1.0))  # verification rows are free here
    per_draft = StepCost((1, 16), (0.05, 0.05))
    cheap = SpeculationPolicy(cost, max_k=4, draft_cost=per_draft)
    fixed = SpeculationPolicy(cost, max_k=4, draft_cost=per_draft,
                              draft_fixed_cost=StepCost((1, 16), (0.5, 0.5)))
    assert cheap.allocate([0.3], [4], 1, uses_draft=[True]) != [0]
    assert fixed.allocate([0.3], [4], 1, uses_draft=[True]) == [0]
    assert fixed.allocate([0.95], [4], 1, uses_draft=[True]) == [4]
    ks, rate = fixed.allocate_with_rate([0.95], [4], 1, uses_draft=[True])
    gain = sum(0.95 ** j for j in range(1, 5))
    assert ks == [4] and rate == pytest.approx((1 + gain) / (1.0 + 0.5 + 4 * 0.05))


def test_a_tree_of_several_rows_per_draft_is_priced_by_its_rows():
    """A head drafts ``rows_per_model_draft`` verified nodes per granted draft where a row is
    cheap (each +4 % here): that buys fewer drafts than a chain would get. (Where rows are
    dearer it drafts chains: tests/spec/test_head_rows.py.)"""
    slope = StepCost((1, 64), (1.0, 1.0 + 63 * 0.04))  # each row +4 %
    chain = SpeculationPolicy(slope, max_k=8, draft_cost=StepCost((1, 2), (0.0, 0.0)))
    tree = SpeculationPolicy(slope, max_k=8, draft_cost=StepCost((1, 2), (0.0, 0.0)),
                             rows_per_model_draft=2)
    k_chain = chain.allocate([0.7], [8], 1, uses_draft=[True])[0]
    k_tree = tree.allocate([0.7], [8], 1, uses_draft=[True])[0]
    assert k_chain > k_tree
