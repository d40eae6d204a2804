"""Exceptions of the quickdraft client: one base class, server errors carry the protocol's
``code`` / ``message`` / ``param`` (docs/protocol.md), closes carry the WebSocket close code."""

from __future__ import annotations

from typing import Any

# Close codes after which the client reconnects (with backoff): the server restarted or is
# draining (1012), is loading or full (1013), or the connection dropped without a close (1006).
RETRYABLE_CLOSE_CODES = frozenset({1006, 1012, 1013})
POLICY_VIOLATION = 1008  # missing or wrong API key


class QuickdraftError(Exception):
    """Base class of every error the client raises."""


class APIError(QuickdraftError):
    """An ``error`` event from the server (or a ``response.done`` with ``status: "failed"``).

    ``code`` is the protocol's machine-readable code (``invalid_value``, ``rate_limited``,
    ``context_length_exceeded``, ``engine_error``, ...), ``param`` the offending field as a
    path (``response.temperature``), ``event_id`` the client event it answers and
    ``response_id`` the response that failed, if one was created.
    """

    def __init__(self, code: str, message: str, param: str | None = None, *,
                 type: str = "invalid_request_error", event_id: str | None = None,
                 response_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param
        self.type = type
        self.event_id = event_id
        self.response_id = response_id

    @classmethod
    def from_error(cls, error: dict[str, Any], *, event_id: str | None = None,
                   response_id: str | None = None) -> APIError:
        """From the ``error`` object of an ``error`` event or of ``status_details``."""
        return cls(str(error.get("code") or "unknown_error"), str(error.get("message") or ""),
                   error.get("param"), type=str(error.get("type") or "server_error"),
                   event_id=error.get("event_id") or event_id, response_id=response_id)

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> APIError:
        """From a whole ``error`` server event."""
        return cls.from_error(event.get("error") or {}, event_id=event.get("client_event_id"),
                              response_id=event.get("response_id"))

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later unchanged."""
        return self.code in ("rate_limited", "server_shutting_down")

    def __repr__(self) -> str:
        return f"APIError({self.code!r}, {self.message!r}, param={self.param!r})"


class ConnectionClosedError(QuickdraftError):
    """The socket is closed for good: closed by the client, a close code that is not retried,
    or reconnecting gave up. ``code`` is the WebSocket close code (1006: no close frame)."""

    def __init__(self, code: int, reason: str = "", message: str | None = None) -> None:
        super().__init__(message or f"connection closed ({code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class ConnectError(ConnectionClosedError):
    """The client could not open a session socket: the first connect failed (connection
    refused, unknown host, no answer within ``connect_timeout``, the handshake rejected), or
    reconnecting after a drop gave up. ``url`` is the server's URL, ``cause`` what went wrong;
    ``code`` is the server's close code if it closed the socket (1013: busy), else 1006."""

    def __init__(self, url: str, cause: str, *, code: int = 1006, reason: str = "") -> None:
        super().__init__(code, reason, f"cannot connect to {url}: {cause}")
        self.url = url
        self.cause = cause


class AuthenticationError(ConnectionClosedError):
    """The server refused the API key or the connection (close code 1008, or HTTP 401 / 403
    during the handshake). Not retried."""


class ConnectionLostError(ConnectionClosedError):
    """The socket dropped while a response was streaming. The server aborted that response and
    did not add it to the conversation; the client reconnects by itself (close codes 1006,
    1012, 1013), so asking again is safe once it has."""

    @property
    def reconnecting(self) -> bool:
        return self.code in RETRYABLE_CLOSE_CODES
