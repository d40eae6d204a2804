"""Pure-ASGI guard in front of every route: the Origin check (before a WebSocket is accepted)
and API keys (compared in constant time).

Origins: no ``Origin`` header (a non-browser client), the same origin as ``Host``, any port on
localhost / 127.0.0.1 / [::1], and ``--allowed-origins`` pass; others get HTTP 403.
Keys (only for ``/v1/...``; ``/health`` and ``/metrics`` stay open): ``Authorization: Bearer``,
or for browser WebSockets the ``api_key`` query parameter or a subprotocol
``quickdraft.api-key.<key>``. A refused key is HTTP 401, or WebSocket close 1008.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from quickdraft.server.errors import ProtocolError
from quickdraft.server.settings import ServerSettings

KEY_SUBPROTOCOL_PREFIX = "quickdraft.api-key."
APP_SUBPROTOCOL = "quickdraft.v1"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
LOCALHOST_ORIGIN_REGEX = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
POLICY_VIOLATION = 1008


def select_subprotocol(offered: Iterable[str]) -> str | None:
    """The subprotocol to echo: ours if offered (never a key-carrying one)."""
    return APP_SUBPROTOCOL if APP_SUBPROTOCOL in offered else None


def presented_key(scope: Scope, headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if scope["type"] != "websocket":
        return None
    for proto in scope.get("subprotocols", []):
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return str(proto[len(KEY_SUBPROTOCOL_PREFIX):])
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query["api_key"][0] if query.get("api_key") else None


def key_matches(given: str | None, keys: Iterable[bytes]) -> bool:
    """Constant time in the key's content: every configured key is compared, always."""
    candidate = (given or "").encode("utf-8", "surrogateescape")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(candidate, key)
    return ok and given is not None


def _host_port(scheme: str, netloc: str) -> tuple[str, int | None] | None:
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or {"http": 80, "https": 443, "ws": 80, "wss": 443}.get(scheme)
    except ValueError:
        return None
    return (parts.hostname or "", port)


def origin_allowed(origin: str, host: str | None, scheme: str, extra: Iterable[str]) -> bool:
    normalized = origin.strip().rstrip("/").lower()
    allowed = set(extra)
    if "*" in allowed or normalized in allowed:
        return True
    try:
        parts = urlsplit(normalized)
        hostname = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not hostname:
        return False  # includes the opaque origin "null"
    if hostname in LOCAL_HOSTS:
        return True
    if host is None:
        return False
    # Same origin: the page's host and port equal the Host this request was sent to.
    page = _host_port(parts.scheme, parts.netloc)
    server_scheme = "https" if scheme in ("https", "wss") else "http"
    return page is not None and page == _host_port(server_scheme, host.lower())


def tenant_of(key: str) -> str:
    """The tenant an API key belongs to: a digest of the key (never the key itself). Requests
    carry it as their ``cache_salt``, so tenants share neither prefix-cache blocks nor the
    suffix proposer's earlier answers."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant(scope: Scope) -> str | None:
    """The request's tenant, set by :class:`Guard` (None when the server has no keys)."""
    state = scope.get("state")
    return state.get("tenant") if isinstance(state, dict) else None


class Guard:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self._keys = tuple(k.encode() for k in settings.api_keys)
        self._origins = settings.allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, headers.get("host"),
                                                     scope.get("scheme", "http"), self._origins):
            error = ProtocolError("origin_not_allowed", f"origin {origin!r} is not allowed; "
                                  "start the server with --allowed-origins to allow it",
                                  status=403, type="permission_error")
            await _respond(error, scope, receive, send)
            return
        if self._needs_key(scope):
            key = presented_key(scope, headers)
            if not key_matches(key, self._keys):
                await self._refuse_key(scope, receive, send)
                return
            assert key is not None
            scope.setdefault("state", {})["tenant"] = tenant_of(key)
        await self.app(scope, receive, send)

    def _needs_key(self, scope: Scope) -> bool:
        return (bool(self._keys) and scope["path"].startswith("/v1")
                and scope.get("method") != "OPTIONS")

    async def _refuse_key(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.accept",
                        "subprotocol": select_subprotocol(scope.get("subprotocols", []))})
            await send({"type": "websocket.close", "code": POLICY_VIOLATION,
                        "reason": "invalid or missing API key"})
            return
        error = ProtocolError("invalid_api_key", "invalid or missing API key; send "
                              "'Authorization: Bearer <key>'", status=401,
                              type="authentication_error")
        await _respond(error, scope, receive, send, {"WWW-Authenticate": "Bearer"})


async def _respond(error: ProtocolError, scope: Scope, receive: Receive, send: Send,
                   headers: dict[str, str] | None = None) -> None:
    """An OpenAI-shaped error response; for a WebSocket, an HTTP denial before the accept."""
    response = JSONResponse({"error": error.to_dict()}, error.status,
                            {**error.headers(), **(headers or {})})
    if scope["type"] == "websocket" and \
            "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": POLICY_VIOLATION})  # servers send 403
        return
    await response(scope, receive, send)
