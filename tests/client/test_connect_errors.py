"""Connecting: the first connect fails fast with ConnectError (a closed port, an unknown host, a
port that accepts TCP but never answers, a WebSocket server that never sends session.created,
a rejected handshake), a busy server is waited for, ``reconnect=False`` retries nothing, and
retries after an established connection are logged. Async and sync APIs, against fake servers
(websockets' threaded server, so the same fake serves both)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import orjson
import pytest
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection
from websockets.sync.server import serve as sync_serve

from quickdraft.client import (
    AsyncClient,
    AuthenticationError,
    Backoff,
    Client,
    ConnectError,
    ConnectionClosedError,
    QuickdraftError,
)
from quickdraft.client.retry import SocketOptions, open_first
from tests.client.conftest import FAST, run

MARGIN = 1.0  # seconds of slack on timings (2 shared CPU cores)
SESSION_CREATED = orjson.dumps({"type": "session.created", "session": {
    "id": "sess_fake", "model": "fake", "max_model_len": 512,
    "limits": {"max_concurrent_responses": 4}}}).decode()


def closed_port() -> int:
    """A port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ws_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/ws"


class FakeServer:
    """A WebSocket server in background threads. Connection ``n`` (0-based) follows
    ``plan[n]`` (the last entry repeats): ``ok`` sends session.created and reads until closed,
    ``busy`` closes with 1013, ``mute`` completes the handshake and says nothing. ``status``
    rejects every handshake with that HTTP status instead."""

    def __init__(self, plan: list[str] | None = None, *, port: int = 0,
                 status: int | None = None) -> None:
        self.plan = plan or ["ok"]
        self.status = status
        self.connections = 0  # WebSocket connections (or rejected handshakes)
        self._live: list[ServerConnection] = []
        self._lock = threading.Lock()
        self._server: Server = sync_serve(self._handle, "127.0.0.1", port,
                                          process_request=self._reject)
        self.port = int(self._server.socket.getsockname()[1])
        self.url = ws_url(self.port)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, code: int = 1001) -> None:
        """Stop listening, close open connections with ``code``, wait for the handlers."""
        self._server.shutdown(code=code)
        self._thread.join(10)

    def drop(self) -> None:
        """Drop every open connection without a close frame (the client sees 1006)."""
        with self._lock:
            live, self._live = self._live, []
        for ws in live:
            with contextlib.suppress(OSError):
                ws.socket.shutdown(socket.SHUT_RDWR)

    def _count(self) -> int:
        with self._lock:
            self.connections += 1
            return self.connections - 1

    def _reject(self, ws: ServerConnection, request: Request) -> Response | None:
        if self.status is None:
            return None
        self._count()
        return ws.respond(HTTPStatus(self.status), "no\n")

    def _handle(self, ws: ServerConnection) -> None:
        n = self._count()
        step = self.plan[min(n, len(self.plan) - 1)]
        if step == "busy":
            ws.close(1013, "busy")
            return
        with self._lock:
            self._live.append(ws)  # before session.created: drop() after connect() sees it
        if step == "ok":
            ws.send(SESSION_CREATED)
        with contextlib.suppress(Exception):
            for _ in ws:
                pass


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port whose kernel completes TCP handshakes that nobody ever answers; its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def retry_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "quickdraft.client" and "retrying in" in r.getMessage()]


# ---------------------------------------------------------------------- first connect, async


def test_refused_port_fails_fast(caplog):
    url = ws_url(closed_port())

    async def body() -> None:
        client = AsyncClient(url, connect_timeout=3.0, backoff=FAST, proxy=None)
        start = time.monotonic()
        with pytest.raises(ConnectError) as info:
            await client.connect()
        assert time.monotonic() - start < 3.0 + MARGIN
        err = info.value
        assert isinstance(err, QuickdraftError) and isinstance(err, ConnectionClosedError)
        assert str(err) == f"cannot connect to {url}: connection refused"
        assert err.url == url and err.cause == "connection refused" and err.code == 1006
        with pytest.raises(ConnectError):  # the next call tries again, as fast
            await client.chat("Hi!").result()
        await client.close()

    with caplog.at_level(logging.INFO, logger="quickdraft.client"):
        run(body(), timeout=20)
    assert retry_records(caplog) == []  # nothing retried


def test_refused_first_connect_never_sleeps():
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)

    opts = SocketOptions(ws_url(closed_port()), proxy=None)
    with pytest.raises(ConnectError, match="connection refused"):
        run(open_first(opts, Backoff(max_elapsed=None), sleep=fake_sleep))
    assert slept == []


