"""The browser chat UI (web/, docs/web.md) in headless Chromium against a real
``quickdraft serve``, its own server for this module: the keyboard, themes and phone width,
the API-key prompt (a server started with ``--api-key``), and reconnecting after the server
is killed mid-answer and started again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.chat_ui_actions import (
    expect,
    playwright_expect,  # noqa: F401 (autouse: Playwright's expect timeout)
    send,
    set_params,
    state,
    wait_done,
    wait_words,
)
from tests.web.conftest import API_KEY, ServerProcess, free_port, open_page

pytestmark = pytest.mark.slow


def test_keyboard_theme_and_phone_width(page: Any) -> None:
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("line two")
    expect(page.locator("#input")).to_have_value("line one\nline two")
    expect(page.locator(".msg")).to_have_count(0)  # Shift+Enter did not send

    html = page.locator("html")
    toggle = page.locator("#theme-toggle")
    expect(toggle).to_have_attribute("aria-label", "Switch to dark theme")
    toggle.click()
    expect(html).to_have_attribute("data-theme", "dark")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background != "rgb(255, 255, 255)"
    page.reload()
    expect(html).to_have_attribute("data-theme", "dark")  # kept in localStorage
    expect(toggle).to_have_attribute("aria-label", "Switch to light theme")
    toggle.click()
    expect(html).to_have_attribute("data-theme", "light")

    page.set_viewport_size({"width": 375, "height": 740})
    sidebar_toggle = page.locator("#toggle-sidebar")
    expect(sidebar_toggle).to_be_visible()
    expect(page.locator("#new-chat")).not_to_be_in_viewport()
    sidebar_toggle.click()
    expect(sidebar_toggle).to_have_attribute("aria-expanded", "true")
    expect(page.locator("#new-chat")).to_be_in_viewport()
    page.keyboard.press("Escape")
    expect(sidebar_toggle).to_have_attribute("aria-expanded", "false")
    overflow = page.evaluate("document.documentElement.scrollWidth")
    assert overflow <= 375, f"horizontal scrolling at phone width ({overflow}px)"
    expect(page.locator("#input")).to_be_in_viewport()
    expect(page.locator("#send")).to_be_in_viewport()


@pytest.fixture(scope="module")
def keyed_server(chromium_path: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    proc = ServerProcess(free_port(), tmp_path_factory.mktemp("web-keyed"),
                         "--api-key", API_KEY)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def test_api_key_prompt(browser: Any, keyed_server: ServerProcess) -> None:
    # the page itself needs no key; the API does
    assert httpx.get(f"{keyed_server.url}/").status_code == 200
    assert httpx.get(f"{keyed_server.url}/static/app.js").status_code == 200
    assert httpx.get(f"{keyed_server.url}/v1/models").status_code == 401
    context, page, errors = open_page(browser, f"{keyed_server.url}/?reconnect_max_ms=1000")
    try:
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()  # /v1/ws closed with 1008
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "auth")
        page.fill("#api-key-input", "short")
        page.click("#key-submit")
        expect(page.locator("#key-dialog-error")).to_contain_text("at least 8")
        page.fill("#api-key-input", "wrong-key-123456")
        page.click("#key-submit")
        expect(page.locator("#key-dialog-text")).to_contain_text("refused")
        expect(dialog).to_be_visible()
        page.fill("#api-key-input", API_KEY)
        page.press("#api-key-input", "Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
        assert page.evaluate("localStorage.getItem('quickdraft.apiKey')") == API_KEY
        set_params(page, max_tokens=8)
        wait_done(send(page, "Hi"))
        page.reload()  # the stored key is offered again
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
        expect(dialog).to_be_hidden()
    finally:
        context.close()
    assert not errors


def test_reconnect_banner_when_the_server_restarts(page: Any, server: ServerProcess) -> None:
    """Kill the server mid-answer (SIGKILL: no close frame), see the banner and the answer
    marked interrupted, start it again on the same port, see the page recover and chat on."""
    set_params(page, max_tokens=1000, temperature=0)
    answer = send(page, "Write a long, detailed story about a dragon and a knight.")
    wait_words(answer)
    server.kill()
    banner = page.locator("#banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("Reconnecting")
    expect(page.locator("#conn-status")).not_to_have_attribute("data-state", "open")
    wait_done(answer, "interrupted")
    expect(answer.locator(".msg-error")).to_contain_text("cut off")
    expect(page.locator("#send")).to_be_disabled()

    server.start()  # same port; ~10 s to load the model (the page retries meanwhile)
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open",
                                                           timeout=60_000)
    expect(banner).to_be_hidden()
    set_params(page, max_tokens=8)
    wait_done(send(page, "Are you back?"))
    mirror = state(page)["mirror"]  # the new session got the whole conversation
    assert [m["role"] for m in mirror] == ["user", "assistant", "user"]
    # the first question once (not replayed twice); the cut-off answer may say "dragon" too,
    # depending on how many words it had before the kill
    assert json.dumps(mirror).count("a long, detailed story about a dragon") == 1
