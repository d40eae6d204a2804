"""The step-cost curve the speculation policy prices drafts with: a target step's time by
its query tokens, measured at start-up (:func:`measure_step_cost`) and corrected by what
steps take while serving (:class:`ObservedStepCost`)."""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class StepCost:
    """Relative cost of a forward pass with ``n`` query tokens (piecewise linear, extrapolated
    with the last slope; a table of one size is flat: e.g. a draft head's cost by batch
    measured where the engine runs one request at a time)."""

    num_tokens: tuple[int, ...]  # increasing, starting at 1
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.num_tokens or self.num_tokens[0] != 1:
            raise ValueError("cost table must start at 1 token")
        if len(self.num_tokens) != len(self.seconds):
            raise ValueError("cost table columns differ in length")

    def __call__(self, n: int) -> float:
        xs, ys = self.num_tokens, self.seconds
        if n <= xs[0] or len(xs) == 1:
            return ys[0]
        i = bisect.bisect_left(xs, n)
        if i == len(xs):  # extrapolate with the last slope
            x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        else:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    @classmethod
    def memory_bound(cls, per_token: float = 0.01) -> StepCost:
        """A default when nothing was measured: each extra token costs ``per_token`` of a step."""
        return cls((1, 1024), (1.0, 1.0 + per_token * 1023))


def measure_step_cost(run: Callable[[int], float], sizes: Sequence[int] = (1, 2, 4, 8, 16, 32,
                                                                           64, 128),
                      budget_s: float = 4.0, rounds: int = 3) -> StepCost:
    """Time ``run(n)`` (a forward pass with n query tokens) for each size in increasing
    order, then again in up to ``rounds - 1`` more rounds over the same sizes while a whole
    round fits in ``budget_s``, alternately in decreasing and increasing order; keep each
    size's best and make the curve non-decreasing. Stops adding sizes once ``budget_s`` is
    spent (a big model on a CPU): :class:`StepCost` extrapolates.

    Alternating the order: each size after a round's first is timed right after a size
    next to it. In increasing rounds only, the smallest sizes came right after the largest:
    on the 2-core AMX Xeon (2026-11-30) a 1-row SmolLM2 step timed right after 64-row steps
    (AMX tile multiplies) took 6.1-6.9 ms in two of three curves measured in one process,
    against 3.6-4.1 ms in a loop of small steps, and with the curve made non-decreasing 1-,
    2- and 4-row steps came out equal: drafts looked free at start-up.

    Rounds, not each size's repeats in a row: a neighbour slows the host for seconds at a
    time, and a size timed only inside such a spell bends the curve (on the 2-core AVX2-only
    Zen 3, 2026-11-28, two start-ups priced the ninth row of an 8-row step at +9.5 % and
    +1.9 %); over interleaved rounds each size gets its quietest round."""
    deadline = time.perf_counter() + budget_s
    xs: list[int] = []
    best: list[float] = []
    for n in sizes:
        if len(xs) >= 2 and time.perf_counter() > deadline:
            break
        xs.append(n)
        best.append(run(n))
    for r in range(1, rounds):
        if time.perf_counter() + sum(best) > deadline:
            break
        order = range(len(xs) - 1, -1, -1) if r % 2 else range(len(xs))
        for i in order:
            best[i] = min(best[i], run(xs[i]))
    seconds = list(accumulate(best, max))
    return StepCost(tuple(xs), tuple(seconds))


