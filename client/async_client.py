"""``AsyncClient``: one-shot chats multiplexed over one socket, and multi-turn sessions.

``client.chat(messages)`` runs on a shared socket: its messages become conversation items of
that socket's session, ``response.create`` (with ``conversation: "none"``) snapshots them, and
they are deleted right after, all sent back to back, so concurrent chats never see each
other's messages. ``client.session()`` opens a socket of its own whose conversation the server
keeps (:class:`ChatSession`).
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from quickdraft.client.connection import Connection
from quickdraft.client.events import JSON, Message, SessionInfo, content_text
from quickdraft.client.retry import Backoff, SocketOptions
from quickdraft.client.session import ChatSession
from quickdraft.client.stream import ResponseStream

DEFAULT_URL = "ws://127.0.0.1:8000/v1/ws"
API_KEY_ENV = "QUICKDRAFT_API_KEY"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
MessageLike = str | Message | Mapping[str, Any]


class AsyncClient:
    """A client of ``quickdraft serve``'s WebSocket API (``ws://HOST:PORT/v1/ws``).

    ``api_key`` defaults to ``$QUICKDRAFT_API_KEY``. Sockets open lazily, on first use (or
    :meth:`connect` / ``async with``). The first connect fails fast: a server that is down, an
    unknown host, a port that does not answer within ``connect_timeout`` seconds or a refused
    handshake raise :class:`ConnectError` (:class:`AuthenticationError` for HTTP 401 / 403 or
    close 1008); only a busy server (1012 / 1013, HTTP 429 / 503) is waited for, per
    ``backoff``. Once connected, ``backoff`` governs reconnecting after close codes 1006 /
    1012 / 1013, each attempt within ``open_timeout`` seconds; every retry is logged on the
    ``quickdraft.client`` logger. ``reconnect=False`` retries nothing at all.
    """

    def __init__(self, url: str = DEFAULT_URL, *, api_key: str | None = None,
                 backoff: Backoff | None = None, connect_timeout: float = 5.0,
                 open_timeout: float = 10.0, proxy: str | Literal[True] | None = True,
                 reconnect: bool = True) -> None:
        if connect_timeout <= 0 or open_timeout <= 0:
            raise ValueError("connect_timeout and open_timeout must be positive")
        self.url = url
        self._opts = SocketOptions(url, api_key=api_key or os.environ.get(API_KEY_ENV) or None,
                                   open_timeout=open_timeout, connect_timeout=connect_timeout,
                                   proxy=proxy)
        self._backoff = backoff or Backoff()
        self._reconnect = reconnect
        self._shared = Connection(self._opts, self._backoff, reconnect=reconnect)
        self._sessions: weakref.WeakSet[ChatSession] = weakref.WeakSet()

    @property
    def info(self) -> SessionInfo | None:
        """The shared socket's session (model, context length, limits) once connected."""
        return self._shared.info

    async def connect(self) -> SessionInfo:
        """Open the shared socket now (else the first chat does); raises
        :class:`ConnectError` within ``connect_timeout`` if the server cannot be reached."""
        return await self._shared.start()

    async def close(self) -> None:
        """Close the shared socket and every session opened by this client."""
        for session in list(self._sessions):
            await session.close()
        await self._shared.close()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def chat(self, messages: str | Sequence[MessageLike], **response: Any) -> ResponseStream:
        """Stream an answer to ``messages`` (a string is one user message; else dicts with
        ``role`` and ``content``, or :class:`Message`). ``response`` sets this answer's
        fields: ``max_output_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``stop``, ``priority`` (``"interactive"`` / ``"background"``), ``speculation``,
        ``instructions``... (docs/protocol.md). Nothing is sent until it is iterated."""
        items = [_item(m) for m in _as_messages(messages)]
        before = [{"type": "conversation.item.create", "item": item} for item in items]
        after = [{"type": "conversation.item.delete", "item_id": item["id"]} for item in items]
        fields = {k: v for k, v in response.items() if v is not None}
        return ResponseStream(self._shared, {**fields, "conversation": "none"}, before=before,
                              after=after)

    def session(self, instructions: str | None = None, *,
                history: Sequence[MessageLike] | None = None, **defaults: Any) -> ChatSession:
        """A multi-turn session on a socket of its own. ``instructions`` is the system
        prompt, ``defaults`` are sampling defaults (``session.update``), ``history`` an earlier
        conversation to start from. Connects on first use, or on ``async with``."""
        items = [_item(m) for m in _as_messages(history or [])]
        restored = [Message(i["id"], i["role"], content_text(i["content"])) for i in items]
        session = ChatSession(self._opts, self._backoff, {"instructions": instructions,
                                                          **defaults},
                              history=restored, reconnect=self._reconnect)
        self._sessions.add(session)
        return session


def _as_messages(messages: str | Sequence[MessageLike]) -> list[MessageLike]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return list(messages)


def _item(message: MessageLike) -> JSON:
    """A conversation item with a fresh id (or the Message's own)."""
    role: Any
    content: Any
    item_id: Any
    if isinstance(message, str):
        role, content, item_id = "user", message, None
    elif isinstance(message, Message):
        role, content, item_id = message.role, message.text, message.id
    else:
        role, content, item_id = message.get("role"), message.get("content"), message.get("id")
    if role not in ROLES:
        raise ValueError(f"message role must be one of {sorted(ROLES)}, got {role!r}")
    if not isinstance(content, str | list):
        raise ValueError(f"message content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex[:20]}",
            "role": ROLES[str(role)], "content": content}
