"""The one step plan: built from a scheduler step or from draft feeds, checked every step."""

from __future__ import annotations

import dataclasses

import pytest

from quickdraft.engine import step_plan
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler import ScheduledRequest, SchedulerOutput
from quickdraft.engine.step_plan import StepPlan, plan_step

BLOCK = 4


def _req(rid: str, tokens: list[int], start: int, table: tuple[int, ...], drafts: int = 0,
         sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, table, drafts, None, sample, SamplingParams(),
                            None, [], [])


def test_plan_step_flattens_prefill_decode_and_verification():
    sched = SchedulerOutput([
        _req("chunk", [5, 6, 7], 0, (3,), sample=False),  # a prefill chunk, not finished
        _req("decode", [9], 6, (1, 4)),
        _req("verify", [1, 2, 3], 8, (0, 2, 5), drafts=2),  # last token + 2 drafts
    ])
    plan = plan_step(sched)
    plan.check_invariants(BLOCK)
    assert plan.input_ids == [5, 6, 7, 9, 1, 2, 3]
    assert plan.positions == [0, 1, 2, 6, 8, 9, 10]
    assert plan.query_start_loc == [0, 3, 4, 7] and plan.seq_lens == [3, 7, 11]
    assert plan.logits_indices == [3, 4, 5, 6] and plan.sample_requests == [1, 2]
    assert plan.max_query_len == 3 and not plan.all_rows_sampled
    meta = plan.attention_metadata(BLOCK)
    meta.check_invariants()
    # slot of position p: table[p // 4] * 4 + p % 4
    assert meta.slot_mapping.tolist() == [12, 13, 14, 18, 20, 21, 22]


def test_from_feeds_scores_each_last_row():
    plan = StepPlan.from_feeds([[4, 5], [6]], [3, 0], [(0, 1), (2,)])
    plan.check_invariants(BLOCK)
    assert plan.positions == [3, 4, 0] and plan.seq_lens == [5, 1]
    assert plan.logits_indices == [1, 2] and plan.sample_requests == [0, 1]


@pytest.mark.parametrize("broken", [
    {"positions": [0, 1, 3]},  # not the last positions of the context, in order
    {"seq_lens": [5, 9]},  # context beyond the block table
    {"logits_indices": [2, 1]},  # not increasing
])
def test_a_broken_plan_fails_its_check(broken):
    plan = dataclasses.replace(StepPlan.from_feeds([[4, 5], [6]], [3, 0], [(0, 1), (2,)]),
                               **broken)
    with pytest.raises(AssertionError):
        plan.check_invariants(BLOCK)


def test_the_suite_checks_every_step():
    assert step_plan.CHECK_INVARIANTS  # tests/conftest.py switches it on
