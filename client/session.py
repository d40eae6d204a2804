"""A multi-turn chat session: its own socket, the conversation kept by the server.

Each turn sends only the new message. The session mirrors the server's conversation from the
events it sees (items created and deleted, answers of completed ``conversation: "auto"``
responses, in the server's order), so after a reconnect to a new server session it re-creates
the conversation (same item ids, roles and text) and its ``session.update`` settings before
anything else is sent. Responses that were streaming when the socket dropped are lost (the
server aborted them; they raise :class:`ConnectionLostError` and are not in the history).
"""

from __future__ import annotations

from typing import Any

from quickdraft.client.connection import Connection
from quickdraft.client.events import JSON, Message, Role, SessionInfo
from quickdraft.client.retry import Backoff, SocketOptions
from quickdraft.client.stream import ResponseStream


class ChatSession:
    """``session.chat("Hi")`` streams an answer to the conversation so far plus that message."""

    def __init__(self, opts: SocketOptions, backoff: Backoff, settings: JSON | None = None,
                 *, history: list[Message] | None = None, reconnect: bool = True) -> None:
        self._settings: JSON = {k: v for k, v in (settings or {}).items() if v is not None}
        self._items: list[Message] = list(history or [])
        self._auto: set[str] = set()  # responses whose answer joins the conversation
        self.conn = Connection(opts, backoff, on_connect=self._restore, observer=self._observe,
                               reconnect=reconnect)

    # ------------------------------------------------------------------ state

    @property
    def history(self) -> list[Message]:
        """The conversation as the server holds it (a copy)."""
        return list(self._items)

    @property
    def info(self) -> SessionInfo | None:
        """The server session: id, model, context length, limits and current defaults."""
        return self.conn.info

    @property
    def settings(self) -> JSON:
        """What ``session.update`` set so far (re-sent after a reconnect)."""
        return dict(self._settings)

    @property
    def reconnects(self) -> int:
        return self.conn.reconnects

    async def start(self) -> SessionInfo:
        """Connect (done by the first call anyway) and apply the settings."""
        return await self.conn.start()

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> ChatSession:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    def chat(self, content: str | None = None, *, role: Role = "user",
             **response: Any) -> ResponseStream:
        """Add ``content`` as a message (unless None) and stream an answer to the whole
        conversation. ``response`` overrides sampling fields for this answer only
        (``temperature``, ``max_output_tokens``, ``priority``, ``speculation``,
        ``instructions``, ``conversation="none"`` to leave the answer out of the history...)."""
        before = [] if content is None else [
            {"type": "conversation.item.create",
             "item": {"type": "message", "role": role, "content": content}}]
        fields = {k: v for k, v in response.items() if v is not None}
        return ResponseStream(self.conn, fields, before=before)

    async def update(self, **fields: Any) -> SessionInfo:
        """``session.update``: ``instructions`` (the system prompt) and sampling defaults;
        a field set to None goes back to the server's default."""
        reply = await self.conn.request({"type": "session.update", "session": fields})
        for key, value in fields.items():
            if value is None:
                self._settings.pop(key, None)
            else:
                self._settings[key] = value
        return SessionInfo.from_event(reply)

    async def add(self, content: str, role: Role = "user", *,
                  item_id: str | None = None) -> Message:
        """Append a message without answering it (e.g. to restore an earlier conversation)."""
        item: JSON = {"type": "message", "role": role, "content": content}
        if item_id is not None:
            item["id"] = item_id
        reply = await self.conn.request({"type": "conversation.item.create", "item": item})
        return Message.from_item(reply["item"])

    async def delete(self, item_id: str) -> None:
        """Remove a message from the conversation (e.g. to keep it within the context)."""
        await self.conn.request({"type": "conversation.item.delete", "item_id": item_id})

    async def cancel_all(self) -> None:
        """Cancel every response in progress on this session."""
        await self.conn.send_events([{"type": "response.cancel"}])

    # ------------------------------------------------------------------ mirror and restore

    def _observe(self, event: JSON) -> None:
        kind = event.get("type")
        if kind == "conversation.item.created":
            self._items.append(Message.from_item(event["item"]))
        elif kind == "conversation.item.deleted":
            self._items = [m for m in self._items if m.id != event["item_id"]]
        elif kind == "response.created" and event["response"].get("conversation") == "auto":
            self._auto.add(event["response"]["id"])
        elif kind == "response.done":
            r = event["response"]
            if r["id"] in self._auto:
                self._auto.discard(r["id"])
                if r["status"] == "completed":
                    output = r.get("output") or [{"id": r["item_id"], "role": "assistant"}]
                    self._items.append(Message.from_item(output[0]))
        elif kind == "session.created":
            self._auto.clear()  # a new server session: nothing of the old one is running

    async def _restore(self, conn: Connection) -> None:
        """On every (re)connect: re-send the settings and the conversation, then wait for
        the acknowledgements (which rebuild the mirror). An error here fails the session."""
        items, events = self._items, self._restore_events()
        if not events:
            return
        self._items = []
        try:
            await conn.request_many(events, gate=False)
        except BaseException:
            self._items = items
            raise

    def _restore_events(self) -> list[JSON]:
        events: list[JSON] = []
        if self._settings:
            events.append({"type": "session.update", "session": self._settings})
        events += [{"type": "conversation.item.create",
                    "item": {"type": "message", "id": m.id, "role": m.role, "content": m.text}}
                   for m in self._items]
        return events
