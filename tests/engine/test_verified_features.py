"""engine.model_runner._verified_features: each request's verified rows of the step's
target features (a draft head's input), gathered once for the step and split per request."""

from __future__ import annotations

import torch

from quickdraft.engine.model_runner import _verified_features
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from quickdraft.engine.step_plan import plan_step


def _scheduled(rid: str, num_plain: int, num_drafts: int) -> ScheduledRequest:
    tokens = list(range(1, num_plain + num_drafts + 1))
    return ScheduledRequest(rid, tokens, 10, (0, 1, 2, 3), num_drafts, None, True,
                            SamplingParams(temperature=0.0), None, [7] * 10, [])


def _reference(sched: SchedulerOutput, starts: list[int], aux: torch.Tensor,
               wanted: list[bool], accepted: list[list[int] | None]) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for req, first, w, nodes in zip(sched.requests, starts, wanted, accepted, strict=True):
        plain = req.num_tokens - req.num_draft_tokens
        rows = [*range(first, first + plain), *(first + plain + n for n in nodes or [])]
        out.append(aux[rows] if w else None)
    return out


def test_each_request_gets_its_verified_rows_decode_and_verification() -> None:
    sched = SchedulerOutput([_scheduled("a", 1, 3), _scheduled("b", 2, 0),
                             _scheduled("c", 1, 4), _scheduled("d", 1, 0)], [])
    plan = plan_step(sched)
    starts = plan.query_start_loc[:-1]
    aux = torch.arange(plan.num_tokens * 6, dtype=torch.float32).reshape(-1, 6)  # [T, 6]
    wanted = [True, False, True, True]
    accepted: list[list[int] | None] = [[0, 2], None, [], None]  # a's path: nodes 0 then 2
    got = _verified_features(sched, plan, aux, wanted, accepted)
    want = _reference(sched, starts, aux, wanted, accepted)
    assert got is not None and len(got) == 4 and got[1] is None
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert torch.equal(g, w)
    decode = SchedulerOutput([_scheduled(r, 1, 0) for r in "xyz"], [])  # contiguous rows
    plan = plan_step(decode)
    aux = torch.randn(3, 6)
    rows = _verified_features(decode, plan, aux, [True, True, True], None)
    assert rows is not None and [r.tolist() for r in rows if r is not None] == \
        [[row] for row in aux.tolist()]
    assert _verified_features(decode, plan, aux, [False, False, False], None) == [None] * 3
    assert _verified_features(decode, plan, None, [True] * 3, None) is None


def test_one_request_keeping_every_row_gets_the_step_s_features_whole() -> None:
    """One request whose verified rows are all of the step's (a plain decode or prefill
    step, or every draft accepted): the step's tensor itself; one that keeps fewer (a
    rejected draft, a wanted request beside one that is not) gets just its rows."""
    for num_plain, num_drafts, accepted in ((1, 0, None), (5, 0, None), (1, 2, [0, 1])):
        sched = SchedulerOutput([_scheduled("a", num_plain, num_drafts)], [])
        plan = plan_step(sched)
        aux = torch.randn(plan.num_tokens, 6)
        got = _verified_features(sched, plan, aux, [True], [accepted])
        assert got is not None and got[0] is aux
    sched = SchedulerOutput([_scheduled("a", 1, 2)], [])
    plan = plan_step(sched)
    aux = torch.randn(3, 6)
    got = _verified_features(sched, plan, aux, [True], [[0]])  # the second draft rejected
    assert got is not None and got[0] is not None and torch.equal(got[0], aux[:2])
    two = SchedulerOutput([_scheduled("a", 1, 0), _scheduled("b", 1, 0)], [])
    plan = plan_step(two)
    aux = torch.randn(2, 6)
    got = _verified_features(two, plan, aux, [False, True], None)
    assert got is not None and got[0] is None and got[1] is not None
    assert torch.equal(got[1], aux[1:])
