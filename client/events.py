"""Typed views of the server events a client acts on (docs/protocol.md, "Server events").

Every dataclass keeps the event as received in ``raw``, so fields this client does not model
are still reachable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

JSON = dict[str, Any]
Role = Literal["user", "assistant", "system"]
Priority = Literal["interactive", "background"]


@dataclass(frozen=True)
class Message:
    """One conversation item (a message) as the server holds it."""

    id: str
    role: str
    text: str

    @classmethod
    def from_item(cls, item: JSON) -> Message:
        return cls(str(item["id"]), str(item["role"]), content_text(item.get("content")))

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text}


@dataclass(frozen=True)
class Limits:
    max_concurrent_responses: int
    max_message_size: int
    max_conversation_items: int

    @classmethod
    def from_dict(cls, d: JSON) -> Limits:
        return cls(int(d.get("max_concurrent_responses", 8)),
                   int(d.get("max_message_size", 1 << 20)),
                   int(d.get("max_conversation_items", 1024)))


@dataclass(frozen=True)
class SessionInfo:
    """``session.created`` / ``session.updated``: the session's id, model and defaults."""

    id: str
    model: str
    max_model_len: int
    instructions: str | None
    limits: Limits
    raw: JSON = field(repr=False)

    @classmethod
    def from_event(cls, event: JSON) -> SessionInfo:
        s = event["session"]
        return cls(str(s["id"]), str(s.get("model", "")), int(s.get("max_model_len", 0)),
                   s.get("instructions"), Limits.from_dict(s.get("limits") or {}), s)

    @property
    def defaults(self) -> JSON:
        """The effective sampling defaults (temperature, top_p, ..., speculation)."""
        skip = ("id", "object", "model", "max_model_len", "limits")
        return {k: v for k, v in self.raw.items() if k not in skip}


@dataclass(frozen=True)
class ResponseCreated:
    response_id: str
    item_id: str
    conversation: str  # "auto": the answer joins the conversation when it completes; "none"
    client_event_id: str | None

    @classmethod
    def from_event(cls, event: JSON) -> ResponseCreated:
        r = event["response"]
        return cls(str(r["id"]), str(r["item_id"]), str(r.get("conversation", "auto")),
                   event.get("client_event_id"))


@dataclass(frozen=True)
class TextDelta:
    """New text of a response; ``num_tokens`` may exceed 1 (speculation, merged deltas)."""

    response_id: str
    item_id: str
    sequence_number: int
    text: str
    num_tokens: int

    @classmethod
    def from_event(cls, event: JSON) -> TextDelta:
        return cls(str(event["response_id"]), str(event["item_id"]),
                   int(event["sequence_number"]), str(event["delta"]),
                   int(event.get("num_tokens", 0)))


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    total_tokens: int
    num_preemptions: int = 0


@dataclass(frozen=True)
class Timings:
    """Seconds, measured by the engine: arrival to first scheduled, arrival to first token,
    first token to finish."""

    queue_time: float
    time_to_first_token: float | None
    decode_time: float


@dataclass(frozen=True)
class SpeculationStats:
    num_steps: int  # verification steps that carried drafts
    drafted_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float  # tokens per verification step

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True)
class ResponseDone:
    """The last event of a response: its status, whole text and statistics.

    ``status``: ``completed`` (``finish_reason`` ``stop`` or ``length``), ``cancelled``
    (``status_details["reason"]``: ``client_cancelled`` or ``server_shutdown``) or ``failed``.
    ``usage`` / ``timings`` / ``speculation`` are None for responses that never reached the
    engine.
    """

    response_id: str
    item_id: str
    status: str
    finish_reason: str
    status_details: JSON
    text: str
    usage: Usage | None
    timings: Timings | None
    speculation: SpeculationStats | None
    client_event_id: str | None
    raw: JSON = field(repr=False)

    @classmethod
    def from_event(cls, event: JSON) -> ResponseDone:
        r = event["response"]
        output = r.get("output") or []
        text = "".join(content_text(o.get("content")) for o in output)
        usage, timings, spec = r.get("usage"), r.get("timings"), r.get("speculation")
        return cls(str(r["id"]), str(r["item_id"]), str(r["status"]),
                   str(r.get("finish_reason")), r.get("status_details") or {}, text,
                   Usage(**usage) if usage else None, Timings(**timings) if timings else None,
                   SpeculationStats(**spec) if spec else None, event.get("client_event_id"),
                   event)

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def tpot(self) -> float | None:
        """Engine-side seconds per output token after the first (decode time / (n - 1))."""
        if self.timings is None or self.usage is None or self.usage.output_tokens < 2:
            return None
        return self.timings.decode_time / (self.usage.output_tokens - 1)


ResponseEvent = ResponseCreated | TextDelta | ResponseDone


def content_text(content: Any) -> str:
    """A message content as text: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
