"""The fields the WebSocket protocol's client events take (docs/protocol.md), and how
the Sans-I/O session (:mod:`server.protocol`) refuses others: an OpenAI feature this server
lacks as ``unsupported_parameter`` (as the HTTP API does), any other unknown field as
``unknown_parameter`` naming the field meant where one is known (``max_tokens`` ->
``max_output_tokens``, a field sent beside ``response`` instead of in it). Pure data and
pure functions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import orjson

from quickdraft.server.errors import ProtocolError, unsupported
from quickdraft.server.params import JSON, SAMPLING_FIELDS, UNSUPPORTED_FIELDS, Fields

SESSION_FIELDS = ("instructions", "max_output_tokens", "speculation", *SAMPLING_FIELDS)
RESPONSE_FIELDS = (*SESSION_FIELDS, "model", "priority", "conversation", "cache_salt")
ITEM_FIELDS = ("id", "type", "role", "content")
# OpenAI request fields the WebSocket has no equivalent for: unsupported_parameter whatever
# their value, as the HTTP API refuses them (n or best_of above 1, echo, top_logprobs, ...).
OPENAI_ONLY_FIELDS = (*UNSUPPORTED_FIELDS, "n", "best_of", "echo", "logit_bias", "logprobs",
                      "top_logprobs", "response_format", "tool_choice", "parallel_tool_calls",
                      "function_call")
_AS_ITEMS = "conversation.item.create events (one per message) before response.create"
# Names from OpenAI's HTTP APIs that response.create and session.update do not take -> the
# field (or event) meant, named in the unknown_parameter message (docs/protocol.md).
RENAMED = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "max_response_output_tokens": "max_output_tokens",  # the Realtime API's session field
    "messages": _AS_ITEMS,
    "input": _AS_ITEMS,
    "prompt": _AS_ITEMS,
    "system": "instructions",
    "system_prompt": "instructions",
}
MAX_ID_LEN = 128


def check_fields(f: Fields, allowed: Collection[str], event: str,
                 hints: Mapping[str, str]) -> None:
    """Refuse the fields ``f`` does not define: an OpenAI feature this server lacks as
    ``unsupported_parameter`` (as the HTTP API does), any other field as ``unknown_parameter``,
    its message naming the field meant where ``hints`` knows it."""
    for key in f.obj:
        if key not in allowed and key in OPENAI_ONLY_FIELDS:
            raise unsupported(f.param(key), "not supported by this server")
    f.only(allowed, where=event, renamed=hints)


def event_hints(inner: str, fields: Collection[str]) -> dict[str, str]:
    """Hints for fields sent beside ``inner`` (``{"type": "response.create", "top_p": 1}``)
    rather than in it."""
    hints = {k: f"{inner}.{v}" if v in fields else v for k, v in RENAMED.items()}
    return hints | {k: f"{inner}.{k}" for k in fields}


SESSION_EVENT_HINTS = event_hints("session", (*SESSION_FIELDS, "model"))
ITEM_EVENT_HINTS = {"message": "item", **{k: f"item.{k}" for k in ITEM_FIELDS}}
RESPONSE_EVENT_HINTS = event_hints("response", RESPONSE_FIELDS)


def parse_event(text: str) -> JSON:
    """A client message as an event object (``invalid_json`` / ``invalid_event`` otherwise)."""
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"the message is not valid JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object")
    return event


def read_event_id(event: dict[str, Any]) -> str | None:
    """The event's optional ``event_id``, echoed in errors it causes."""
    value = event.get("event_id")
    if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_LEN):
        raise ProtocolError("invalid_type", f"event_id must be a string of at most "
                            f"{MAX_ID_LEN} characters", "event_id")
    return value