class ObservedStepCost:
    """The start-up curve corrected by what steps take while serving.

    A neighbour on the host can slow steps for minutes, and not evenly: on the 2-core
    AVX512-BF16 EPYC a 1-row step went from 6.0 to 8.1 ms in a busy spell while a 4-row
    step went from 7.1 to 12.0 ms (each row +0.36 ms quiet, +1.3 ms busy). The policy prices
    ``k`` drafts by ``cost(N + k) / cost(N)``, so a curve measured in a quiet spell grants
    drafts that no longer pay. Per step size ``n`` this keeps the last ``window`` ratios
    ``observed / start-up`` and prices ``cost(n) = start-up(n) * median ratio``. A size
    without ``min_samples`` recent observations (within ``stale_steps`` steps) borrows
    its ratio from the sizes that have them (interpolated, or the nearest), so it
    is tried again when the neighbour leaves; with none, the start-up curve stands.

    A draft row is never priced below what it adds on the start-up curve: a size's time
    over the start-up curve's (``start-up(n) * (ratio - 1)``) is floored at the largest
    such excess of a smaller observed size, so ``cost(N + k) - cost(N)`` is at least
    ``start-up(N + k) - start-up(N)`` between observed sizes. What the policy weighs is
    ``cost(N + k) / cost(N)``, a small difference of two noisy medians: priced by each
    size's own median, noise made larger steps look relatively cheap. Measured (2026-11-28,
    2-core AVX2-only Zen 3, 8 decoding requests, each its own context, which the one-context
    start-up curve does not have): ratio 1.20 at 8 tokens and 1.13 at 9 priced the ninth
    row at +2 % of the step; it was timed at +8 % (start-up curve: +9 %). A busy neighbour
    raises larger sizes' excess more (see above), which the floor keeps; a constant
    overhead (sampling, which the start-up curve does not time) is one excess at every size,
    which it keeps too. The floor takes the largest of noisy excesses, so noise prices rows
    too high the other way: hence a window of 32 steps (it was 8; at C=1 a size's median of
    8 then ran from +15 % to +58 % of a 1-row step for one draft row within a run, on the
    2-core AMX Xeon, 2026-11-30; with 32, spec_bench C=1 suffix came out 1.199x against
    1.163x in one process, arms alternating). At C=1 a 1-row step's 32 take ~0.15 s: a busy
    spell still shows within a second.

    What a step costs outside the model's forward (scheduling, proposals, outputs: 0.26 ms
    a SmolLM2 step at C=1 without drafts, 0.56 ms with suffix drafts, on the 2-core AMX
    Xeon, 2026-11-30) is paid once a step however many rows it has: it is observed apart
    and its median (``overhead``) added to every size, which makes a draft row cheaper
    relative to the step it joins (spec_bench C=1 suffix 1.211x against 1.205x without it;
    with a constant 0.6 / 1.2 ms added, 1.230x / 1.242x against 1.219x; arms alternating
    in one process). Not folded into each size's ratio: the steps with drafts are those
    whose look-ups found something, which cost more than look-ups that found nothing but
    were paid whether or not the drafts were granted (folded in, ``cost(2) / cost(1)``
    came out 1.26 against 1.15 over the model's forward alone).

    Refreshed once ``refresh_seconds`` of observed steps (model + overhead) have passed,
    not after each step: recomputing the medians, the floor and the cached prices after
    every step cost the plan ~45 us a step (``observe`` 21 us, the first price of a plan 27
    us, SmolLM2 at C=1 on the 2-core AVX512-BF16 Zen 4 EPYC, 2026-11-30: Python's state is
    cold after a model step), ~1 % of a 4 ms step, nothing beside a 1.5B model's 30 ms one.
    The engine's 30 ms is ~7 SmolLM2 steps at C=1, 3 at C=8 (one engine, arms alternating,
    every 30 ms against every step: C=1 1.254x -> 1.263x, C=8 1.038x -> 1.053x, 4 rounds
    each, ahead in every round), and every step of a model whose steps take longer, as
    before. The window (32 steps) is what the estimates average over; a refresh only
    decides how soon a plan sees them.

    Invariant: the observer (the engine, after each step) is the only writer; every
    ratio is finite and > 0, the overhead finite and >= 0; the excess ``start-up(n) *
    (ratio(n) - 1)`` does not decrease with the observed size ``n``."""

    def __init__(self, base: StepCost, window: int = 32, min_samples: int = 3,
                 stale_steps: int = 256, max_tokens: int = 1024,
                 refresh_seconds: float = 0.0) -> None:
        if not 0.0 <= refresh_seconds < float("inf"):
            raise ValueError("refresh_seconds must be finite and >= 0")
        self.base = base
        self.window, self.min_samples = window, min_samples
        self.stale_steps, self.max_tokens = stale_steps, max_tokens
        self.refresh_seconds = refresh_seconds
        self._samples: dict[int, deque[float]] = {}
        # the median of each size's samples once it has min_samples, recomputed at a
        # refresh for the sizes observed since the last one (``_dirty``)
        self._medians: dict[int, float] = {}
        self._dirty: set[int] = set()
        self._since_refresh = 0.0  # seconds of steps observed since the last refresh
        self._recent: deque[float] = deque(maxlen=64)  # every size's ratios, for /metrics
        self._last_seen: dict[int, int] = {}
        self._step = 0
        self._ratios: tuple[tuple[int, ...], tuple[float, ...]] | None = None  # cache
        self._costs: dict[int, float] = {}  # cost(n) since the last refresh (a plan
        # prices the same few sizes many times)
        self._overheads: deque[float] = deque(maxlen=window)
        self._overhead = 0.0  # their median: what a step costs besides the model's

    def observe(self, num_tokens: int, seconds: float, overhead: float | None = None
                ) -> None:
        """A model step over ``num_tokens`` query tokens took ``seconds``; the rest of
        the engine's step (scheduling, proposals, sampling's bookkeeping, outputs; not a
        draft model's forwards) ``overhead``, if given. Kept only: the estimates are
        recomputed when priced next once ``refresh_seconds`` of steps have been observed
        (see :meth:`ratios`)."""
        self._step += 1
        if overhead is not None and 0.0 <= overhead < float("inf"):
            self._overheads.append(overhead)
            self._since_refresh += overhead
        if 0.0 < seconds < float("inf"):
            self._since_refresh += seconds
        if self._since_refresh >= self.refresh_seconds:
            self._ratios = None
            self._costs.clear()
        if not 1 <= num_tokens <= self.max_tokens or not seconds > 0.0:
            return
        ratio = seconds / self.base(num_tokens)
        assert ratio > 0.0 and ratio != float("inf"), (num_tokens, seconds)
        samples = self._samples.get(num_tokens)
        if samples is None:
            samples = self._samples[num_tokens] = deque(maxlen=self.window)
        samples.append(ratio)
        self._dirty.add(num_tokens)
        self._recent.append(ratio)
        self._last_seen[num_tokens] = self._step

    @property
    def overhead(self) -> float:
        """What a step costs besides the model's forward (median of the last ``window``, as
        of the last refresh: what the prices include). A plain read (``/metrics`` asks from
        another thread)."""
        return self._overhead

    def recent_ratio(self) -> float:
        """How much slower the last 64 steps ran than the start-up curve says for their sizes
        (median of observed / start-up; 1.0 before any step)."""
        return statistics.median(self._recent) if self._recent else 1.0

    @property
    def num_steps(self) -> int:
        """Steps observed so far."""
        return self._step

    def num_samples(self, num_tokens: int) -> int:
        """Ratios kept for steps of ``num_tokens`` query tokens."""
        return len(self._samples.get(num_tokens, ()))

    def ratios(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The step sizes with a current estimate and their median ratios (ascending), as of
        the last refresh: recomputed here (each size observed since then gets its median
        again, stale sizes are dropped) once ``refresh_seconds`` of steps have passed."""
        if self._ratios is None:
            self._since_refresh = 0.0
            for n in self._dirty:
                samples = self._samples.get(n)
                if samples is not None and len(samples) >= self.min_samples:
                    self._medians[n] = statistics.median(samples)
            self._dirty.clear()
            if self._overheads:
                self._overhead = statistics.median(self._overheads)  # (>= 0: each is)
            oldest = self._step - self.stale_steps
            for n in [n for n, seen in self._last_seen.items() if seen < oldest]:
                # (bounds the work to sizes seen lately, e.g. prefills)
                del self._samples[n], self._last_seen[n]
                self._medians.pop(n, None)
            sizes = sorted(self._medians)
            base = [self.base(n) for n in sizes]
            # each size's time over the start-up curve's, floored at the most a smaller
            # size's is over it (see the class docstring)
            excess = accumulate((b * (self._medians[n] - 1.0)
                                 for n, b in zip(sizes, base, strict=True)), max)
            self._ratios = (tuple(sizes),
                            tuple(1.0 + e / b for b, e in zip(base, excess, strict=True)))
            assert all(0.0 < r < float("inf") for r in self._ratios[1]), self._ratios
        return self._ratios

    def __call__(self, n: int) -> float:
        cost = self._costs.get(n)
        if cost is None:
            cost = self._costs[n] = self._cost(n)
        return cost

    def _cost(self, n: int) -> float:
        sizes, ratios = self.ratios()
        if not sizes:
            return self.base(n) + self._overhead
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            ratio = ratios[i]
        elif i == 0:
            ratio = ratios[0]
        elif i == len(sizes):
            ratio = ratios[-1]
        else:
            x0, x1 = sizes[i - 1], sizes[i]
            ratio = ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (n - x0) / (x1 - x0)
        return self.base(n) * ratio + self._overhead
