"""One streaming response: ``async for delta in stream`` over its text deltas.

The events that create it (message items, ``response.create``, clean-up) are sent when it is
first iterated (or :meth:`ResponseStream.start` is awaited). A failure raises
:class:`APIError`; a dropped socket raises :class:`ConnectionLostError`. Leaving the loop early
cancels the response on the server (as ``async with`` and :meth:`ResponseStream.aclose` do).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from quickdraft.client.connection import Connection, Inbox
from quickdraft.client.errors import APIError, ConnectionClosedError, QuickdraftError
from quickdraft.client.events import ResponseCreated, ResponseDone, ResponseEvent, TextDelta

JSON = dict[str, Any]
class ResponseStream:
    """A response of the server; iterate it once (one consumer)."""

    def __init__(self, conn: Connection, response: JSON, *, before: list[JSON] | None = None,
                 after: list[JSON] | None = None) -> None:
        self._conn = conn
        self._events = [*(before or []), {"type": "response.create", "response": response},
                        *(after or [])]
        self._n_before = len(before or [])
        self._inbox: Inbox = asyncio.Queue()
        self._started = False
        self._finished = False
        self._holds_slot = False
        self._cancel_requested = False
        self._response_event_id: str | None = None
        self._ignored: set[str] = set()  # event ids whose errors do not matter (clean-up)
        self._failure: APIError | None = None
        self._parts: list[str] = []
        self.created: ResponseCreated | None = None
        self.done: ResponseDone | None = None

    # ------------------------------------------------------------------ state

    @property
    def response_id(self) -> str | None:
        return self.created.response_id if self.created else None

    @property
    def text(self) -> str:
        """The text received so far (all of it once done)."""
        return "".join(self._parts)

    @property
    def finished(self) -> bool:
        return self._finished

    async def start(self) -> None:
        """Send the events (waits for a free response slot on the socket). Idempotent."""
        if self._started:
            return
        self._started = True
        try:
            await self._conn.acquire_slot()
            self._holds_slot = True
            ids = await self._conn.send_events(self._events, self._inbox)
        except BaseException:
            self._finish()
            raise
        self._response_event_id = ids[self._n_before]
        self._ignored.update(ids[self._n_before + 1:])

    # ------------------------------------------------------------------ reading

    def __aiter__(self) -> AsyncIterator[TextDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[TextDelta]:
        try:
            while (event := await self.next_event()) is not None:
                if isinstance(event, TextDelta):
                    yield event
        finally:
            if not self._finished:
                self._conn.spawn(self.aclose())  # left early: cancel it on the server

    async def events(self) -> AsyncIterator[ResponseEvent]:
        """Every typed event: ResponseCreated, TextDeltas, then ResponseDone."""
        try:
            while (event := await self.next_event()) is not None:
                yield event
        finally:
            if not self._finished:
                self._conn.spawn(self.aclose())

    async def next_event(self) -> ResponseEvent | None:
        """The next event; None once the response is done."""
        if self._finished:
            return None
        await self.start()
        while True:
            item = await self._inbox.get()
            if isinstance(item, ConnectionClosedError):
                self._finish()
                raise item
            event = self._handle(item)
            if event is not None:
                return event

    async def result(self) -> ResponseDone:
        """Read to the end; the ``response.done`` (its ``text`` is the whole answer)."""
        while await self.next_event() is not None:
            pass
        if self.done is None:
            raise QuickdraftError("the response ended without response.done")
        return self.done

    def _handle(self, event: JSON) -> ResponseEvent | None:
        kind = event.get("type")
        if kind == "response.output_text.delta":
            delta = TextDelta.from_event(event)
            self._parts.append(delta.text)
            return delta
        if kind == "response.created":
            self.created = ResponseCreated.from_event(event)
            if self._cancel_requested or self._failure is not None:
                self._conn.spawn(self._send_cancel())
            return self.created
        if kind == "response.done":
            return self._on_done(ResponseDone.from_event(event))
        if kind == "error":
            self._on_error(event)
        return None  # acknowledgements of the message items

    def _on_done(self, done: ResponseDone) -> ResponseDone:
        self.done = done
        self._finish()
        if self._failure is not None:
            raise self._failure
        if done.status == "failed":
            error = done.status_details.get("error") or {"code": "engine_error"}
            raise APIError.from_error(error, response_id=done.response_id)
        return done

    def _on_error(self, event: JSON) -> None:
        event_id = event.get("client_event_id")
        if event_id in self._ignored:
            return  # a clean-up event (deleting the messages of a one-shot chat)
        self._failure = self._failure or APIError.from_event(event)
        if event_id == self._response_event_id and event.get("response_id") is None:
            self._finish()  # refused before a response existed: nothing else will come
            raise self._failure
        # A message item failed (the response then runs on a partial conversation: cancel
        # it), or the response failed (its response.done follows).
        if self.created is not None and event.get("response_id") is None:
            self._conn.spawn(self._send_cancel())

    def _finish(self) -> None:
        self._finished = True
        if self._holds_slot:
            self._holds_slot = False
            self._conn.release_slot()

    # ------------------------------------------------------------------ cancelling

    async def cancel(self) -> None:
        """Ask the server to stop; iteration then ends with ``done.status == "cancelled"``
        (or ``"completed"`` if it finished first). Before :meth:`start`, nothing is sent."""
        if self._finished:
            return
        if not self._started:
            self._started = self._finished = True
            return
        self._cancel_requested = True
        if self.created is not None:
            await self._send_cancel()
        # else: sent as soon as response.created arrives

    async def _send_cancel(self) -> None:
        if self.created is None or self._finished:
            return
        with contextlib.suppress(QuickdraftError):
            # No inbox: a cancel is answered only by an error (response_not_active, when
            # the response finished first), never on success.
            await self._conn.send_events(
                [{"type": "response.cancel", "response_id": self.created.response_id}])

    async def aclose(self) -> None:
        """Cancel unless done, and read to the end (errors are swallowed)."""
        if self._finished:
            return
        await self.cancel()
        with contextlib.suppress(QuickdraftError):
            await self.result()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
