"""Adaptive speculation: how many draft tokens each request verifies this step.

Per request we keep ``alpha``, a running estimate of the chance that one draft token is
accepted. With ``k`` drafts a step emits ``E(k) = 1 + alpha + ... + alpha^k`` tokens on
average, and the k-th extra draft adds ``alpha^k``. The step's cost is ``cost(N)`` for ``N``
query tokens in the batch, measured at start-up (:func:`measure_step_cost`): flat while the
verify batch is memory-bound, rising once it is compute-bound.

Each step, drafts are granted one at a time to the request with the largest marginal gain
while ``(tokens + gain) / cost(N + 1) > tokens / cost(N)``, i.e. while speculation raises the
batch's tokens per second. A request whose acceptance has collapsed therefore gets ``k = 0``
(speculation off); it is probed again with one draft every ``probe_interval`` steps so that
``alpha`` can recover. When the batch is large, the cost curve turns speculation down for
everyone.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCost:
    """Relative cost of a forward pass with ``n`` query tokens (piecewise linear)."""

    num_tokens: tuple[int, ...]  # increasing, starting at 1
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.num_tokens or self.num_tokens[0] != 1:
            raise ValueError("cost table must start at 1 token")
        if len(self.num_tokens) != len(self.seconds):
            raise ValueError("cost table columns differ in length")

    def __call__(self, n: int) -> float:
        xs, ys = self.num_tokens, self.seconds
        if n <= xs[0]:
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
                                                                           64, 128)) -> StepCost:
    """Time ``run(n)`` (a forward pass with n query tokens) for each size; keep the best of 3
    and make the curve non-decreasing."""
    seconds: list[float] = []
    for n in sizes:
        best = min(run(n) for _ in range(3))
        seconds.append(max(best, seconds[-1] if seconds else 0.0))
    return StepCost(tuple(sizes), tuple(seconds))


@dataclass
class AcceptanceTracker:
    """Per-request acceptance estimate (exponential moving average over verified drafts)."""

    alpha: float = 0.6  # optimistic prior: the first drafts are worth trying
    decay: float = 0.7
    steps_since_probe: int = 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        # A rejection at position a says nothing about positions past a: count the drafts
        # that were actually tested (accepted ones plus the rejected one).
        tested = min(num_accepted + 1, num_drafted)
        rate = num_accepted / tested
        self.alpha = self.decay * self.alpha + (1 - self.decay) * rate


@dataclass
class SpeculationPolicy:
    cost: StepCost = field(default_factory=StepCost.memory_bound)
    max_k: int = 4
    min_alpha: float = 0.05
    probe_interval: int = 16

    def allocate(self, alphas: Sequence[float], available: Sequence[int],
                 num_plain_tokens: int) -> list[int]:
        """Draft counts per request. ``available[i]``: drafts request i could verify (proposer
        output, already capped); ``num_plain_tokens``: the step's tokens without drafts."""
        ks = [0] * len(alphas)
        tokens = float(len(alphas))  # every request emits at least one token
        n = max(num_plain_tokens, 1)
        heap = [(-a, i) for i, a in enumerate(alphas) if available[i] > 0 and a > self.min_alpha]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if (tokens + gain) / self.cost(n + 1) <= tokens / self.cost(n):
                break
            ks[i] += 1
            tokens += gain
            n += 1
            if ks[i] < min(available[i], self.max_k):
                heapq.heappush(heap, (-(gain * alphas[i]), i))
        return ks
