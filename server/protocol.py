"""Sans-I/O core of the WebSocket protocol (docs/protocol.md): no sockets, no asyncio, no engine.

:class:`Session` is a state machine. The I/O layer feeds it client messages, engine outputs and
failures; it answers with commands for the engine (:class:`StartResponse`,
:class:`CancelResponse`) and queues server events, which the I/O layer pulls with
:meth:`Session.next_event` whenever the socket can take one. Text deltas of a response that are
still queued get merged, so a lagging client receives fewer, larger deltas (sequence numbers stay
gap-free) and never holds up the engine. Tokenization and generation happen outside.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.server.errors import (
    ProtocolError,
    empty_conversation,
    invalid,
    rate_limited,
)
from quickdraft.server.events import error_event, outcome, response_done
from quickdraft.server.limits import Admission
from quickdraft.server.outbox import Outbox
from quickdraft.server.params import (
    CHAT_ROLES,
    JSON,
    Fields,
    build_sampling,
    check_model,
    read_cache_salt,
    read_max_tokens,
    read_message,
    read_priority,
    read_sampling,
    read_speculation,
    sampling_view,
)
from quickdraft.server.protocol_fields import (
    ITEM_EVENT_HINTS,
    ITEM_FIELDS,
    MAX_ID_LEN,
    RENAMED,
    RESPONSE_EVENT_HINTS,
    RESPONSE_FIELDS,
    SESSION_EVENT_HINTS,
    SESSION_FIELDS,
    check_fields,
    parse_event,
    read_event_id,
)
from quickdraft.spec.params import SpeculationParams

CHARS_PER_TOKEN_BOUND = 32  # a conversation longer than context * this can never be answered


@dataclass(frozen=True)
class StartResponse:
    """Tokenize ``messages`` with the chat template and generate under ``response_id``."""

    response_id: str
    messages: list[dict[str, str]]
    params: SamplingParams  # max_tokens still to be fitted to the prompt
    max_tokens: int | None  # the client's limit; None = up to the context
    priority: int
    speculation: SpeculationParams | None
    cache_salt: str | None = None  # the client's namespace within its tenant


@dataclass(frozen=True)
class CancelResponse:
    response_id: str


Command = StartResponse | CancelResponse


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class _Item:
    id: str
    role: str
    text: str

    def view(self) -> JSON:
        part = "output_text" if self.role == "assistant" else "input_text"
        return {"id": self.id, "type": "message", "role": self.role,
                "content": [{"type": part, "text": self.text}]}


@dataclass(frozen=True)
class _Defaults:
    """Session-level defaults that ``session.update`` sets and ``response.create`` overrides."""

    instructions: str | None = None
    sampling: JSON = field(default_factory=dict)
    max_tokens: int | None = None
    speculation: SpeculationParams | None = None


@dataclass
class _Response:
    id: str
    item_id: str
    client_event_id: str | None
    append: bool  # add the answer to the conversation when it completes
    parts: list[str] = field(default_factory=list)
    cancel_reason: str | None = None


class Session:
    """One WebSocket session: its conversation, defaults, responses and outgoing events."""

    def __init__(self, session_id: str, *, model: str, max_model_len: int,
                 admission: Admission, max_responses: int = 8, max_items: int = 1024,
                 max_message_size: int = 1 << 20) -> None:
        self.id = session_id
        self.model = model
        self.max_model_len = max_model_len
        self._admission = admission
        self._max_responses = max_responses
        self._max_items = max_items
        self._max_message_size = max_message_size
        self._max_chars = max_model_len * CHARS_PER_TOKEN_BOUND
        self._defaults = _Defaults()
        self._items: list[_Item] = []
        self._chars = 0
        self._responses: dict[str, _Response] = {}
        self._outbox = Outbox()
        self._handlers: dict[str, Callable[[Fields, str | None], list[Command]]] = {
            "session.update": self._session_update,
            "conversation.item.create": self._item_create,
            "conversation.item.delete": self._item_delete,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
        }

    # ------------------------------------------------------------------ state

    @property
    def pending_events(self) -> int:
        return len(self._outbox)

    @property
    def active_responses(self) -> list[str]:
        return list(self._responses)

    @property
    def conversation(self) -> list[JSON]:
        return [item.view() for item in self._items]

    def open(self) -> None:
        self._emit({"type": "session.created", "session": self._view()})

    def next_event(self) -> JSON | None:
        """The next event to send, or None when nothing is queued."""
        return self._outbox.pop()

    # ------------------------------------------------------------------ client input

    def receive_text(self, text: str) -> list[Command]:
        """One client message; errors become ``error`` events, never exceptions."""
        event_id: str | None = None
        try:
            event = parse_event(text)
            event_id = read_event_id(event)
            return self._handler(event)(Fields(event), event_id)
        except ProtocolError as err:
            self._error(err, event_id)
            return []

    def receive_bytes(self) -> None:
        self._error(ProtocolError("binary_not_supported",
                                  "send events as JSON in text frames, not binary frames"), None)

    def _handler(self, event: JSON) -> Callable[[Fields, str | None], list[Command]]:
        kind = Fields(event).string("type", required=True)
        handler = self._handlers.get(kind or "")
        if handler is None:
            raise ProtocolError("unknown_event_type", f"unknown event type {kind!r}; expected "
                                f"one of {sorted(self._handlers)}", "type")
        return handler

    def _session_update(self, ev: Fields, event_id: str | None) -> list[Command]:
        check_fields(ev, ("type", "event_id", "session"), "session.update",
                      SESSION_EVENT_HINTS)
        s = ev.child("session", required=True)
        assert s is not None
        check_fields(s, (*SESSION_FIELDS, "model"), "session.update", RENAMED)
        check_model(s, self.model)
        d, raw = self._defaults, s.obj  # a field given as null resets it to the default
        instructions = s.string("instructions", max_len=self._max_chars) \
            if "instructions" in raw else d.instructions
        sampling = {k: v for k, v in d.sampling.items() if not (k in raw and raw[k] is None)}
        sampling.update(read_sampling(s))
        max_tokens = read_max_tokens(s, "max_output_tokens", allow_inf=True) \
            if "max_output_tokens" in raw else d.max_tokens
        speculation = read_speculation(s) if "speculation" in raw else d.speculation
        build_sampling({**sampling, "max_tokens": max_tokens or 1}, "session",
                       "max_output_tokens")
        self._defaults = _Defaults(instructions, sampling, max_tokens, speculation)
        self._emit({"type": "session.updated", "client_event_id": event_id,
                    "session": self._view()})
        return []

    def _item_create(self, ev: Fields, event_id: str | None) -> list[Command]:
        check_fields(ev, ("type", "event_id", "item"), "conversation.item.create",
                      ITEM_EVENT_HINTS)
        it = ev.child("item", required=True)
        assert it is not None
        it.choice("type", ("message",))
        role, text = read_message(it)  # as a message over HTTP: the same errors
        it.only(ITEM_FIELDS, where="conversation.item.create")
        item_id = it.string("id", max_len=MAX_ID_LEN) or new_id("item")
        if any(item.id == item_id for item in self._items):
            raise invalid(it.param("id"), f"an item with id {item_id!r} already exists")
        if len(self._items) >= self._max_items or self._chars + len(text) > self._max_chars:
            raise ProtocolError("conversation_full", "the conversation is at its limit of "
                                f"{self._max_items} items / {self._max_chars} characters; "
                                "delete items first", "item")
        previous = self._items[-1].id if self._items else None
        item = _Item(item_id, role, text)
        self._append(item)
        self._emit({"type": "conversation.item.created", "client_event_id": event_id,
                    "previous_item_id": previous, "item": item.view()})
        return []

    def _item_delete(self, ev: Fields, event_id: str | None) -> list[Command]:
        ev.only(("type", "event_id", "item_id"))
        item_id = ev.string("item_id", required=True, max_len=MAX_ID_LEN)
        for i, item in enumerate(self._items):
            if item.id == item_id:
                del self._items[i]
                self._chars -= len(item.text)
                self._emit({"type": "conversation.item.deleted", "client_event_id": event_id,
                            "item_id": item_id})
                return []
        raise ProtocolError("item_not_found", f"no conversation item {item_id!r}", "item_id")

    def _response_create(self, ev: Fields, event_id: str | None) -> list[Command]:
        check_fields(ev, ("type", "event_id", "response"), "response.create",
                      RESPONSE_EVENT_HINTS)
        r = ev.child("response") or Fields({}, "response")
        check_fields(r, RESPONSE_FIELDS, "response.create", RENAMED)
        check_model(r, self.model)
        d = self._defaults
        max_tokens = read_max_tokens(r, "max_output_tokens", allow_inf=True) \
            if "max_output_tokens" in r.obj else d.max_tokens
        params = build_sampling({**d.sampling, **read_sampling(r), "max_tokens": max_tokens or 1},
                                "response", "max_output_tokens")
        priority = read_priority(r)
        cache_salt = read_cache_salt(r)
        speculation = read_speculation(r) if r.has("speculation") else d.speculation
        instructions = r.string("instructions") if r.has("instructions") else d.instructions
        append = r.choice("conversation", ("auto", "none"), "auto") == "auto"
        messages = self._messages(instructions)
        if not messages:
            raise empty_conversation("conversation", "create a conversation item (or set "
                                     "instructions) before response.create")
        self._admit()
        resp = _Response(new_id("resp"), new_id("item"), event_id, append)
        self._responses[resp.id] = resp
        self._emit({"type": "response.created", "client_event_id": event_id,
                    "response": {"id": resp.id, "object": "realtime.response",
                                 "status": "in_progress", "item_id": resp.item_id,
                                 "conversation": "auto" if append else "none"}})
        return [StartResponse(resp.id, messages, params, max_tokens, priority, speculation,
                              cache_salt)]

    def _response_cancel(self, ev: Fields, event_id: str | None) -> list[Command]:
        ev.only(("type", "event_id", "response_id"))
        rid = ev.string("response_id", max_len=MAX_ID_LEN)
        targets = list(self._responses.values()) if rid is None \
            else [r for r in (self._responses.get(rid),) if r is not None]
        if not targets:
            what = "no response" if rid is None else f"no response {rid!r}"
            raise ProtocolError("response_not_active", f"{what} is in progress", "response_id")
        for resp in targets:
            resp.cancel_reason = resp.cancel_reason or "client_cancelled"
        return [CancelResponse(resp.id) for resp in targets]

    def _admit(self) -> None:
        if len(self._responses) >= self._max_responses:
            raise rate_limited(f"at most {self._max_responses} responses may run at once on "
                               "one connection; wait for one to finish")
        refused = self._admission.try_acquire()
        if refused is not None:
            raise refused

    def _messages(self, instructions: str | None) -> list[dict[str, str]]:
        system = [{"role": "system", "content": instructions}] if instructions else []
        return system + [{"role": CHAT_ROLES[item.role], "content": item.text}
                         for item in self._items]

    # ------------------------------------------------------------------ engine side

    def on_output(self, response_id: str, out: RequestOutput) -> None:
        """An engine delta for a response (ignored once the response is over)."""
        resp = self._responses.get(response_id)
        if resp is None:
            return
        if out.text or out.token_ids:
            resp.parts.append(out.text)
            self._outbox.delta(resp.id, resp.item_id, out.text, len(out.token_ids))
        if out.finished:
            status, finish_reason, details = outcome(out, resp.cancel_reason)
            text = "".join(resp.parts)
            item = _Item(resp.item_id, "assistant", text)
            if status == "completed" and resp.append:
                self._append(item)
            self._done(resp, status, finish_reason, details, out.usage, [item.view()])

    def on_failure(self, response_id: str, err: ProtocolError) -> None:
        """The response could not run (prompt too long, engine refused or died)."""
        resp = self._responses.get(response_id)
        if resp is None:
            return
        self._error(err, resp.client_event_id, response_id)
        self._done(resp, "failed", "error", {"error": err.to_dict()}, None, [])

    def on_cancelled(self, response_id: str) -> None:
        """Cancelled before the engine saw it."""
        resp = self._responses.get(response_id)
        if resp is not None:
            self._done(resp, "cancelled", "cancelled",
                       {"reason": resp.cancel_reason or "cancelled"}, None, [])

    def cancel_all(self, reason: str) -> list[Command]:
        """Cancel every response in progress (server shutdown)."""
        for resp in self._responses.values():
            resp.cancel_reason = resp.cancel_reason or reason
        return [CancelResponse(rid) for rid in self._responses]

    def connection_lost(self) -> list[str]:
        """Forget every response (their slots are released); returns their ids to abort."""
        ids = list(self._responses)
        for _ in ids:
            self._admission.release()
        self._responses.clear()
        self._outbox.clear()
        return ids

    # ------------------------------------------------------------------ events out

    def _emit(self, event: JSON) -> None:
        self._outbox.emit(event)

    def _append(self, item: _Item) -> None:
        self._items.append(item)
        self._chars += len(item.text)

    def _done(self, resp: _Response, status: str, finish_reason: str, details: JSON,
              usage: Usage | None, output: list[JSON]) -> None:
        del self._responses[resp.id]
        self._outbox.end(resp.id)
        self._admission.release()
        self._emit(response_done(resp.id, resp.item_id, resp.client_event_id, status=status,
                                 finish_reason=finish_reason, details=details, usage=usage,
                                 output=output))

    def _error(self, err: ProtocolError, event_id: str | None,
               response_id: str | None = None) -> None:
        self._emit(error_event(err, event_id, response_id))

    def _view(self) -> JSON:
        d = self._defaults
        spec = d.speculation
        return {
            "id": self.id, "object": "quickdraft.session", "model": self.model,
            "max_model_len": self.max_model_len, "instructions": d.instructions,
            "max_output_tokens": "inf" if d.max_tokens is None else d.max_tokens,
            "speculation": None if spec is None else {"method": spec.method, "k": spec.k},
            **sampling_view(SamplingParams(**d.sampling)),
            "limits": {"max_concurrent_responses": self._max_responses,
                       "max_message_size": self._max_message_size,
                       "max_conversation_items": self._max_items},
        }
