"""The speed guard (spec/speed_guard.py): a method whose speculation is slower than the plain
path is held off, one that pays keeps speculating with rare off epochs, a change of either
is noticed; in an engine a method made slow on every step is suspended and output is
unchanged."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

from quickdraft.engine import llm_engine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.speed_guard import SpeedGuard, SpeedGuardConfig
from tests.spec.test_spec_engine import PROMPTS, make_engine

SMALL = SpeedGuardConfig(epoch_steps=4, warmup_steps=8, min_pairs=3, suspend_below=0.85,
                         explore_epochs=(2, 8), hold_epochs=(4, 16))


def run(guard: SpeedGuard, steps: int, speedup: float, shape: int = 1) -> list[bool]:
    """``steps`` steps of a world where speculating makes ``speedup`` times the plain
    path's tokens per second; returns the modes the guard chose."""
    modes = []
    for _ in range(steps):
        on = guard.speculate_now()
        modes.append(on)
        tokens = shape * (2 if on else 1)
        guard.observe(shape, tokens, tokens / (speedup if on else 1.0) * 1e-3)
    return modes


def test_no_off_epoch_before_the_warm_up() -> None:
    guard = SpeedGuard(SMALL)
    assert all(run(guard, SMALL.warmup_steps, speedup=0.1))
    assert guard.state == "probing" and guard.num_off_steps == 0


def test_a_method_slower_than_plain_is_held_off_and_probed_ever_more_rarely() -> None:
    guard = SpeedGuard(SMALL)
    modes = run(guard, 400, speedup=0.2)
    assert guard.state == "suspended" and guard.num_suspensions == 1
    assert guard.median_ratio is not None and guard.median_ratio == pytest.approx(0.2)
    tail = modes[200:]
    assert sum(tail) / len(tail) < 0.1  # mostly off: one on epoch per 16 off ones at most
    ons = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(ons)]
    assert gaps == sorted(gaps) and gaps[-1] == (SMALL.hold_epochs[1] + 1) * SMALL.epoch_steps


def test_a_method_that_pays_keeps_speculating() -> None:
    guard = SpeedGuard(SMALL)
    modes = run(guard, 600, speedup=1.3)
    assert guard.state == "trusted" and guard.num_suspensions == 0
    tail = modes[300:]
    assert sum(not m for m in tail) / len(tail) <= 1 / (SMALL.explore_epochs[1] + 1) + 0.01


def test_a_change_either_way_is_noticed() -> None:
    guard = SpeedGuard(SMALL)
    run(guard, 200, speedup=1.3)
    assert guard.state == "trusted"
    run(guard, 400, speedup=0.3)  # e.g. a method that became expensive on every step
    assert guard.state == "suspended"
    run(guard, 800, speedup=1.5)
    assert guard.state == "trusted"


def run_until_off_epoch_ends(guard: SpeedGuard, off_speed: float) -> None:
    """Steps at the paying world's speed until an off epoch starts, then that whole off
    epoch at ``off_speed`` times the plain path's speed (a stretch where plain decoding
    looks fast, e.g. no drafts would have been found)."""
    while guard.speculate_now():
        run(guard, 1, speedup=1.3)
    while not guard.speculate_now():
        guard.observe(1, 1, 1e-3 / off_speed)


def test_one_low_ratio_does_not_stop_a_trusted_method_two_in_a_row_do() -> None:
    guard = SpeedGuard(SMALL)
    run(guard, 600, speedup=1.3)
    assert guard.state == "trusted"
    run_until_off_epoch_ends(guard, off_speed=2.0)  # ratio 0.65: doubted, asked again soon
    assert guard.state == "trusted"
    run_until_off_epoch_ends(guard, off_speed=1.0)  # ratio 1.3: trusted again
    run_until_off_epoch_ends(guard, off_speed=2.0)
    assert guard.state == "trusted"
    run_until_off_epoch_ends(guard, off_speed=2.0)  # the second low ratio in a row
    assert guard.state == "probing"


def test_epochs_of_other_batch_shapes_are_not_compared() -> None:
    guard = SpeedGuard(SMALL)
    for step in range(400):  # the batch size changes every 3 steps: no epoch completes
        on = guard.speculate_now()
        guard.observe(1 + (step // 3) % 2, 2 if on else 1, 1e-3)
    assert guard.state == "probing" and not guard.ratios


def test_config_is_validated() -> None:
    for bad in ({"epoch_steps": 1}, {"warmup_steps": -1}, {"min_pairs": 0},
                {"suspend_below": 0.0}, {"suspend_below": 1.5}, {"explore_epochs": (4, 2)},
                {"hold_epochs": (0, 4)}):
        with pytest.raises(ValueError):
            SpeedGuardConfig(**bad)  # type: ignore[arg-type]


def test_an_engine_suspends_a_method_that_slows_every_step(tiny_model_dir,
                                                            monkeypatch) -> None:
    """A suffix proposer that costs 100 ms on every step it may speculate in (as the draft
    head's eager feature steps do on a GPU): suspended, and the tokens are those of
    speculation off. The engine's step clock is a fake one (1 ms a reading, plus the
    proposer's 100 ms), so the guard's decisions do not depend on this machine's load."""
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    off = make_engine(tiny_model_dir, "off")
    want = off.generate([PROMPTS[0]], params)[0].token_ids
    engine = make_engine(tiny_model_dir, "suffix")
    engine.speculator.speed_guard = SMALL
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(llm_engine, "time",
                        SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic))
    plan = engine.speculator._plan

    def slow_plan(requests, rooms, num_plain_tokens, budget):  # type: ignore[no-untyped-def]
        if any(engine.speculator.speculates(r) for r in requests):
            clock[0] += 0.1  # (the tiny model accepts up to 17 tokens a step)
        plan(requests, rooms, num_plain_tokens, budget)

    engine.speculator._plan = slow_plan  # type: ignore[method-assign]
    free = engine.kv.num_free_blocks
    got = engine.generate([PROMPTS[0]], params)[0].token_ids
    assert got == want and engine.kv.num_free_blocks == free
    guard = engine.speculator.guards["suffix"]
    assert guard.state == "suspended" and engine.speculator.num_guard_suspensions == 1
    assert engine.speculator.num_guard_off_steps == guard.num_off_steps > 40
    # with the guard off, the same engine speculates on every step again
    engine.speculator.speed_guard, engine.speculator.guards = None, {}
    assert engine.generate([PROMPTS[0]], params)[0].token_ids == want
