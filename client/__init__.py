"""Streaming Python client for ``quickdraft serve``'s WebSocket API (docs/client.md).

    async with AsyncClient("ws://127.0.0.1:8000/v1/ws") as client:
        async for delta in client.chat("Hello!"):
            print(delta.text, end="", flush=True)
"""

from quickdraft.client.async_client import DEFAULT_URL, AsyncClient
from quickdraft.client.errors import (
    APIError,
    AuthenticationError,
    ConnectError,
    ConnectionClosedError,
    ConnectionLostError,
    QuickdraftError,
)
from quickdraft.client.events import (
    Limits,
    Message,
    ResponseCreated,
    ResponseDone,
    ResponseEvent,
    SessionInfo,
    SpeculationStats,
    TextDelta,
    Timings,
    Usage,
)
from quickdraft.client.retry import Backoff
from quickdraft.client.session import ChatSession
from quickdraft.client.stream import ResponseStream
from quickdraft.client.sync import Client, SyncSession, SyncStream

__all__ = [
    "DEFAULT_URL",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "Backoff",
    "ChatSession",
    "Client",
    "ConnectError",
    "ConnectionClosedError",
    "ConnectionLostError",
    "Limits",
    "Message",
    "QuickdraftError",
    "ResponseCreated",
    "ResponseDone",
    "ResponseEvent",
    "ResponseStream",
    "SessionInfo",
    "SpeculationStats",
    "SyncSession",
    "SyncStream",
    "TextDelta",
    "Timings",
    "Usage",
]
