"""Opening a session socket: the first connect fails fast, reconnects retry with backoff.

One attempt connects and reads ``session.created`` (the server's first event), both within one
timeout. The *first* connect of a connection fails fast with a :class:`ConnectError`: a server
that is not there (connection refused, unknown host, no answer within ``connect_timeout``) or
that rejects the handshake is not retried. Only a server that answers "busy" (close 1012 or
1013, HTTP 429 or 503) is retried then, as it is up. *Reconnects* after an established
connection dropped retry every transient failure (refused, timeouts, 1006 / 1012 / 1013, HTTP
5xx / 429) with exponential backoff and jitter, logging each retry. A refused API key (1008,
HTTP 401 / 403) is never retried.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidMessage,
    InvalidStatus,
    WebSocketException,
)

from quickdraft.client.errors import (
    POLICY_VIOLATION,
    RETRYABLE_CLOSE_CODES,
    AuthenticationError,
    ConnectError,
    ConnectionClosedError,
    QuickdraftError,
)

log = logging.getLogger("quickdraft.client")
JSON = dict[str, Any]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``n`` (0-based): ``min(max_delay, initial * factor**n)``, of which the
    fraction ``jitter`` is random (1.0 = "full jitter": uniform in [0, delay]; 0 = none).
    Gives up after ``max_attempts`` attempts or ``max_elapsed`` seconds (None = no bound)."""

    initial: float = 0.1
    factor: float = 2.0
    max_delay: float = 5.0
    jitter: float = 1.0
    max_attempts: int | None = None
    max_elapsed: float | None = 60.0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.factor < 1 or self.max_delay < 0:
            raise ValueError("backoff needs initial >= 0, factor >= 1, max_delay >= 0")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter must be in [0, 1]")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        cap = min(self.max_delay, self.initial * self.factor ** min(attempt, 64))
        return cap * (1.0 - self.jitter * (rng or random).random())

    def next_delay(self, attempt: int, elapsed: float,
                   rng: random.Random | None = None) -> float | None:
        """The delay after ``attempt + 1`` failed attempts, or None to give up."""
        if self.max_attempts is not None and attempt + 1 >= self.max_attempts:
            return None
        delay = self.delay(attempt, rng)
        if self.max_elapsed is not None and elapsed + delay > self.max_elapsed:
            return None
        return delay


NO_RETRY = Backoff(max_attempts=1)
BUSY_HTTP_STATUSES = frozenset({429, 503})
AUTH_HTTP_STATUSES = frozenset({401, 403})


@dataclass(frozen=True)
class SocketOptions:
    """How to open a session socket. ``connect_timeout`` bounds each attempt of the first
    connect, ``open_timeout`` each attempt of a reconnect (connect, handshake and
    ``session.created`` together)."""

    url: str
    api_key: str | None = None
    open_timeout: float = 10.0
    connect_timeout: float = 5.0
    max_size: int | None = 16 << 20
    proxy: str | Literal[True] | None = True  # True: from the environment, as websockets does
    compression: str | None = None  # per-message deflate costs CPU on every small delta
    ping_interval: float | None = 20.0
    extra_headers: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **self.extra_headers}


async def open_socket(opts: SocketOptions,
                      timeout: float | None = None) -> tuple[ClientConnection, JSON]:
    """One attempt: the connection and its ``session.created`` event, both within ``timeout``
    seconds (default ``opts.open_timeout``); a :class:`TimeoutError` says which was missing."""
    limit = opts.open_timeout if timeout is None else timeout
    deadline = time.monotonic() + limit
    try:
        ws = await connect(opts.url, additional_headers=opts.headers(), proxy=opts.proxy,
                           subprotocols=None, open_timeout=limit, max_size=opts.max_size,
                           compression=opts.compression, ping_interval=opts.ping_interval,
                           ping_timeout=opts.ping_interval)
    except TimeoutError as exc:
        raise TimeoutError(f"timed out after {limit:g} s waiting for the WebSocket "
                           "handshake") from exc
    raw = await _first_event(ws, deadline - time.monotonic(), limit)
    event = orjson.loads(raw)
    if not isinstance(event, dict) or event.get("type") != "session.created":
        await ws.close()
        raise QuickdraftError(f"expected session.created as the first event, got {raw!r:.200}")
    return ws, event


async def _first_event(ws: ClientConnection, left: float, limit: float) -> str | bytes:
    """The first message on a fresh socket, within ``left`` seconds; on any failure the
    socket is closed (aborted when the server is silent: no closing handshake to wait for)."""
    try:
        return await asyncio.wait_for(ws.recv(), max(left, 0.0))
    except (TimeoutError, asyncio.CancelledError) as exc:
        ws.transport.abort()
        if isinstance(exc, TimeoutError):
            raise TimeoutError(f"timed out after {limit:g} s waiting for session.created "
                               "(the WebSocket handshake succeeded)") from exc
        raise
    except BaseException:
        await ws.close()
        raise


def close_error(exc: ConnectionClosed) -> ConnectionClosedError:
    """The client error for a closed socket (1006 when no close frame came)."""
    code = exc.rcvd.code if exc.rcvd is not None else 1006
    reason = exc.rcvd.reason if exc.rcvd is not None else ""
    if code == POLICY_VIOLATION:
        return AuthenticationError(code, reason, f"the server refused the API key: {reason}")
    return ConnectionClosedError(code, reason)


