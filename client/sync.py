"""A blocking wrapper: ``Client`` runs an :class:`AsyncClient` on an event loop in a background
thread, so scripts and notebooks without asyncio can stream answers.

    with Client("ws://127.0.0.1:8000/v1/ws") as client:
        for text in client.chat("Name three colours."):
            print(text, end="", flush=True)
        answer = client.chat("And three fruits?").text()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, Literal, TypeVar

from quickdraft.client.async_client import DEFAULT_URL, AsyncClient, MessageLike
from quickdraft.client.events import Message, ResponseDone, Role, SessionInfo, TextDelta
from quickdraft.client.retry import Backoff
from quickdraft.client.session import ChatSession
from quickdraft.client.stream import ResponseStream

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="quickdraft-client",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a sync quickdraft client cannot be used from its own loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


class SyncStream:
    """Iterate for the text deltas (str); :meth:`text` for the whole answer."""

    def __init__(self, runner: _LoopThread, stream: ResponseStream,
                 timeout: float | None) -> None:
        self._runner = runner
        self._stream = stream
        self._timeout = timeout

    @property
    def done(self) -> ResponseDone | None:
        """The ``response.done`` (status, usage, timings, speculation) once finished."""
        return self._stream.done

    @property
    def response_id(self) -> str | None:
        return self._stream.response_id

    def __iter__(self) -> Iterator[str]:
        try:
            while (event := self._runner.run(self._stream.next_event(), self._timeout)) \
                    is not None:
                if isinstance(event, TextDelta):
                    yield event.text
        finally:
            if not self._stream.finished:
                self.close()  # left early (break, Ctrl-C): cancel it on the server

    def result(self) -> ResponseDone:
        return self._runner.run(self._stream.result(), self._timeout)

    def text(self) -> str:
        """Wait for the end; the whole answer."""
        return self.result().text

    def cancel(self) -> None:
        self._runner.run(self._stream.cancel(), self._timeout)

    def close(self) -> None:
        """Cancel unless done and read to the end."""
        self._runner.run(self._stream.aclose(), self._timeout)

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSession:
    """Blocking view of a :class:`ChatSession`."""

    def __init__(self, runner: _LoopThread, session: ChatSession,
                 timeout: float | None) -> None:
        self._runner = runner
        self.session = session
        self._timeout = timeout

    @property
    def history(self) -> list[Message]:
        return self.session.history

    def chat(self, content: str | None = None, *, role: Role = "user",
             **response: Any) -> SyncStream:
        return SyncStream(self._runner, self.session.chat(content, role=role, **response),
                          self._timeout)

    def update(self, **fields: Any) -> SessionInfo:
        return self._runner.run(self.session.update(**fields), self._timeout)

    def add(self, content: str, role: Role = "user") -> Message:
        return self._runner.run(self.session.add(content, role), self._timeout)

    def delete(self, item_id: str) -> None:
        self._runner.run(self.session.delete(item_id), self._timeout)

    def close(self) -> None:
        self._runner.run(self.session.close(), self._timeout)

    def __enter__(self) -> SyncSession:
        self._runner.run(self.session.start(), self._timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Blocking client; same arguments as :class:`AsyncClient` (``connect_timeout``: the first
    connect raises :class:`ConnectError` after at most that long when the server cannot be
    reached), plus ``timeout`` (seconds any one call may block; None = no limit)."""

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None,
                 backoff: Backoff | None = None, connect_timeout: float = 5.0,
                 open_timeout: float = 10.0, proxy: str | Literal[True] | None = True,
                 reconnect: bool = True, timeout: float | None = None) -> None:
        self._client = AsyncClient(url, api_key=api_key, backoff=backoff,
                                   connect_timeout=connect_timeout, open_timeout=open_timeout,
                                   proxy=proxy, reconnect=reconnect)
        self._runner = _LoopThread()
        self._timeout = timeout

    @property
    def info(self) -> SessionInfo | None:
        return self._client.info

    def connect(self) -> SessionInfo:
        """Open the shared socket now (else the first chat does); see
        :meth:`AsyncClient.connect`."""
        return self._runner.run(self._client.connect(), self._timeout)

    def chat(self, messages: str | Sequence[MessageLike], **response: Any) -> SyncStream:
        """Iterate the result for text deltas, or call ``.text()`` for the whole answer."""
        return SyncStream(self._runner, self._client.chat(messages, **response), self._timeout)

    def session(self, instructions: str | None = None, *,
                history: Sequence[MessageLike] | None = None, **defaults: Any) -> SyncSession:
        session = self._client.session(instructions, history=history, **defaults)
        return SyncSession(self._runner, session, self._timeout)

    def close(self) -> None:
        try:
            self._runner.run(self._client.close(), self._timeout)
        finally:
            self._runner.stop()

    def __enter__(self) -> Client:
        try:
            self.connect()
        except BaseException:
            self.close()  # no with-block to run __exit__: stop the loop thread here
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
