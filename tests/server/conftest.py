"""Fixtures for the gateway tests: a real uvicorn server on 127.0.0.1 (a random free port) in a
background thread, serving the app from ``create_app`` on a tiny random model, and helpers
for a real ``websockets`` client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.sync.client import ClientConnection, connect

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.server.gateway import EngineFactory, Gateway
from quickdraft.server.runner import GatewayServer, build_server
from quickdraft.server.settings import ServerSettings

ENGINE_KW: dict[str, Any] = dict(dtype="float32", num_threads=1, num_kv_blocks=256,
                                 block_size=16, max_num_batched_tokens=128)
TIMEOUT = 30.0  # generous: the 2 test cores are shared


def tiny_factory(model_dir: Path, **overrides: Any) -> EngineFactory:
    config = EngineConfig(model=str(model_dir), **{**ENGINE_KW, **overrides})
    return lambda: AsyncLLM(LLMEngine(config, progress=False))


@dataclass
class Served:
    server: GatewayServer
    thread: threading.Thread
    host: str
    port: int

    @property
    def gateway(self) -> Gateway:
        return self.server.gateway

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/ws"

    def engine(self) -> LLMEngine:
        assert self.gateway.llm is not None
        return self.gateway.llm.engine

    def free_blocks(self) -> int:
        return self.engine().kv.num_free_blocks

    def wait_idle(self, baseline: int, timeout: float = 60.0) -> None:
        """Poll until no request is in flight and the KV pool is back at ``baseline`` (returns
        at once when it is; the long limit is for a loaded machine, where a step can stall)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.gateway.admission.in_flight == 0 and self.free_blocks() == baseline:
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle: {self.gateway.admission.in_flight} in flight, "
                             f"{self.free_blocks()} free blocks, baseline {baseline}")


@contextmanager
def serve(settings: ServerSettings, factory: EngineFactory, *,
          wait_ready: bool = True) -> Iterator[Served]:
    server = build_server(settings, factory)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    host, port = server.bound_address()
    served = Served(server, thread, host, port)
    try:
        if wait_ready:
            wait_healthy(served.http)
        yield served
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


def wait_healthy(base: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/health").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError("the server never became healthy")


def make_settings(**overrides: Any) -> ServerSettings:
    return ServerSettings(**{"host": "127.0.0.1", "port": 0, "log_level": "warning",
                             **overrides})


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    """One server for a module: default limits, no keys."""
    with serve(make_settings(), tiny_factory(tiny_model_dir)) as s:
        yield s


# ---------------------------------------------------------------------- websocket client


def ws_open(url: str, **kw: Any) -> ClientConnection:
    kw.setdefault("max_size", 16 << 20)
    return connect(url, proxy=None, open_timeout=TIMEOUT, **kw)


def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    ws.send(orjson.dumps(event).decode())


def recv(ws: ClientConnection, timeout: float = TIMEOUT) -> dict[str, Any]:
    event: dict[str, Any] = orjson.loads(ws.recv(timeout=timeout))
    return event


def recv_until(ws: ClientConnection, predicate: Callable[[dict[str, Any]], bool],
               timeout: float = TIMEOUT) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read events until one matches; return it and everything read before it."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        event = recv(ws, max(deadline - time.monotonic(), 0.01))
        if predicate(event):
            return event, seen
        seen.append(event)


def of_type(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == kind and all(e.get(k) == v for k, v in fields.items())


def done_for(response_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == "response.done" and e["response"]["id"] == response_id


def session(ws: ClientConnection) -> dict[str, Any]:
    """Read session.created (the first event of every connection)."""
    event = recv(ws)
    assert event["type"] == "session.created", event
    return event


def say(ws: ClientConnection, text: str, event_id: str | None = None) -> dict[str, Any]:
    send(ws, {"type": "conversation.item.create", "event_id": event_id,
              "item": {"type": "message", "role": "user", "content": text}})
    event, _ = recv_until(ws, of_type("conversation.item.created"))
    return event


def respond(ws: ClientConnection, event_id: str | None = None, **response: Any) -> str:
    """response.create; returns the new response's id."""
    send(ws, {"type": "response.create", "event_id": event_id, "response": response})
    event, _ = recv_until(ws, of_type("response.created", client_event_id=event_id))
    rid: str = event["response"]["id"]
    return rid


def collect(ws: ClientConnection, response_id: str,
            timeout: float = TIMEOUT) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """Read to the response's response.done: (text, done event, its deltas)."""
    done, seen = recv_until(ws, done_for(response_id), timeout)
    deltas = [e for e in seen if e["type"] == "response.output_text.delta"
              and e["response_id"] == response_id]
    return "".join(d["delta"] for d in deltas), done, deltas


LONG = {"max_output_tokens": 1500, "temperature": 0, "ignore_eos": True}
SHORT = {"max_output_tokens": 8, "temperature": 0, "ignore_eos": True}
