"""The chat UI's routes without a browser or a model: ``/`` and ``/static/*`` are served
without an API key (the API still needs one), with a strict CSP, and every module the page
imports exists locally (no CDN)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from quickdraft.server.app import create_app
from quickdraft.server.settings import ServerSettings

WEB = Path(__file__).resolve().parents[2] / "web"
KEY = "static-test-key-1"


def _no_engine() -> object:
    raise AssertionError("these tests never start the engine")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = ServerSettings(api_keys=(KEY,), batch_db_path=str(tmp_path / "b.sqlite3"))
    # no `with`: the lifespan (engine loading) never runs
    yield TestClient(create_app(settings, _no_engine))  # type: ignore[arg-type]


def test_page_is_served_without_a_key_and_the_api_still_needs_one(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="static/app.js">' in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "object-src 'none'" in csp
    assert "ws://testserver" in csp
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/app.css").headers["content-type"].startswith("text/css")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code \
        != 401
    with pytest.raises(WebSocketDisconnect) as closed, \
            client.websocket_connect("/v1/ws", subprotocols=["quickdraft.v1"]) as ws:
        ws.receive_json()
    assert closed.value.code == 1008


def test_no_path_escapes_the_web_directory(client: TestClient) -> None:
    assert client.get("/static/../server/app.py").status_code == 404
    assert client.get("/static/%2e%2e/server/app.py").status_code == 404
    assert client.get("/static/nope.js").status_code == 404


def test_every_import_and_asset_is_local(client: TestClient) -> None:
    """Follow the page's module graph: each import resolves to a served file (catches a broken
    vendored path without a browser); nothing points at another host."""
    seen: set[str] = set()
    todo = ["app.js"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        response = client.get(f"/static/{name}")
        assert response.status_code == 200, name
        if name.startswith("vendor/"):
            continue
        for spec in re.findall(r'^import .*? from "(.+?)";', response.text, re.M):
            assert spec.startswith("./"), f"{name} imports {spec}: not a local module"
            todo.append(str(Path(Path(name).parent, spec[2:])))
    assert {"vendor/marked.esm.js", "vendor/purify.es.js", "vendor/highlight.min.js"} <= seen
    html = (WEB / "index.html").read_text()
    for ref in re.findall(r'(?:src|href)="([^"#]+)"', html):
        assert not re.match(r"(https?:)?//", ref), f"index.html loads {ref} from another host"
        assert client.get(f"/{ref}").status_code == 200, ref
    for lib in ("marked", "dompurify", "highlight.js"):
        assert (WEB / "vendor" / f"{lib}.LICENSE").is_file(), lib