@dataclass(frozen=True)
class Failure:
    """Why one attempt to open a socket failed, and whether another attempt may succeed.

    ``retry``: worth retrying once the server is known to be up (a reconnect). ``busy``: the
    server answered but asked to come back later, so it is up (retried on a first connect
    too). ``auth``: the key or the connection was refused (never retried)."""

    cause: str
    retry: bool = False
    busy: bool = False
    auth: bool = False
    code: int = 1006
    reason: str = ""

    def error(self, url: str, attempts: int) -> ConnectionClosedError:
        """The exception to raise when no further attempt is made."""
        if self.auth:
            return AuthenticationError(POLICY_VIOLATION, self.reason,
                                       f"the server at {url} refused the connection: "
                                       f"{self.cause}")
        tries = f" (gave up after {attempts} attempts)" if attempts > 1 else ""
        return ConnectError(url, self.cause + tries, code=self.code, reason=self.reason)


def diagnose(exc: BaseException) -> Failure:
    """The :class:`Failure` an exception of :func:`open_socket` stands for."""
    if isinstance(exc, ConnectionClosed):
        return _closed_failure(exc)
    if isinstance(exc, InvalidStatus):
        return _status_failure(exc.response.status_code)
    if isinstance(exc, TimeoutError):  # before OSError, of which it is a subclass
        return Failure(str(exc) or "timed out", retry=True)
    if isinstance(exc, OSError):
        return Failure(_os_cause(exc), retry=True)
    if isinstance(exc, InvalidMessage):
        return Failure(f"no valid answer to the WebSocket handshake ({exc}); is this a "
                       "quickdraft server?", retry=True)
    if isinstance(exc, WebSocketException | QuickdraftError):
        return Failure(str(exc))
    return Failure(repr(exc))


def _closed_failure(exc: ConnectionClosed) -> Failure:
    code = exc.rcvd.code if exc.rcvd is not None else 1006
    reason = exc.rcvd.reason if exc.rcvd is not None else ""
    if code == POLICY_VIOLATION:
        return Failure(f"API key refused (close {code}: {reason})", auth=True, code=code,
                       reason=reason)
    retry = code in RETRYABLE_CLOSE_CODES
    detail = f"{code}: {reason}" if reason else str(code)
    return Failure(f"the server closed the connection ({detail})", retry=retry,
                   busy=retry and code != 1006, code=code, reason=reason)


def _status_failure(status: int) -> Failure:
    if status in AUTH_HTTP_STATUSES:
        hint = "missing or wrong API key" if status == 401 else "forbidden"
        return Failure(f"HTTP {status} ({hint})", auth=True)
    return Failure(f"the WebSocket handshake was rejected with HTTP {status}",
                   retry=status >= 500 or status == 429, busy=status in BUSY_HTTP_STATUSES)


def _os_cause(exc: OSError) -> str:
    """A short description of a failed TCP connect or name lookup."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror or exc})"
    text = str(exc)
    # Several addresses (localhost: ::1 and 127.0.0.1) that all refused come as one OSError.
    every_refused = text.count("[Errno ") == text.count(f"[Errno {errno.ECONNREFUSED}]")
    if isinstance(exc, ConnectionRefusedError) or (text.startswith("Multiple exceptions")
                                                   and every_refused):
        return "connection refused"
    return exc.strerror or text or repr(exc)


async def open_first(opts: SocketOptions, backoff: Backoff, *, retry: bool = True,
                     rng: random.Random | None = None,
                     sleep: Sleep = asyncio.sleep) -> tuple[ClientConnection, JSON]:
    """The first connect: each attempt within ``opts.connect_timeout``. A server that is not
    there or rejects the handshake raises :class:`ConnectError` (or
    :class:`AuthenticationError`) at once; one that answers "busy" is retried per ``backoff``
    unless ``retry`` is False."""
    return await _open_loop(opts, backoff if retry else NO_RETRY, first=True, rng=rng,
                            sleep=sleep)


async def open_with_retry(opts: SocketOptions, backoff: Backoff, *,
                          rng: random.Random | None = None,
                          sleep: Sleep = asyncio.sleep) -> tuple[ClientConnection, JSON]:
    """A reconnect: :func:`open_socket` (each attempt within ``opts.open_timeout``) until it
    succeeds, a failure is not retryable, or ``backoff`` gives up; then the last failure is
    raised as a :class:`ConnectError` (:class:`AuthenticationError` for a refused key). Each
    retry is logged (WARNING, logger ``quickdraft.client``)."""
    return await _open_loop(opts, backoff, first=False, rng=rng, sleep=sleep)


async def _open_loop(opts: SocketOptions, backoff: Backoff, *, first: bool,
                     rng: random.Random | None, sleep: Sleep) -> tuple[ClientConnection, JSON]:
    """Attempts until one succeeds or no retry is due. Transient failures are retried only
    once the server is known to be up: always on a reconnect, after a "busy" answer on a
    first connect."""
    timeout = opts.connect_timeout if first else opts.open_timeout
    what = "connecting" if first else "reconnecting"
    start = time.monotonic()
    up = not first
    attempt = 0
    while True:
        try:
            return await open_socket(opts, timeout)
        except Exception as exc:
            failure = diagnose(exc)
            up = up or failure.busy
            due = (failure.retry or failure.busy) and up
            delay = backoff.next_delay(attempt, time.monotonic() - start, rng) if due else None
            if delay is None:
                raise failure.error(opts.url, attempt + 1) from exc
            attempt += 1
            log.warning("%s to %s: attempt %d failed (%s); retrying in %.2f s", what,
                        opts.url, attempt, failure.cause, delay)
            await sleep(delay)