def test_unknown_host_fails_fast():
    url = "ws://no-such-host.invalid:8000/v1/ws"

    async def body() -> None:
        start = time.monotonic()
        with pytest.raises(ConnectError) as info:
            await AsyncClient(url, connect_timeout=3.0, proxy=None).connect()
        assert time.monotonic() - start < 3.0 + MARGIN
        assert str(info.value).startswith(f"cannot connect to {url}: ")

    run(body(), timeout=20)


def test_silent_port_times_out_at_connect_timeout():
    accepted: list[asyncio.StreamWriter] = []

    async def stay_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()  # until the client gives up and closes
        writer.close()

    async def body() -> None:
        server = await asyncio.start_server(stay_silent, "127.0.0.1", 0)
        async with server:
            url = ws_url(server.sockets[0].getsockname()[1])
            client = AsyncClient(url, connect_timeout=0.5, backoff=FAST, proxy=None)
            start = time.monotonic()
            with pytest.raises(ConnectError) as info:
                await client.chat("Hi!").result()
            elapsed = time.monotonic() - start
            assert 0.5 <= elapsed < 0.5 + MARGIN
            assert str(info.value) == (f"cannot connect to {url}: timed out after 0.5 s "
                                       "waiting for the WebSocket handshake")
            assert len(accepted) == 1  # one attempt, no retry
            await client.close()

    run(body(), timeout=20)


def test_concurrent_calls_share_one_connect_attempt():
    with silent_listener() as port:
        async def body() -> None:
            client = AsyncClient(ws_url(port), connect_timeout=0.5, proxy=None)
            start = time.monotonic()
            results = await asyncio.gather(*(client.chat(f"Q{i}").result() for i in range(4)),
                                           return_exceptions=True)
            assert all(isinstance(r, ConnectError) for r in results)
            assert time.monotonic() - start < 0.5 + MARGIN  # not 4 timeouts in a row

        run(body(), timeout=20)


def test_close_while_connecting_ends_the_waiting_calls():
    with silent_listener() as port:
        async def body() -> None:
            client = AsyncClient(ws_url(port), connect_timeout=30.0, proxy=None)
            chat = asyncio.ensure_future(client.chat("Hi!").result())
            await asyncio.sleep(0.2)
            await client.close()
            with pytest.raises(ConnectionClosedError) as info:
                await asyncio.wait_for(chat, 5)
            assert info.value.code == 1000

        run(body(), timeout=20)


def test_no_session_created_times_out():
    with FakeServer(["mute"]) as fake:
        async def body() -> None:
            start = time.monotonic()
            with pytest.raises(ConnectError, match=r"waiting for session\.created") as info:
                await AsyncClient(fake.url, connect_timeout=0.5, proxy=None).connect()
            assert time.monotonic() - start < 0.5 + MARGIN
            assert fake.url in str(info.value)

        run(body(), timeout=20)
        assert fake.connections == 1


@pytest.mark.parametrize("status", [401, 403])
def test_handshake_refused_with_401_or_403_is_an_authentication_error(status):
    with FakeServer(status=status) as fake:
        with pytest.raises(AuthenticationError, match=f"HTTP {status}") as info:
            run(AsyncClient(fake.url, api_key="k", backoff=FAST, proxy=None).connect())
        assert info.value.code == 1008 and fake.url in str(info.value)
        assert fake.connections == 1  # not retried


@pytest.mark.parametrize("status", [404, 502])
def test_other_handshake_rejections_fail_fast(status):
    with FakeServer(status=status) as fake:
        with pytest.raises(ConnectError, match=f"rejected with HTTP {status}"):
            run(AsyncClient(fake.url, backoff=FAST, proxy=None).connect())
        assert fake.connections == 1


def test_busy_server_is_waited_for_at_first_connect(caplog):
    with FakeServer(["busy", "busy", "ok"]) as fake:
        async def body() -> None:
            client = AsyncClient(fake.url, backoff=FAST, proxy=None)
            info = await client.connect()
            assert info.id == "sess_fake"
            await client.close()

        with caplog.at_level(logging.WARNING, logger="quickdraft.client"):
            run(body(), timeout=20)
        assert fake.connections == 3
        retries = retry_records(caplog)
        assert len(retries) == 2 and "attempt 2 failed" in retries[1]
        assert "(1013: busy)" in retries[0] and fake.url in retries[0]


def test_busy_server_without_reconnect_is_not_retried():
    with FakeServer(["busy"]) as fake:
        with pytest.raises(ConnectError, match="1013") as info:
            run(AsyncClient(fake.url, backoff=FAST, proxy=None, reconnect=False).connect())
        assert info.value.code == 1013 and fake.connections == 1


