"""The one error type the gateway reports to clients, rendered for WebSocket and HTTP alike.

``code`` is machine-readable (stable, documented in docs/protocol.md), ``param`` names the
offending field as a path (``response.temperature``, ``messages[1].content``), ``status`` is the
HTTP status an HTTP endpoint answers with, ``type`` follows OpenAI's error types.
"""

from __future__ import annotations

from typing import Any

from quickdraft.engine.sampling_params import InvalidParameterError


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, *,
                 status: int = 400, type: str = "invalid_request_error",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message,
                "param": self.param}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, param={self.param!r})"


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def missing(param: str) -> ProtocolError:
    return ProtocolError("missing_required_parameter", f"missing required field {param!r}", param)


def wrong_type(param: str, expected: str) -> ProtocolError:
    return ProtocolError("invalid_type", f"{param} must be {expected}", param)


def invalid(param: str, message: str) -> ProtocolError:
    return ProtocolError("invalid_value", f"{param}: {message}", param)


def unsupported(param: str, message: str) -> ProtocolError:
    return ProtocolError("unsupported_parameter", f"{param}: {message}", param)


def unknown(param: str, where: str | None = None, use: str | None = None) -> ProtocolError:
    """A field its object does not define. With ``where`` (the event) the message names the
    field within it, with ``use`` the field meant, when that is clear:
    "unknown field 'max_tokens' in response.create — use max_output_tokens"."""
    name = param.rsplit(".", 1)[-1]
    message = f"unknown field {name!r} in {where}" if where else f"unknown field {param!r}"
    if use:
        message += f" — use {use}"
    return ProtocolError("unknown_parameter", message, param)


def model_not_found(name: str, param: str = "model") -> ProtocolError:
    return ProtocolError("model_not_found", f"The model {name!r} does not exist; see "
                         "/v1/models", param, status=404)


def empty_conversation(param: str, message: str) -> ProtocolError:
    """Nothing to answer: no message (HTTP) or no conversation item nor instructions."""
    return ProtocolError("empty_conversation", message, param)


def from_engine(exc: InvalidParameterError, prefix: str = "",
                rename: dict[str, str] | None = None) -> ProtocolError:
    """An engine-side validation error, its field renamed to the API's name and path."""
    name = (rename or {}).get(exc.param, exc.param)
    return invalid(join_path(prefix, name), exc.message)


def rate_limited(message: str) -> ProtocolError:
    return ProtocolError("rate_limited", message, status=429, type="rate_limit_error",
                         retry_after=1)


def shutting_down() -> ProtocolError:
    return ProtocolError("server_shutting_down",
                         "the server is shutting down and takes no new requests",
                         status=503, type="service_unavailable_error", retry_after=5)


def model_loading() -> ProtocolError:
    return ProtocolError("model_loading", "the model is still loading; retry shortly",
                         status=503, type="service_unavailable_error", retry_after=2)


def engine_failed(message: str) -> ProtocolError:
    return ProtocolError("engine_error", message, status=500, type="server_error")
