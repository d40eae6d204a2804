"""The guard's pure parts: origin rules, constant-time key check, where keys are read from."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from quickdraft.server.guard import key_matches, origin_allowed, presented_key, select_subprotocol


@pytest.mark.parametrize(("origin", "host", "extra", "ok"), [
    ("http://localhost:3000", "gw.example", (), True),
    ("http://127.0.0.1:5173", "gw.example", (), True),
    ("http://[::1]:8080", "gw.example", (), True),
    ("https://gw.example", "gw.example", (), False),  # scheme differs from the http server
    ("http://gw.example:8000", "gw.example:8000", (), True),  # same origin
    ("http://gw.example", "gw.example:80", (), True),  # default port
    ("http://evil.example", "gw.example:8000", (), False),
    ("http://localhost.evil.example", "gw.example", (), False),
    ("null", "gw.example", (), False),
    ("https://app.example", "gw.example", ("https://app.example",), True),
    ("https://APP.example/", "gw.example", ("https://app.example",), True),
    ("https://other.example", "gw.example", ("*",), True),
    ("http://evil.example", None, (), False),
])
def test_origin_rules(origin, host, extra, ok):
    assert origin_allowed(origin, host, "http", extra) is ok


def test_key_matches_and_sources():
    keys = [b"first-key-123", b"second-key-456"]
    assert key_matches("second-key-456", keys)
    assert not key_matches("second-key-45", keys)
    assert not key_matches(None, keys)
    assert not key_matches("", keys)
    http = {"type": "http", "query_string": b"api_key=from-query"}
    assert presented_key(http, Headers({"authorization": "Bearer abc"})) == "abc"
    assert presented_key(http, Headers({})) is None  # query keys only for WebSockets
    ws = {"type": "websocket", "query_string": b"api_key=from-query",
          "subprotocols": ["quickdraft.v1", "quickdraft.api-key.from-proto"]}
    assert presented_key(ws, Headers({})) == "from-proto"
    assert presented_key({**ws, "subprotocols": []}, Headers({})) == "from-query"
    assert select_subprotocol(["quickdraft.api-key.x", "quickdraft.v1"]) == "quickdraft.v1"
    assert select_subprotocol(["quickdraft.api-key.x"]) is None
