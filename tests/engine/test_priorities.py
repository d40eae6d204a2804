"""engine.priorities.Priorities on its own: the effective priority with aging, and each
step's background share (what the scheduler's tests exercise through whole steps)."""

from __future__ import annotations

from quickdraft.engine.priorities import INTERACTIVE, Priorities
from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams

BACKGROUND = 10


def make(priority: int, arrival: float) -> Request:
    return Request(f"r{priority}-{arrival}", [1, 2, 3], SamplingParams(max_tokens=4),
                   frozenset({0}), arrival_time=arrival, priority=priority)


def test_key_ages_one_level_per_period_and_keeps_arrival_order():
    p = Priorities(aging_s=5.0)
    p.now = 100.0
    old, new = make(BACKGROUND, 100.0 - 12.0), make(BACKGROUND, 99.0)
    assert p.key(old) == (BACKGROUND - 2, 88.0)  # 12 s: two whole periods
    assert p.key(new) == (BACKGROUND, 99.0)
    assert sorted([new, old], key=p.key) == [old, new]
    aged_in = make(BACKGROUND, 100.0 - 5.0 * BACKGROUND)  # aged into the interactive class
    assert not p.is_background(aged_in) and p.is_background(old)
    assert Priorities(aging_s=None, now=100.0).key(old) == (BACKGROUND, 88.0)


def test_share_depends_on_whether_interactive_work_is_present():
    p = Priorities(aging_s=None, background_tokens_with_interactive=2,
                   background_tokens_per_step=12)
    bg, ia = make(BACKGROUND, 0.0), make(INTERACTIVE, 1.0)
    p.start_step([bg])
    assert p.background_budget == 12 and p.cap(bg, 64) == 12 and p.cap(bg, 5) == 5
    p.start_step([bg, ia])
    assert p.background_budget == 2
    assert p.cap(ia, 64) == 64  # interactive requests are never capped
    p.spend(ia, 30)
    assert p.background_budget == 2  # ... nor counted against the share
    p.spend(bg, 2)
    assert p.cap(bg, 64) == 0
    p.spend(bg, 3)  # drafts granted together may overdraw it
    assert p.background_budget == -3 and p.cap(bg, 64) == 0  # never a negative chunk
