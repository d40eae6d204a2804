"""The start-up cost curve corrected by observed step times (spec.step_cost.ObservedStepCost)."""

from __future__ import annotations

import pytest

from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.step_cost import ObservedStepCost, StepCost

QUIET = StepCost((1, 2, 4, 8), (6.0, 6.4, 7.1, 10.9))  # ms, the quiet machine's curve


def observe(cost: ObservedStepCost, n: int, ratio: float, times: int = 3) -> None:
    for _ in range(times):
        cost.observe(n, QUIET(n) * ratio)


def test_without_observations_the_start_up_curve_stands():
    cost = ObservedStepCost(QUIET)
    observe(cost, 4, 2.0, times=2)  # fewer than min_samples
    assert [cost(n) for n in (1, 3, 4, 9)] == [QUIET(n) for n in (1, 3, 4, 9)]


def test_observed_sizes_are_priced_by_their_median_ratio():
    cost = ObservedStepCost(QUIET)
    for ratio in (1.3, 1.3, 9.0, 1.3, 1.4):  # one outlier step (a pause) barely counts
        cost.observe(1, QUIET(1) * ratio)
    assert cost(1) == pytest.approx(QUIET(1) * 1.3)


def test_unobserved_sizes_borrow_from_the_observed_ones():
    cost = ObservedStepCost(QUIET)
    observe(cost, 1, 1.3)
    observe(cost, 4, 1.7)
    assert cost(2) == pytest.approx(QUIET(2) * (1.3 + 0.4 * 1 / 3))  # interpolated
    assert cost(8) == pytest.approx(QUIET(8) * 1.7)  # past the largest: its ratio
    only_rows = ObservedStepCost(QUIET)
    observe(only_rows, 4, 1.7)
    assert only_rows(1) == pytest.approx(QUIET(1) * 1.7)  # below the smallest: its ratio


def test_an_estimate_not_seen_for_stale_steps_is_dropped():
    cost = ObservedStepCost(QUIET, stale_steps=10)
    observe(cost, 1, 1.0)
    observe(cost, 4, 2.0)
    assert cost(4) == pytest.approx(QUIET(4) * 2.0)
    observe(cost, 1, 1.0, times=11)  # the busy spell is over; 4-row steps stopped
    assert cost(4) == pytest.approx(QUIET(4))  # tried again at the 1-row ratio


def test_what_a_step_costs_besides_the_model_is_added_to_every_size():
    """Scheduling, proposals and outputs are paid once a step however many rows it has: a
    draft row costs less relative to the whole step than to the model's part of it."""
    cost = ObservedStepCost(QUIET)
    for overhead in (0.5, 0.5, 9.0, 0.6, 0.5):  # one slow step (a pause) barely counts
        cost.observe(1, QUIET(1), overhead)
    observe(cost, 4, 1.0)  # no overhead given: the median stands
    assert [cost(n) for n in (1, 4, 9)] == pytest.approx([QUIET(n) + 0.5 for n in (1, 4, 9)])
    policy = SpeculationPolicy(cost, max_k=4)
    assert policy.first_draft_threshold(1, 1.0) == pytest.approx(
        (QUIET(2) + 0.5) / (QUIET(1) + 0.5) - 1.0)
    cost.observe(1, QUIET(1), -1.0)  # nonsense is ignored
    assert cost(1) == pytest.approx(QUIET(1) + 0.5)


def test_recent_ratio_is_what_metrics_show():
    cost = ObservedStepCost(QUIET)
    assert cost.recent_ratio() == 1.0
    observe(cost, 1, 1.3, times=2)
    observe(cost, 4, 1.8, times=1)
    assert cost.recent_ratio() == pytest.approx(1.3)  # every size's steps, median


def test_prices_are_refreshed_once_refresh_seconds_of_steps_have_passed():
    """Between refreshes a plan prices with the last estimates (no median, floor or price is
    recomputed after each step); a refresh takes every observation since the last. (A
    window of one: a size's estimate is its last ratio.)"""
    cost = ObservedStepCost(QUIET, window=1, min_samples=1, refresh_seconds=20.0)
    assert cost(1) == QUIET(1) == 6.0  # a refresh with nothing observed
    cost.observe(1, 9.0)  # 9 s of steps since the refresh
    assert cost(1) == 6.0
    cost.observe(1, 9.0, 0.5)  # 18.5
    assert cost(1) == 6.0
    cost.observe(1, 12.0)  # 30.5: refreshed when priced next
    assert cost(1) == 12.0 + 0.5
    assert cost.overhead == 0.5
    cost.observe(1, 18.0)  # 18
    assert cost(1) == 12.5
    cost.observe(1, 3.0)  # 21
    assert cost(1) == 3.0 + 0.5
    every_step = ObservedStepCost(QUIET, window=1, min_samples=1)  # the default: 0 s
    for seconds in (9.0, 3.0, 12.0):
        every_step.observe(1, seconds)
        assert every_step(1) == seconds
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="refresh_seconds"):
            ObservedStepCost(QUIET, refresh_seconds=bad)


