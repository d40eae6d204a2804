"""Fixtures for the client SDK tests: real ``quickdraft serve`` apps (uvicorn on 127.0.0.1, a
random port, a tiny random model; see tests/server/conftest.py) and a helper to run a
coroutine test body."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from quickdraft.client import Backoff
from tests.server.conftest import Served, make_settings, serve, tiny_factory

T = TypeVar("T")
SHORT: dict[str, Any] = {"max_output_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG: dict[str, Any] = {"max_output_tokens": 1500, "temperature": 0, "ignore_eos": True}
FAST = Backoff(initial=0.05, factor=2.0, max_delay=0.5, max_elapsed=30.0)
KEY = "test-key-123"


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run an async test body on a fresh event loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="package")
def server(tiny_model_dir: Path) -> Iterator[Served]:
    """Default limits, no keys; shared by the whole package."""
    with serve(make_settings(), tiny_factory(tiny_model_dir)) as s:
        yield s


@pytest.fixture(scope="package")
def strict(tiny_model_dir: Path) -> Iterator[Served]:
    """An API key, 2 responses per socket, 2 sockets in all."""
    settings = make_settings(api_keys=(KEY,), max_responses_per_connection=2,
                             max_connections=2)
    with serve(settings, tiny_factory(tiny_model_dir)) as s:
        yield s


def wait_no_inflight(served: Served, timeout: float = 60.0) -> None:
    """Until the server has no engine request in flight (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout
    while served.gateway.admission.in_flight:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.02)


def server_conversations(served: Served) -> list[list[dict[str, Any]]]:
    """The conversation of every open WebSocket session on the server."""
    return [conn.session.conversation for conn in served.gateway.sessions]  # type: ignore[attr-defined]
