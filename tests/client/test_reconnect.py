"""Reconnecting: the backoff schedule, a reconnect retrying a refused connect until the backoff
gives up, a dropped connection (1006, against a scripted fake server: the streaming response
fails with ConnectionLostError, the session's settings and conversation are re-sent), a full
server at the first connect (1013: waited for) and a server restart (1012: drain, then a new
server on the same port; the conversation lives on). Failing first connects:
test_connect_errors.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
from typing import Any

import orjson
import pytest
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve

from quickdraft.client import (
    AsyncClient,
    Backoff,
    ConnectError,
    ConnectionLostError,
    Message,
)
from quickdraft.client.retry import SocketOptions, open_with_retry
from tests.client.conftest import FAST, KEY, SHORT, run, server_conversations
from tests.server.conftest import make_settings, serve, tiny_factory, ws_open


def test_backoff_schedule():
    b = Backoff(initial=0.1, factor=2.0, max_delay=1.0, jitter=0.0, max_attempts=None,
                max_elapsed=None)
    assert [b.delay(n) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = Backoff(initial=0.1, factor=2.0, max_delay=1.0, jitter=0.5)
    rng = random.Random(0)
    for n in range(8):
        cap = min(1.0, 0.1 * 2**n)
        assert all(cap / 2 <= jittered.delay(n, rng) <= cap for _ in range(50))
    full = Backoff(jitter=1.0)
    assert len({round(full.delay(3, rng), 6) for _ in range(20)}) > 10  # really random
    assert Backoff(max_attempts=3).next_delay(2, 0.0) is None
    assert Backoff(max_attempts=3).next_delay(1, 0.0) is not None
    assert Backoff(initial=1.0, jitter=0.0, max_elapsed=5.0).next_delay(0, 4.5) is None
    with pytest.raises(ValueError):
        Backoff(jitter=2.0)


def test_reconnect_retries_refused_then_gives_up():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slept: list[float] = []

    async def fake_sleep(delay: float) -> None:
        slept.append(delay)

    opts = SocketOptions(f"ws://127.0.0.1:{port}/v1/ws", proxy=None)
    backoff = Backoff(initial=0.1, jitter=0.0, max_attempts=4, max_elapsed=None)
    with pytest.raises(ConnectError, match=r"connection refused \(gave up after 4 attempts\)"):
        run(open_with_retry(opts, backoff, sleep=fake_sleep))
    assert slept == pytest.approx([0.1, 0.2, 0.4])


class FakeServer:
    """Speaks just enough of the protocol; drops the TCP connection (no close frame: 1006)
    after the first delta of the first response on the first connection."""

    def __init__(self) -> None:
        self.received: list[list[dict[str, Any]]] = []  # per connection
        self.items = 0

    async def handler(self, ws: ServerConnection) -> None:
        events: list[dict[str, Any]] = []
        self.received.append(events)
        first = len(self.received) == 1
        await self.send(ws, {"type": "session.created", "session": {
            "id": f"sess_{len(self.received)}", "model": "fake", "max_model_len": 512,
            "limits": {"max_concurrent_responses": 4}}})
        async for raw in ws:
            event = orjson.loads(raw)
            events.append(event)
            await self.answer(ws, event, drop=first)

    async def answer(self, ws: ServerConnection, event: dict[str, Any], *, drop: bool) -> None:
        eid = event.get("event_id")
        kind = event["type"]
        if kind == "session.update":
            await self.send(ws, {"type": "session.updated", "client_event_id": eid,
                                 "session": {"id": "s", **event["session"]}})
        elif kind == "conversation.item.create":
            self.items += 1
            item = {"id": f"item_{self.items}", **event["item"]}
            await self.send(ws, {"type": "conversation.item.created", "client_event_id": eid,
                                 "item": item})
        elif kind == "response.create":
            rid = f"resp_{eid}"
            await self.send(ws, {"type": "response.created", "client_event_id": eid,
                                 "response": {"id": rid, "item_id": "item_answer",
                                              "conversation": "auto"}})
            await self.send(ws, {"type": "response.output_text.delta", "response_id": rid,
                                 "item_id": "item_answer", "sequence_number": 0,
                                 "delta": "Hel", "num_tokens": 1})
            if drop:
                ws.transport.abort()

    @staticmethod
    async def send(ws: ServerConnection, event: dict[str, Any]) -> None:
        await ws.send(orjson.dumps(event).decode())


def test_dropped_connection_reconnects_and_restores_the_session():
    fake = FakeServer()

    async def body() -> None:
        async with ws_serve(fake.handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = AsyncClient(f"ws://127.0.0.1:{port}/v1/ws", backoff=FAST, proxy=None)
            earlier = [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!", "id": "a1"}]
            session = client.session("Be brief.", history=earlier, temperature=0.5)
            stream = session.chat("Tell me more")
            texts = []
            with pytest.raises(ConnectionLostError) as info:
                async for delta in stream:
                    texts.append(delta.text)
            assert texts == ["Hel"] and info.value.code == 1006 and info.value.reconnecting
            await session.conn.wait_ready()  # reconnected and restored
            assert session.reconnects == 1
            await client.close()
        first, second = fake.received
        restore = [e for e in second if e["type"] != "response.create"]
        assert restore[0]["session"] == {"instructions": "Be brief.", "temperature": 0.5}
        items = [e["item"] for e in restore[1:]]
        # The history, the earlier ids kept, plus the message of the lost turn (it had been
        # added); not the lost answer.
        assert [(i["role"], i["content"]) for i in items] == [
            ("user", "Hi"), ("assistant", "Hello!"), ("user", "Tell me more")]
        assert items[1]["id"] == "a1" and items[0]["id"] == first[1]["item"]["id"]
        assert session.history == [Message(i["id"], i["role"], i["content"]) for i in items]

    run(body())


def test_full_server_1013_is_retried(strict):
    async def body() -> None:
        for _ in range(200):  # sockets of earlier tests are closed server-side
            if strict.gateway.ws_limit.open == 0:
                break
            await asyncio.sleep(0.02)
        with contextlib.ExitStack() as stack:
            auth = {"Authorization": f"Bearer {KEY}"}
            holders = [stack.enter_context(ws_open(strict.ws_url, additional_headers=auth))
                       for _ in range(2)]  # max_connections=2: both slots taken
            client = AsyncClient(strict.ws_url, api_key=KEY, backoff=FAST)
            connecting = asyncio.create_task(client.connect())
            await asyncio.sleep(0.5)
            assert not connecting.done()  # refused with 1013, retrying
            holders[0].close()
            await asyncio.wait_for(connecting, 20)
            assert (await client.chat("Hi", **SHORT).result()).completed
            await client.close()

    run(body())


def test_server_restart_1012_reconnects_with_the_conversation(tiny_model_dir):
    async def body() -> None:
        with serve(make_settings(drain_timeout=0.5), tiny_factory(tiny_model_dir)) as first:
            port = first.port
            client = AsyncClient(first.ws_url, backoff=FAST)
            session = client.session("You are terse.", temperature=0)
            await session.chat("Hi", **SHORT).result()
            await session.chat("Again", **SHORT).result()
            before = session.history
            first.server.handle_exit(signal.SIGTERM, None)  # drain, close 1012, exit
            await asyncio.to_thread(first.thread.join, 30)
        assert not session.conn.connected
        settings = make_settings(port=port)
        with serve(settings, tiny_factory(tiny_model_dir)) as second:
            await asyncio.wait_for(session.conn.wait_ready(), 30)
            assert session.reconnects >= 1 and session.history == before
            assert [[i["id"] for i in c] for c in server_conversations(second)] == \
                [[m.id for m in before]]
            done = await session.chat("Once more", **SHORT).result()
            assert done.completed and len(session.history) == 6
            await client.close()

    run(body(), timeout=90)
