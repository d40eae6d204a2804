"""Shapes of the server events that carry more than a few fields (docs/protocol.md)."""

from __future__ import annotations

from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.server.errors import ProtocolError
from quickdraft.server.params import JSON, speculation_view, timings_view


def outcome(out: RequestOutput, cancel_reason: str | None) -> tuple[str, str, JSON]:
    """(status, finish_reason, status_details) of a finished engine request."""
    if out.finish_reason in ("stop", "length"):
        return "completed", out.finish_reason, {"stop_reason": out.stop_reason}
    if out.finish_reason == "abort":
        return "cancelled", "cancelled", {"reason": cancel_reason or "aborted"}
    error = {"type": "server_error", "code": "engine_error",
             "message": out.error or "the engine failed this request", "param": None}
    return "failed", "error", {"error": error}


def response_done(response_id: str, item_id: str, client_event_id: str | None, *,
                  status: str, finish_reason: str, details: JSON, usage: Usage | None,
                  output: list[JSON]) -> JSON:
    return {"type": "response.done", "client_event_id": client_event_id,
            "response": {
                "id": response_id, "object": "realtime.response", "status": status,
                "finish_reason": finish_reason, "status_details": details,
                "item_id": item_id, "output": output, "usage": usage_view(usage),
                "timings": timings_view(usage) if usage else None,
                "speculation": speculation_view(usage) if usage else None}}


def error_event(err: ProtocolError, event_id: str | None, response_id: str | None) -> JSON:
    event: JSON = {"type": "error", "client_event_id": event_id,
                   "error": {**err.to_dict(), "event_id": event_id}}
    if response_id is not None:
        event["response_id"] = response_id
    return event


def usage_view(u: Usage | None) -> JSON | None:
    if u is None:
        return None
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "num_preemptions": u.num_preemptions}