def test_bad_observations_are_ignored():
    cost = ObservedStepCost(QUIET, max_tokens=64)
    for n, seconds in ((0, 1.0), (65, 1.0), (4, 0.0), (4, float("nan"))):
        cost.observe(n, seconds)
    assert cost.ratios() == ((), ())


def test_a_busy_spell_stops_drafts_the_quiet_curve_would_grant():
    """Quiet: a 4-row step costs 1.18 steps, so three drafts accepted 60% pay. Busy (each row
    +1.3 ms, measured on the 2-core EPYC): the same drafts would slow the request down."""
    cost = ObservedStepCost(QUIET)
    policy = SpeculationPolicy(cost, max_k=4)
    assert policy.allocate([0.6], [3], num_plain_tokens=1) == [3]
    observe(cost, 1, 8.1 / 6.0)
    observe(cost, 2, 9.4 / 6.4)
    observe(cost, 4, 12.0 / 7.1)
    ks = policy.allocate([0.6], [3], num_plain_tokens=1)
    assert ks[0] < 3
    tokens = 1 + sum(0.6 ** j for j in range(1, ks[0] + 1))
    assert tokens / cost(1 + ks[0]) >= 1 / cost(1)  # what it grants still pays


def test_the_engine_feeds_its_steps_to_the_policys_curve(tiny_model_dir):
    """A measured engine prices drafts with the observed curve and records every model step
    by its query tokens (drafts included); an unmeasured one keeps its fixed default."""
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine
    from quickdraft.engine.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", speculation="ngram",
                          num_kv_blocks=64, block_size=4)
    engine = LLMEngine(config, progress=False)
    cost = engine.step_cost
    assert cost is not None and engine.speculator.policy.cost is cost
    engine.add_request("r", prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6],
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert cost.num_steps == steps  # one observation a model step
    assert cost.recent_ratio() > 0.0
    assert cost.overhead > 0.0  # and what the rest of each step took
    assert cost.num_samples(8) == 1  # the prefill step's eight prompt tokens
    fixed = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                   speculation="ngram", measure_step_cost=False,
                                   num_kv_blocks=64, block_size=4), progress=False)
    assert fixed.step_cost is None


def test_a_draft_row_is_never_priced_below_what_it_adds_on_the_start_up_curve():
    """Eight decoding requests, each with its own long context, run slower than the one-
    context start-up curve says; a ninth (draft) row adds about what the curve says. Priced
    by each size's own median, 8 tokens at ratio 1.20 and 9 at 1.13 made the ninth row look
    nearly free; floored, it adds at least the curve's own 1.3 ms."""
    base = StepCost((1, 8, 9, 16), (5.2, 13.5, 14.8, 30.5))
    cost = ObservedStepCost(base)
    for n, ratio in ((8, 1.20), (9, 1.13), (16, 1.0)):
        for _ in range(3):
            cost.observe(n, base(n) * ratio)
    assert cost(8) == pytest.approx(base(8) * 1.20)
    assert cost(9) - cost(8) == pytest.approx(base(9) - base(8))  # floored
    assert cost(16) - cost(8) == pytest.approx(base(16) - base(8))
    assert cost(1) == pytest.approx(base(1) * 1.20)  # below the smallest: its ratio
    policy = SpeculationPolicy(cost, max_k=4)
    # one draft accepted 60 % of the time in a step of 8 decoding rows: 7.5 % more tokens
    # for 8.0 % more time, refused (priced at 9's own median, +3.2 %, it was granted)
    assert policy.allocate([0.6], [1], num_plain_tokens=8, other_tokens=7.0) == [0]
    assert policy.allocate([0.8], [1], num_plain_tokens=8, other_tokens=7.0) == [1]
    busy = ObservedStepCost(base)
    for n, ratio in ((1, 1.1), (8, 1.3), (9, 1.5)):  # a neighbour: larger steps slow more
        for _ in range(3):
            busy.observe(n, base(n) * ratio)
    assert [busy(n) for n in (1, 8, 9)] == pytest.approx([base(1) * 1.1, base(8) * 1.3,
                                                         base(9) * 1.5])  # kept