# ---------------------------------------------------------------------- first connect, sync


def test_sync_refused_port_fails_fast():
    url = ws_url(closed_port())
    client = Client(url, connect_timeout=3.0, proxy=None, timeout=30)
    start = time.monotonic()
    with pytest.raises(ConnectError) as info:
        client.chat("Hi!").text()
    assert time.monotonic() - start < 3.0 + MARGIN
    assert str(info.value) == f"cannot connect to {url}: connection refused"
    client.close()
    with pytest.raises(ConnectError), Client(url, proxy=None):
        pass
    # A failed ``with Client(...)`` stops its loop thread.
    wait_until(lambda: not any(t.name == "quickdraft-client" and t.is_alive()
                               for t in threading.enumerate()))


def test_sync_silent_port_raises_connect_error():
    with silent_listener() as port:
        client = Client(ws_url(port), connect_timeout=0.5, proxy=None, timeout=30)
        start = time.monotonic()
        with pytest.raises(ConnectError, match=r"timed out after 0\.5 s"):
            client.connect()
        assert 0.5 <= time.monotonic() - start < 0.5 + MARGIN
        client.close()


# ---------------------------------------------------------------------- after a drop


def test_no_reconnect_after_a_drop_when_reconnect_is_false():
    with FakeServer(["ok"]) as fake:
        async def body() -> None:
            client = AsyncClient(fake.url, backoff=FAST, proxy=None, reconnect=False)
            await client.connect()
            fake.drop()
            await asyncio.sleep(0.5)  # time enough for several retries, were there any
            with pytest.raises(ConnectionClosedError) as info:
                await client.chat("Hi!").result()
            assert info.value.code == 1006 and not isinstance(info.value, ConnectError)
            await client.close()

        run(body(), timeout=20)
        assert fake.connections == 1


def test_sync_no_reconnect_after_a_drop_when_reconnect_is_false():
    with FakeServer(["ok"]) as fake:
        with Client(fake.url, backoff=FAST, proxy=None, reconnect=False, timeout=30) as client:
            fake.drop()
            time.sleep(0.5)
            with pytest.raises(ConnectionClosedError) as info:
                client.chat("Hi!").text()
            assert info.value.code == 1006
        assert fake.connections == 1


def test_reconnect_after_a_restart_retries_refused_and_logs(caplog):
    caplog.set_level(logging.INFO, logger="quickdraft.client")
    fake = FakeServer(["ok"]).__enter__()
    url, port = fake.url, fake.port

    async def body() -> None:
        client = AsyncClient(url, backoff=FAST, proxy=None)
        await client.connect()
        await asyncio.to_thread(fake.stop, 1012)  # a restart: close 1012, then nothing there
        await asyncio.to_thread(wait_until, lambda: len(retry_records(caplog)) >= 2)
        with FakeServer(["ok"], port=port) as second:
            info = await asyncio.wait_for(client.connect(), 10)  # waits out the reconnect
            assert info.id == "sess_fake" and second.connections == 1
            await client.close()

    run(body(), timeout=30)
    messages = [r.getMessage() for r in caplog.records if r.name == "quickdraft.client"]
    assert f"connection to {url} closed (1012); reconnecting" in messages
    retries = retry_records(caplog)
    assert retries[0].startswith(f"reconnecting to {url}: attempt 1 failed "
                                 "(connection refused); retrying in ")
    assert retries[1].startswith(f"reconnecting to {url}: attempt 2 failed")
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if "retrying in" in r.getMessage())
    assert f"reconnected to {url}" in messages


def test_sync_reconnect_after_a_drop_is_logged(caplog):
    caplog.set_level(logging.WARNING, logger="quickdraft.client")
    with FakeServer(["ok", "busy", "busy", "ok"]) as fake, \
            Client(fake.url, backoff=FAST, proxy=None, timeout=30) as client:
        fake.drop()
        wait_until(lambda: fake.connections == 4)
        assert client.connect().id == "sess_fake"  # reconnected
        retries = retry_records(caplog)
        assert [r.split(": attempt")[0] for r in retries] == [f"reconnecting to {fake.url}"] * 2
        assert "attempt 1 failed (the server closed the connection (1013: busy))" in retries[0]
        assert "attempt 2 failed" in retries[1]
    assert any("closed (1006); reconnecting" in r.getMessage() for r in caplog.records)


def test_invalid_timeouts_are_refused():
    with pytest.raises(ValueError):
        AsyncClient(connect_timeout=0)
    with pytest.raises(ValueError):
        Client(open_timeout=-1)
