"""What drafting costs, as served: the start-up timing of a draft model's (or head's) proposals
corrected by how long its proposals really take.

The engine times proposals once at start-up (``engine.startup_costs.measure_draft_costs``):
warm, in a loop, one new position to catch up. In serving a proposal runs right after a
target step that has streamed the weights through the caches, and it first catches up on
every position verified since the request's last proposal. On the 2-core AVX2-only Zen 4
(2026-11-29, SmolLM2 and its shipped head) a head proposal timed 0.36-0.41 ms at start-up
took 0.70-0.85 ms after one new position, 1.1-1.4 ms after 2-8 and 3-4 ms after an idle
spell (docs/benchmarks.md, session 52): priced at the start-up figure, the head drafted
where it lost. The target's rows were already priced from observed steps
(:class:`spec.step_cost.ObservedStepCost`); this does the same for the proposals.

The policy prices ``depth`` drafts for ``batch`` requests at ``depth * per_draft(batch) +
fixed(batch)`` (:meth:`spec.policy._Plan.with_draft_model`). Each proposal's time over that
start-up figure is one ratio; the policy's costs are the start-up ones times the median of
the last ``window`` ratios (1.0 until ``min_samples`` proposals were timed), bounded to
``bounds``. Priced out, a method makes no proposals and so no new ratios: after
``stale_steps`` steps (:meth:`ObservedDraftCost.tick`, once a step) without one, the ratios
are forgotten and the start-up figure stands until ``min_samples`` new proposals were timed,
so a ratio from a busy spell does not switch drafting off for good (a few proposals at the
start-up price every ``stale_steps`` steps while it stays priced out).

Invariant: the speculator (each step, and after each proposal) is the only writer; the ratio
is finite and within ``bounds``, and 1.0 while fewer than ``min_samples`` ratios are kept.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from quickdraft.spec.step_cost import StepCost

__all__ = ["ObservedDraftCost"]


class ObservedDraftCost:
    """Start-up ``per_draft`` and ``fixed`` costs by batch size, scaled by observation."""

    def __init__(self, per_draft: StepCost, fixed: StepCost | None = None, window: int = 16,
                 min_samples: int = 4, bounds: tuple[float, float] = (0.5, 10.0),
                 stale_steps: int = 256) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need window >= 1 and 1 <= min_samples <= window")
        if not 0.0 < bounds[0] <= 1.0 <= bounds[1]:
            raise ValueError(f"bounds must hold 1.0 and be positive, not {bounds}")
        self.base_per_draft, self.base_fixed = per_draft, fixed
        self.min_samples, self.bounds, self.stale_steps = min_samples, bounds, stale_steps
        self._ratios: deque[float] = deque(maxlen=window)
        self._ratio = 1.0
        self._idle_steps = 0  # steps since the last observation

    @property
    def ratio(self) -> float:
        """Observed proposal time over the start-up figure (median of the recent ones)."""
        return self._ratio

    @property
    def num_samples(self) -> int:
        return len(self._ratios)

    def modeled(self, batch: int, depth: int) -> float:
        """The start-up figure for ``depth`` drafts for ``batch`` requests, in seconds."""
        fixed = self.base_fixed(batch) if self.base_fixed is not None else 0.0
        return depth * self.base_per_draft(batch) + fixed

    def tick(self) -> None:
        """One engine step passed; forget the ratios after ``stale_steps`` without one."""
        self._idle_steps += 1
        if self._ratios and self._idle_steps > self.stale_steps:
            self._ratios.clear()
            self._ratio = 1.0

    def observe(self, batch: int, depth: int, seconds: float) -> None:
        """A proposal of ``depth`` drafts for ``batch`` requests took ``seconds``."""
        modeled = self.modeled(batch, depth)
        if batch < 1 or depth < 1 or not modeled > 0.0 or not 0.0 < seconds < math.inf:
            return
        self._ratios.append(seconds / modeled)
        self._idle_steps = 0
        if len(self._ratios) >= self.min_samples:
            low, high = self.bounds
            self._ratio = min(max(statistics.median(self._ratios), low), high)
        self.check_invariants()

    def per_draft(self, batch: int) -> float:
        """What the policy prices one draft at (seconds, ``batch`` requests drafting)."""
        return self.base_per_draft(batch) * self._ratio

    def fixed(self, batch: int) -> float:
        """What the policy prices a proposal at whatever its depth (seconds)."""
        return self.base_fixed(batch) * self._ratio if self.base_fixed is not None else 0.0

    def check_invariants(self) -> None:
        low, high = self.bounds
        assert low <= self._ratio <= high, (self._ratio, self.bounds)
        assert len(self._ratios) >= self.min_samples or self._ratio == 1.0, self._ratio
        assert all(0.0 < r < math.inf for r in self._ratios), self._ratios
