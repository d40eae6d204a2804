"""Admission control: plain counters (no I/O, no asyncio), shared by every endpoint.

The WebSocket protocol core and the HTTP handlers ask :class:`Admission` before they start an
engine request and give the slot back when the request ends, whatever the ending. While the
server drains, every new request is refused.
"""

from __future__ import annotations

from quickdraft.server.errors import ProtocolError, rate_limited, shutting_down


class Admission:
    """At most ``limit`` engine requests in flight, across all connections."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the in-flight limit must be >= 1")
        self.limit = limit
        self.in_flight = 0
        self.draining = False

    def try_acquire(self) -> ProtocolError | None:
        """Take a slot, or say why not (the caller reports the error)."""
        if self.draining:
            return shutting_down()
        if self.in_flight >= self.limit:
            return rate_limited(f"the server is at its limit of {self.limit} requests in "
                                "flight; retry shortly")
        self.in_flight += 1
        return None

    def release(self) -> None:
        assert self.in_flight > 0, "release() without a matching try_acquire()"
        self.in_flight -= 1


class Slot:
    """One acquired admission slot that is released exactly once, however often asked."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.release()
            self._admission = None


class ConnectionLimit:
    """Open WebSocket sessions, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def try_open(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def close(self) -> None:
        assert self.open > 0
        self.open -= 1
