"""Outgoing events of one WebSocket session, queued until the socket can take them (Sans-I/O).

Text deltas of a response that are still queued absorb the response's later text, so a lagging
client gets fewer, larger deltas while the engine never waits for it. Sequence numbers count
the deltas actually sent per response, so they stay gap-free however much was merged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]


@dataclass
class _Delta:
    response_id: str
    item_id: str
    sequence_number: int
    parts: list[str]
    num_tokens: int

    def render(self) -> JSON:
        return {"type": "response.output_text.delta", "response_id": self.response_id,
                "item_id": self.item_id, "sequence_number": self.sequence_number,
                "delta": "".join(self.parts), "num_tokens": self.num_tokens}


class Outbox:
    def __init__(self) -> None:
        self._queue: deque[JSON | _Delta] = deque()
        self._pending: dict[str, _Delta] = {}  # response id -> its queued delta
        self._next_sequence: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def emit(self, event: JSON) -> None:
        self._queue.append(event)

    def delta(self, response_id: str, item_id: str, text: str, num_tokens: int) -> None:
        pending = self._pending.get(response_id)
        if pending is not None:
            pending.parts.append(text)
            pending.num_tokens += num_tokens
            return
        sequence = self._next_sequence.get(response_id, 0)
        self._next_sequence[response_id] = sequence + 1
        delta = _Delta(response_id, item_id, sequence, [text], num_tokens)
        self._pending[response_id] = delta
        self._queue.append(delta)

    def end(self, response_id: str) -> None:
        """The response is over: no more deltas for it (a queued one is still sent)."""
        self._pending.pop(response_id, None)
        self._next_sequence.pop(response_id, None)

    def pop(self) -> JSON | None:
        """The next event to send, or None when nothing is queued."""
        if not self._queue:
            return None
        event = self._queue.popleft()
        if isinstance(event, _Delta):
            if self._pending.get(event.response_id) is event:
                del self._pending[event.response_id]
            return event.render()
        return event

    def clear(self) -> None:
        self._queue.clear()
        self._pending.clear()
        self._next_sequence.clear()
