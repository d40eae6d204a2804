"""Opening a session socket, retried with exponential backoff and jitter.

One attempt connects and reads ``session.created`` (the server's first event). A server that is
down (connection refused), restarting or draining (close 1012), still loading or full (1013),
or a connection that drops (1006) is retried; a refused API key (1008) and other closes are not.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

from quickdraft.client.errors import (
    POLICY_VIOLATION,
    RETRYABLE_CLOSE_CODES,
    AuthenticationError,
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


@dataclass(frozen=True)
class SocketOptions:
    url: str
    api_key: str | None = None
    open_timeout: float = 10.0
    max_size: int | None = 16 << 20
    proxy: str | Literal[True] | None = True  # True: from the environment, as websockets does
    compression: str | None = None  # per-message deflate costs CPU on every small delta
    ping_interval: float | None = 20.0
    extra_headers: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **self.extra_headers}


async def open_socket(opts: SocketOptions) -> tuple[ClientConnection, JSON]:
    """One attempt: the connection and its ``session.created`` event."""
    ws = await connect(opts.url, additional_headers=opts.headers(), proxy=opts.proxy,
                       subprotocols=None, open_timeout=opts.open_timeout,
                       max_size=opts.max_size, compression=opts.compression,
                       ping_interval=opts.ping_interval, ping_timeout=opts.ping_interval)
    try:
        raw = await asyncio.wait_for(ws.recv(), opts.open_timeout)
        event = orjson.loads(raw)
    except BaseException:
        await ws.close()
        raise
    if not isinstance(event, dict) or event.get("type") != "session.created":
        await ws.close()
        raise QuickdraftError(f"expected session.created as the first event, got {raw!r:.200}")
    return ws, event


def close_error(exc: ConnectionClosed) -> ConnectionClosedError:
    """The client error for a closed socket (1006 when no close frame came)."""
    code = exc.rcvd.code if exc.rcvd is not None else 1006
    reason = exc.rcvd.reason if exc.rcvd is not None else ""
    if code == POLICY_VIOLATION:
        return AuthenticationError(code, reason, f"the server refused the API key: {reason}")
    return ConnectionClosedError(code, reason)


def classify(exc: BaseException) -> tuple[bool, ConnectionClosedError | QuickdraftError]:
    """(retry?, the error to raise if not) for an exception of :func:`open_socket`."""
    if isinstance(exc, ConnectionClosed):
        err = close_error(exc)
        return err.code in RETRYABLE_CLOSE_CODES, err
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        err = (AuthenticationError(POLICY_VIOLATION, "", f"HTTP {status}") if status == 401
               else ConnectionClosedError(1006, "", f"handshake refused with HTTP {status}"))
        return status >= 500 or status == 429, err
    if isinstance(exc, OSError | TimeoutError | InvalidMessage):
        return True, ConnectionClosedError(1006, "", f"cannot connect: {exc!r}")
    if isinstance(exc, QuickdraftError):
        return False, exc
    return False, QuickdraftError(f"cannot connect: {exc!r}")


async def open_with_retry(opts: SocketOptions, backoff: Backoff, *,
                          rng: random.Random | None = None,
                          sleep: Sleep = asyncio.sleep) -> tuple[ClientConnection, JSON]:
    """:func:`open_socket` until it succeeds, a failure is not retryable, or ``backoff`` gives
    up (then the last failure is raised as a :class:`ConnectionClosedError`)."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return await open_socket(opts)
        except Exception as exc:
            retry, err = classify(exc)
            delay = backoff.next_delay(attempt, time.monotonic() - start, rng) if retry else None
            if delay is None:
                if retry and isinstance(err, ConnectionClosedError):
                    err = ConnectionClosedError(err.code, err.reason, f"gave up after "
                                                f"{attempt + 1} attempts: {err}")
                raise err from exc
            log.info("connecting to %s failed (%s); retrying in %.2f s", opts.url, err, delay)
            await sleep(delay)
            attempt += 1
