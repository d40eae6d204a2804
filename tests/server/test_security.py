"""API keys, Origin checks and overload limits over real sockets: HTTP 401 / 403 / 429 with
Retry-After, WebSocket close 1008 (bad key) and 1013 (too many connections), HTTP 403 before a
WebSocket accept (foreign Origin), and ``rate_limited`` errors for too many responses."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.server.conftest import (
    LONG,
    SHORT,
    Served,
    collect,
    make_settings,
    of_type,
    recv,
    recv_until,
    respond,
    say,
    send,
    serve,
    session,
    tiny_factory,
    ws_open,
)

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir) -> Iterator[Served]:
    settings = make_settings(api_keys=("other-key-999", KEY),
                             allowed_origins=("https://app.example",), max_connections=3,
                             max_responses_per_connection=2, max_inflight_requests=3)
    with serve(settings, tiny_factory(tiny_model_dir)) as s:
        yield s


def closed_code(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        recv(ws)
    assert info.value.rcvd is not None
    return info.value.rcvd.code


def test_http_keys(guarded):
    url = f"{guarded.http}/v1/models"
    assert httpx.get(url, headers=AUTH).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong-key-000"}, {"Authorization": KEY}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}?api_key={KEY}").status_code == 401  # query keys: WebSocket only
    assert httpx.get(f"{guarded.http}/health").status_code == 200  # open paths
    assert httpx.get(f"{guarded.http}/metrics").status_code == 200


def test_each_api_key_is_its_own_tenant(guarded):
    """Requests carry a digest of their API key as cache_salt: the suffix proposer learns each
    key's answers in that key's partition only (and the prefix cache is keyed the same way)."""
    from quickdraft.server.guard import tenant_of

    suffix = guarded.gateway.llm.engine.speculator.suffix
    if suffix is None:
        pytest.skip("no suffix trie here (gcc)")
    body = {"model": guarded.gateway.model_name,
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 8, "temperature": 0}
    for key in (KEY, "other-key-999"):
        r = httpx.post(f"{guarded.http}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
    with ws_open(guarded.ws_url, additional_headers=AUTH) as ws:
        session(ws)
        say(ws, "Hello")
        collect(ws, respond(ws, max_output_tokens=4, temperature=0))
    r = httpx.post(f"{guarded.http}/v1/chat/completions", json={**body, "cache_salt": "team-1"},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    tenants = suffix.tenants()
    assert tenant_of(KEY) in tenants and tenant_of("other-key-999") in tenants
    assert f"{tenant_of(KEY)}/team-1" in tenants  # the client's salt within its key
    assert None not in tenants and all(KEY not in str(t) for t in tenants)


def test_ws_keys_header_query_subprotocol(guarded):
    with ws_open(guarded.ws_url, additional_headers=AUTH) as ws:
        session(ws)
    with ws_open(f"{guarded.ws_url}?api_key={KEY}") as ws:
        session(ws)
    with ws_open(guarded.ws_url,
                 subprotocols=["quickdraft.v1", f"quickdraft.api-key.{KEY}"]) as ws:
        assert ws.subprotocol == "quickdraft.v1"  # the key is never echoed
        session(ws)
    for kw in ({}, {"additional_headers": {"Authorization": "Bearer nope-nope-nope"}},
               {"subprotocols": ["quickdraft.v1", "quickdraft.api-key.wrong-key-1"]}):
        with ws_open(guarded.ws_url, **kw) as ws:
            assert closed_code(ws) == 1008


def test_origins(guarded):
    for origin in ("https://app.example", "http://localhost:5173", "http://127.0.0.1:1"):
        with ws_open(guarded.ws_url, origin=origin, additional_headers=AUTH) as ws:
            session(ws)
    with pytest.raises(InvalidStatus) as info:
        ws_open(guarded.ws_url, origin="https://evil.example", additional_headers=AUTH)
    assert info.value.response.status_code == 403
    r = httpx.get(f"{guarded.http}/v1/models",
                  headers={**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.get(f"{guarded.http}/v1/models",
                  headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    same = f"http://{guarded.host}:{guarded.port}"
    assert httpx.get(f"{guarded.http}/v1/models",
                     headers={**AUTH, "Origin": same}).status_code == 200


def test_overload(guarded):
    baseline = guarded.free_blocks()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ws_open(guarded.ws_url, additional_headers=AUTH) as a, \
            ws_open(guarded.ws_url, additional_headers=AUTH) as b:
        session(a)
        session(b)
        say(a, "Talk.")
        say(b, "Talk.")
        a1, a2 = respond(a, **LONG), respond(a, **LONG)
        send(a, {"type": "response.create", "event_id": "third", "response": SHORT})
        error, _ = recv_until(a, of_type("error"))
        assert error["error"]["code"] == "rate_limited" and error["client_event_id"] == "third"
        b1 = respond(b, **LONG)  # 3 in flight: the global limit
        send(b, {"type": "response.create", "event_id": "over", "response": SHORT})
        error, _ = recv_until(b, of_type("error"))
        assert error["error"]["code"] == "rate_limited"
        r = httpx.post(f"{guarded.http}/v1/chat/completions", json=chat, headers=AUTH)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limited"
        with ws_open(guarded.ws_url, additional_headers=AUTH) as c:  # 3rd connection: ok
            session(c)
            with ws_open(guarded.ws_url, additional_headers=AUTH) as d:  # 4th: refused
                assert closed_code(d) == 1013
        for ws, rid in ((a, a1), (a, a2), (b, b1)):
            send(ws, {"type": "response.cancel", "response_id": rid})
            assert collect(ws, rid)[1]["response"]["status"] == "cancelled"
        guarded.wait_idle(baseline)
        assert httpx.post(f"{guarded.http}/v1/chat/completions", json=chat,
                          headers=AUTH).status_code == 200
