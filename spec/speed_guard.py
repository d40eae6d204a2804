"""Speculation must not make serving slower: a check of realised speed against the plain path.

The policy (:mod:`spec.policy`) prices each step's drafts against the same step without them:
measured verification rows, proposer time, acceptance. What it cannot see is a cost that a
method adds to every step, drafting or not. On a GPU the draft head needs the target's
features on each step, and those steps run eagerly instead of replaying CUDA graphs: on an
H200 a head step took ~18 ms against 1.9 ms for a plain one, and ``head`` ran 0.14x of
``off`` while the policy kept drafting (docs/benchmarks.md, "Speculation on an H200,
session 46"). Steps without drafts were just as slow, so nothing the policy compares showed it.

So each method has a :class:`SpeedGuard` that compares the method's realised tokens per
second with the plain path's, by alternating **epochs** of ``epoch_steps`` steps in which the
method speculates (on) or does not at all (off: no proposals, no features, so the plain
path runs, CUDA graphs included). Only steps whose decoding requests all use the method and
that carry no prefill count; an epoch's steps must all have the same number of requests
(its **shape**), and its first step is not timed (after a switch, the head drafts from the
second step on). Two adjacent epochs of the same shape and opposite modes give a ratio
``on rate / off rate``.

States (``warmup`` until ``warmup_steps`` counted steps, so short runs and most tests never see
an off epoch):

- ``probing``: epochs alternate on, off, on, ...; after ``min_pairs`` ratios the median
  decides: below ``suspend_below`` -> ``suspended``, else ``trusted``;
- ``trusted``: on epochs, one off epoch after every ``interval`` (``explore_epochs``,
  doubling after each confirming ratio up to its maximum): a ratio below the threshold
  asks again after the shortest interval, and a second one in a row goes back to
  ``probing`` (an off epoch in a copy-heavy stretch against an on epoch without drafts
  looks like a loss: one low ratio is often the content);
- ``suspended``: off epochs, one on epoch after every ``interval`` (``hold_epochs``,
  doubling likewise): a ratio at or above the threshold goes back to ``probing``.

The threshold is well below 1: the guard is there for losses the policy cannot see, not to
second-guess it on a noisy machine (the 2-core CPUs drift by up to 40 % within minutes).
What it costs where speculation pays: the off epochs, one in ``interval + 1`` once trusted.

Invariant: the engine (after each step) is the only writer; ``speculate_now()`` changes only
in :meth:`SpeedGuard.observe`, so one step's plan and its runner agree; the state's bounds
(an epoch shorter than ``epoch_steps``, no off step during the warm-up, finite positive
ratios, the interval within its state's range) are asserted after every observation
(:meth:`SpeedGuard.check_invariants`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedGuardConfig:
    epoch_steps: int = 8  # steps in an epoch (its first one untimed)
    warmup_steps: int = 256  # counted steps before the first off epoch
    min_pairs: int = 3  # ratios a probing phase needs before it decides
    suspend_below: float = 0.85  # median on/off ratio under which speculation stops
    explore_epochs: tuple[int, int] = (4, 64)  # trusted: on epochs between off ones
    hold_epochs: tuple[int, int] = (16, 512)  # suspended: off epochs between probes

    def __post_init__(self) -> None:
        if self.epoch_steps < 2:
            raise ValueError(f"epoch_steps must be at least 2, not {self.epoch_steps}")
        if self.warmup_steps < 0 or self.min_pairs < 1:
            raise ValueError("warmup_steps must be >= 0 and min_pairs >= 1")
        if not 0.0 < self.suspend_below <= 1.0:
            raise ValueError(f"suspend_below must be in (0, 1], not {self.suspend_below}")
        for name in ("explore_epochs", "hold_epochs"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high")


@dataclass
class _Epoch:
    on: bool
    shape: int | None = None  # requests per step; None until the first counted step
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpeedGuard:
    """One method's check (see the module docstring)."""

    def __init__(self, config: SpeedGuardConfig | None = None) -> None:
        self.config = config or SpeedGuardConfig()
        self.state = "warmup"
        self.num_steps = 0  # counted steps
        self.num_off_steps = 0  # counted steps held off
        self.num_suspensions = 0
        self.ratios: deque[float] = deque(maxlen=max(self.config.min_pairs, 3) * 2 + 1)
        self._epoch = _Epoch(on=True)
        self._last: _Epoch | None = None  # the last complete epoch
        self._interval = 0
        self._countdown = 0  # epochs left in the current mode (trusted / suspended)
        self._doubted = False  # trusted: the last exploring ratio was below the threshold

    def speculate_now(self) -> bool:
        """Whether the method speculates in the coming step."""
        return self._epoch.on

    @property
    def median_ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def observe(self, num_requests: int, tokens: int, seconds: float) -> None:
        """A counted step: ``num_requests`` decoding requests of this method (no prefill, no
        other method's) emitted ``tokens`` in ``seconds`` of engine step."""
        self.num_steps += 1
        if not self._epoch.on:
            self.num_off_steps += 1
        if self.state == "warmup":
            if self.num_steps >= self.config.warmup_steps:
                self._start_probing()
            self.check_invariants()
            return
        epoch = self._epoch
        if epoch.shape != num_requests:
            if epoch.shape is not None:  # the batch changed: this epoch starts again
                self._epoch = epoch = _Epoch(on=epoch.on)
                self._last = None
            epoch.shape = num_requests
        elif epoch.steps > 0:  # (the first step is not timed)
            epoch.tokens += tokens
            epoch.seconds += seconds
        epoch.steps += 1
        if epoch.steps >= self.config.epoch_steps:
            self._end_epoch(epoch)
        self.check_invariants()

    def check_invariants(self) -> None:
        """After each :meth:`observe` (asserted there)."""
        c = self.config
        assert self.state in ("warmup", "probing", "trusted", "suspended"), self.state
        assert 0 <= self._epoch.steps < c.epoch_steps, self._epoch.steps
        assert 0 <= self.num_off_steps <= self.num_steps
        assert self.state != "warmup" or (self._epoch.on and self.num_off_steps == 0)
        assert all(r > 0.0 and math.isfinite(r) for r in self.ratios), self.ratios
        if self.state in ("trusted", "suspended"):
            low, high = c.explore_epochs if self.state == "trusted" else c.hold_epochs
            assert low <= self._interval <= high, (self.state, self._interval)

    def _start_probing(self) -> None:
        self.state, self._doubted = "probing", False
        self.ratios.clear()
        self._last = None
        self._epoch = _Epoch(on=True)

    def _end_epoch(self, epoch: _Epoch) -> None:
        ratio = None
        last = self._last
        if last is not None and last.on != epoch.on and last.shape == epoch.shape \
                and last.rate > 0 and epoch.rate > 0:
            on, off = (epoch, last) if epoch.on else (last, epoch)
            ratio = on.rate / off.rate
            self.ratios.append(ratio)
        self._last = epoch
        self._epoch = _Epoch(on=self._next_mode(ratio, epoch.on))

    def _next_mode(self, ratio: float | None, was_on: bool) -> bool:
        """The mode of the next epoch, after an epoch of mode ``was_on`` (and its ratio)."""
        c = self.config
        if self.state == "probing":
            if len(self.ratios) < c.min_pairs:
                return not was_on
            median = statistics.median(self.ratios)
            if median < c.suspend_below:
                self.state, self._interval = "suspended", c.hold_epochs[0]
                self.num_suspensions += 1
            else:
                self.state, self._interval = "trusted", c.explore_epochs[0]
            self._countdown = self._interval
            return self.state == "trusted"
        if ratio is not None and (self.state == "trusted") == (was_on is False):
            # the exploring epoch (off when trusted, on when suspended) gave a ratio
            disagrees = (ratio < c.suspend_below) == (self.state == "trusted")
            low, high = c.explore_epochs if self.state == "trusted" else c.hold_epochs
            if disagrees and (self.state == "suspended" or self._doubted):
                self._start_probing()  # look again
                return True
            if disagrees:  # trusted: one low ratio may be the content; ask again soon
                self._doubted, self._interval = True, low
            else:
                self._doubted, self._interval = False, min(2 * self._interval, high)
            self._countdown = self._interval
        default = self.state == "trusted"
        if was_on != default:  # an exploring epoch without a ratio: back to the default
            self._countdown = self._interval
            return default
        self._countdown -= 1
        return default if self._countdown > 0 else not default
