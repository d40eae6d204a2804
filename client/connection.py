"""One WebSocket session with the server: sending events, routing the answers, reconnecting.

Every client event gets an ``event_id``; the server answers with it as ``client_event_id``.
Answers go to an *inbox* (an ``asyncio.Queue``) registered for that event id; once a
``response.created`` names the response, its deltas, ``error`` and ``response.done`` (which
carry the response id) go to the same inbox. So several responses stream at once on one socket.

The first connect fails fast (:func:`open_first`: a :class:`ConnectError` within
``connect_timeout`` when nothing answers); a failed first connect leaves the connection
unopened, so the next call tries again. Once connected, a supervisor task owns the socket.
When it closes with 1006, 1012 or 1013, every inbox still waiting gets a
:class:`ConnectionLostError` (the server aborted those responses), the socket is reopened with
backoff (each retry logged), and the ``on_connect`` hook runs again before new events may be
sent (a chat session uses it to re-create its conversation on the new server session). With
``reconnect=False`` nothing is retried: not the first connect, not after a drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from quickdraft.client.errors import (
    RETRYABLE_CLOSE_CODES,
    APIError,
    ConnectionClosedError,
    ConnectionLostError,
    QuickdraftError,
)
from quickdraft.client.events import SessionInfo
from quickdraft.client.retry import Backoff, SocketOptions, open_first, open_with_retry

log = logging.getLogger("quickdraft.client")
JSON = dict[str, Any]
Inbox = asyncio.Queue[JSON | ConnectionClosedError]
OnConnect = Callable[["Connection"], Awaitable[None]]
Observer = Callable[[JSON], None]
CLIENT_CLOSED = 1000


class Connection:
    """One session socket: sends events and routes the server's answers; reconnects after
    retryable closes unless ``reconnect`` is False."""

    def __init__(self, opts: SocketOptions, backoff: Backoff, *,
                 on_connect: OnConnect | None = None, observer: Observer | None = None,
                 reconnect: bool = True) -> None:
        self.opts = opts
        self.backoff = backoff
        self.info: SessionInfo | None = None  # the latest session.created / session.updated
        self.reconnects = 0  # how many times the socket was reopened
        self._on_connect = on_connect
        self._observer = observer
        self._reconnect = reconnect
        self._ws: ClientConnection | None = None
        self._by_event: dict[str, Inbox] = {}
        self._by_response: dict[str, Inbox] = {}
        self._ids = itertools.count()
        self._prefix = f"evt_{uuid.uuid4().hex[:8]}_"
        self._send_lock = asyncio.Lock()
        self._opening: asyncio.Task[None] | None = None  # the first connect, while it runs
        self._ready = asyncio.Event()  # set: connected and restored, or failed for good
        self._background: set[asyncio.Task[Any]] = set()  # fire-and-forget, kept until done
        self._failure: QuickdraftError | None = None
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._slots: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ state

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background (a cancel on the server after the caller left)."""
        try:
            task = asyncio.ensure_future(coro)
        except RuntimeError:  # no running loop (interpreter shutdown): nothing left to cancel
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def connected(self) -> bool:
        return self._ready.is_set() and self._failure is None

    @property
    def closed(self) -> bool:
        return self._failure is not None

    def new_event_id(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    async def start(self) -> SessionInfo:
        """Connect unless already connected; the session info. Raises :class:`ConnectError`
        (or :class:`AuthenticationError`) when the first connect fails."""
        if self._supervisor is None and self._failure is None:
            await self._connect_once()
        await self.wait_ready()
        assert self.info is not None
        return self.info

    async def _connect_once(self) -> None:
        """The first connect; concurrent callers share one attempt, and a caller that is
        cancelled does not cancel it for the others."""
        if self._closing:
            raise ConnectionClosedError(CLIENT_CLOSED, "closed by the client")
        if self._opening is None or self._opening.done():
            self._opening = asyncio.create_task(self._open())
        opening = self._opening
        try:
            await asyncio.shield(opening)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if opening.cancelled() and not (task is not None and task.cancelling()):
                raise ConnectionClosedError(CLIENT_CLOSED, "closed by the client") from None
            raise  # this caller was cancelled

    async def _open(self) -> None:
        ws, created = await open_first(self.opts, self.backoff, retry=self._reconnect)
        if self._closing:
            await ws.close()
            raise ConnectionClosedError(CLIENT_CLOSED, "closed by the client")
        self._ws = ws  # for close() even before the supervisor runs
        self._supervisor = asyncio.create_task(self._supervise(ws, created))

    async def wait_ready(self) -> None:
        """Until the socket is usable (waits out a reconnect); raises once it never will be."""
        if self._supervisor is None and self._failure is None:
            await self.start()
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure

    async def close(self) -> None:
        """Close the socket (1000); every waiting inbox gets a ConnectionClosedError."""
        self._closing = True
        opening = self._opening
        if opening is not None and not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
        reconnecting = not self._ready.is_set()
        if self._ws is not None:
            await self._ws.close()
        task = self._supervisor
        if task is not None and not task.done():
            if reconnecting:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 5.0)
        self._fail(ConnectionClosedError(CLIENT_CLOSED, "closed by the client"))

    # ------------------------------------------------------------------ sending

    async def send_events(self, events: list[JSON], inbox: Inbox | None = None, *,
                          gate: bool = True) -> list[str]:
        """Send ``events`` back to back (no other event in between); each gets a fresh
        ``event_id`` whose answers go to ``inbox``. Returns the ids. ``gate=False`` (only for
        the ``on_connect`` hook) sends before the connection is marked ready."""
        while True:
            if gate:
                await self.wait_ready()
            async with self._send_lock:
                ws = self._ws
                if ws is not None and (not gate or self.connected):
                    return await self._send_locked(ws, events, inbox)
                if not gate:
                    raise ConnectionClosedError(1006, "", "not connected")

    async def _send_locked(self, ws: ClientConnection, events: list[JSON],
                           inbox: Inbox | None) -> list[str]:
        ids = [self.new_event_id() for _ in events]
        if inbox is not None:
            self._by_event.update(dict.fromkeys(ids, inbox))
        try:
            for event_id, event in zip(ids, events, strict=True):
                await ws.send(orjson.dumps({**event, "event_id": event_id}).decode())
        except ConnectionClosed as exc:
            for event_id in ids:
                self._by_event.pop(event_id, None)
            code = exc.rcvd.code if exc.rcvd is not None else 1006
            raise ConnectionLostError(code, exc.rcvd.reason if exc.rcvd else "") from exc
        return ids

    async def request(self, event: JSON, *, gate: bool = True) -> JSON:
        """Send one event and wait for its answer; an ``error`` answer raises APIError."""
        replies = await self.request_many([event], gate=gate)
        return replies[0]

    async def request_many(self, events: list[JSON], *, gate: bool = True) -> list[JSON]:
        """Send events back to back, then wait for all their answers (one each, in order);
        the first ``error`` among them is raised as APIError."""
        inbox: Inbox = asyncio.Queue()
        await self.send_events(events, inbox, gate=gate)
        replies: list[JSON] = []
        for _ in events:
            reply = await inbox.get()
            if isinstance(reply, ConnectionClosedError):
                raise reply
            replies.append(reply)
        for reply in replies:
            if reply.get("type") == "error":
                raise APIError.from_event(reply)
        return replies

    # ------------------------------------------------------------------ response slots

    async def acquire_slot(self) -> None:
        """Wait for one of the session's ``max_concurrent_responses`` slots."""
        await self.wait_ready()
        if self._slots is None:
            limits = self.info.limits if self.info else None
            self._slots = asyncio.Semaphore(limits.max_concurrent_responses if limits else 8)
        await self._slots.acquire()

    def release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    # ------------------------------------------------------------------ receiving

    def _dispatch(self, event: JSON) -> None:
        if self._observer is not None:
            self._observer(event)
        kind = event.get("type")
        if kind in ("session.created", "session.updated"):
            self.info = SessionInfo.from_event(event)
        inbox = self._route(event)
        if inbox is not None:
            inbox.put_nowait(event)
        elif kind == "error":
            error = event.get("error") or {}
            quiet = error.get("code") == "response_not_active"  # a cancel that came too late
            log.log(logging.DEBUG if quiet else logging.WARNING, "server error: %s", error)

    def _route(self, event: JSON) -> Inbox | None:
        kind = event.get("type")
        if kind == "response.output_text.delta":
            return self._by_response.get(event.get("response_id", ""))
        if kind == "response.done":
            return self._by_response.pop(event["response"]["id"], None)
        if kind == "error" and event.get("response_id") is not None:
            return self._by_response.get(event["response_id"])  # its response.done follows
        event_id = event.get("client_event_id")
        inbox = self._by_event.pop(event_id, None) if event_id is not None else None
        if kind == "response.created" and inbox is not None:
            self._by_response[event["response"]["id"]] = inbox
        return inbox

    async def _read(self, ws: ClientConnection) -> tuple[int, str]:
        """Dispatch every event until the socket closes; its close code and reason."""
        try:
            async for raw in ws:
                try:
                    self._dispatch(orjson.loads(raw))
                except Exception:  # a malformed event or a bug in a hook: keep reading
                    log.exception("could not handle server event %.200r", raw)
        except ConnectionClosed:
            pass
        return self._close_info(ws)

    def _close_info(self, ws: ClientConnection) -> tuple[int, str]:
        """The server's close code and reason; 1006 when none came, or when this side
        closed first without being asked to (the keepalive ping timed out)."""
        proto = ws.protocol
        rcvd = proto.close_rcvd
        if rcvd is None:
            return 1006, ""
        if proto.close_sent is not None and not proto.close_rcvd_then_sent and not self._closing:
            return 1006, f"closed by the client ({proto.close_sent.code})"
        return rcvd.code, rcvd.reason

    # ------------------------------------------------------------------ supervision

    async def _supervise(self, ws: ClientConnection, created: JSON) -> None:
        while True:
            self._ws = ws
            self._dispatch(created)
            reader = asyncio.create_task(self._read(ws))
            if not await self._run_on_connect(ws):
                reader.cancel()
                return
            code, reason = await reader
            self._ready.clear()
            self._lose_routes(ConnectionLostError(code, reason))
            if self._closing or not self._reconnect or code not in RETRYABLE_CLOSE_CODES:
                self._fail(ConnectionClosedError(code, reason))
                return
            log.warning("connection to %s closed (%d%s); reconnecting", self.opts.url, code,
                        f" {reason}" if reason else "")
            try:
                ws, created = await open_with_retry(self.opts, self.backoff)
            except QuickdraftError as exc:
                log.error("%s", exc)
                self._fail(exc)
                return
            self.reconnects += 1
            log.info("reconnected to %s", self.opts.url)

    async def _run_on_connect(self, ws: ClientConnection) -> bool:
        """Run the hook; False if it failed for good (the connection is then failed)."""
        try:
            if self._on_connect is not None:
                await self._on_connect(self)
        except ConnectionLostError as exc:
            if exc.code in RETRYABLE_CLOSE_CODES:
                return True  # the reader sees the close and reconnects
            self._fail(exc)
            return False
        except QuickdraftError as exc:
            self._fail(exc)
            await ws.close()
            return False
        self._ready.set()
        return True

    def _lose_routes(self, err: ConnectionClosedError) -> None:
        inboxes = {id(q): q for q in (*self._by_event.values(), *self._by_response.values())}
        self._by_event.clear()
        self._by_response.clear()
        for inbox in inboxes.values():
            inbox.put_nowait(err)

    def _fail(self, err: QuickdraftError) -> None:
        if self._failure is None:
            self._failure = err
        self._lose_routes(err if isinstance(err, ConnectionClosedError)
                          else ConnectionClosedError(1006, str(err)))
        self._ready.set()
