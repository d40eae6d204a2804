"""Who is urgent this step: a request's effective priority, and the background share.

Priorities are integers, lower first; those ``<= INTERACTIVE`` are interactive, greater ones
background (batch jobs). A waiting request's effective priority improves by one level per
``aging_s`` seconds since its arrival, so background work is never starved forever. While
interactive work runs, background requests share at most ``background_tokens_with_interactive``
tokens of each step (default 0: they pause; on a compute-bound CPU every extra row slows every
interactive token); aging lifts a long-waiting background request into the interactive class,
so the batch job always progresses. Without interactive work, background steps stay at most
``background_tokens_per_step`` tokens, so that an arriving interactive request never waits
long for the step in flight.

:class:`Priorities` is the scheduler's: :meth:`start_step` fixes the step's clock and share,
then the scheduler asks :meth:`key` (ordering), :meth:`cap` (tokens a request may take) and
:meth:`spend` (tokens it took). It is the only writer of the share.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from quickdraft.engine.request import Request

__all__ = ["INTERACTIVE", "Priorities"]

INTERACTIVE = 0  # priorities <= this are interactive; greater ones are background


@dataclass
class Priorities:
    aging_s: float | None = 30.0  # None: no aging
    background_tokens_with_interactive: int = 0
    background_tokens_per_step: int = 64
    now: float = field(default_factory=time.monotonic)  # the step's clock (for aging)
    background_budget: int = 0  # this step's background tokens left (may go below 0)

    def start_step(self, requests: Iterable[Request]) -> None:
        """A new step over ``requests`` (running and waiting): its clock, and its background
        share, smaller while any of them is interactive."""
        self.now = time.monotonic()
        interactive = any(r.priority <= INTERACTIVE for r in requests)
        self.background_budget = (self.background_tokens_with_interactive if interactive
                                  else self.background_tokens_per_step)

    def key(self, request: Request) -> tuple[float, float]:
        """(effective priority, arrival): lower runs first."""
        priority: float = request.priority
        if self.aging_s:
            priority -= (self.now - request.arrival_time) // self.aging_s
        return priority, request.arrival_time

    def is_background(self, request: Request) -> bool:
        """Whether ``request`` counts against the background share (aging can lift it out)."""
        return self.key(request)[0] > INTERACTIVE

    def cap(self, request: Request, budget: int) -> int:
        """Tokens ``request`` may take this step: the budget, or less for background work."""
        if not self.is_background(request):
            return budget  # interactive, or background aged into the interactive class
        # (the share can go below 0: drafts granted to several background requests in one
        # step may together exceed it; nothing more runs then, and never a negative chunk)
        return max(min(budget, self.background_budget), 0)

    def spend(self, request: Request, num_tokens: int) -> None:
        """``request`` takes ``num_tokens`` of this step (from the share if background)."""
        if self.is_background(request):
            self.background_budget -= num_tokens
