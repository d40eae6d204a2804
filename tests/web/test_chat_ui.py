"""The browser chat UI (web/, docs/web.md) in headless Chromium against a real
``quickdraft serve`` with the default model: streaming, stop, regenerate, edit, conversations
in localStorage, Markdown from real model output, sanitising, error events, the API-key prompt,
reconnecting, themes and phone width. Written to hold whatever the small model says."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.web.conftest import API_KEY, ServerProcess, free_port, open_page

pytestmark = pytest.mark.slow
expect: Any = None  # playwright.sync_api.expect, imported once the module's fixtures ran


@pytest.fixture(autouse=True)
def _expect(chromium_path: Path) -> None:
    global expect
    from playwright.sync_api import expect as pw_expect

    pw_expect.set_options(timeout=15_000)
    expect = pw_expect


ANSWER_TIMEOUT = 60_000  # ms: one short answer on a shared CPU core


# ------------------------------------------------------------------------------- helpers


def set_params(page: Any, **values: Any) -> None:
    """Fill the settings panel (temperature, max_tokens, top_p, system) and close it."""
    page.click("#toggle-settings")
    fields = {"temperature": "#p-temperature", "top_p": "#p-top-p",
              "max_tokens": "#p-max-tokens", "system": "#system-prompt"}
    for name, value in values.items():
        field = page.locator(fields[name])
        field.fill(str(value))
        field.dispatch_event("change")
    page.click("#toggle-settings")


def send(page: Any, text: str) -> Any:
    """Type ``text`` and press Enter; returns the locator of the new (last) answer."""
    count = page.locator(".msg-assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    expect(page.locator(".msg-assistant")).to_have_count(count + 1)
    return page.locator(".msg-assistant").last


def wait_done(answer: Any, status: str = "completed") -> None:
    expect(answer).to_have_attribute("data-status", status, timeout=ANSWER_TIMEOUT)


def state(page: Any) -> dict[str, Any]:
    return dict(page.evaluate("() => JSON.parse(JSON.stringify(window.quickdraft.state))"))


def wait_words(answer: Any, n: int = 3) -> None:
    """Until the streaming answer shows at least ``n`` words."""
    expect(answer.locator(".msg-body")).to_have_text(re.compile(r"(\S+\s+){" + str(n) + "}"),
                                                     timeout=ANSWER_TIMEOUT)


# ------------------------------------------------------------------------------- tests


def test_page_loads_with_server_defaults(page: Any) -> None:
    expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct")
    expect(page.locator("#conn-status")).to_contain_text("Connected")
    expect(page.locator("#banner")).to_be_hidden()
    page.click("#toggle-settings")
    expect(page.locator("#settings")).to_be_visible()
    # the controls start from session.created's defaults
    expect(page.locator("#p-temperature")).to_have_value("1")
    expect(page.locator("#p-top-p")).to_have_value("1")
    expect(page.locator("#p-max-tokens")).to_have_value("")  # "inf"
    expect(page.locator("#p-max-tokens-hint")).to_contain_text("8192")
    expect(page.locator("#p-speculation")).to_be_checked()
    # accessible names on the controls
    for selector in ("#input", "#send", "#theme-toggle", "#toggle-settings", "#new-chat",
                     "#p-temperature", "#p-top-p", "#p-max-tokens", "#p-speculation",
                     "#system-prompt"):
        name = page.locator(selector).evaluate(
            "e => e.getAttribute('aria-label') || (e.labels && e.labels[0] "
            "&& e.labels[0].textContent) || e.textContent")
        assert name and name.strip(), f"{selector} has no accessible name"


def test_streamed_answer_stats_regenerate_and_edit(page: Any) -> None:
    set_params(page, max_tokens=40)
    # record the answer's text while it streams: several growing snapshots = streamed
    page.evaluate("""() => {
        window.__snapshots = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg-assistant[data-status="streaming"] .msg-body');
            if (a && a.textContent) window.__snapshots.push(a.textContent.length);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    answer = send(page, "Hello! Who are you?")
    wait_done(answer)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#input")).to_have_value("")
    expect(page.locator(".msg-user .msg-body")).to_have_text("Hello! Who are you?")
    assert answer.locator(".msg-body").inner_text().strip()
    snapshots = page.evaluate("window.__snapshots")
    assert len(set(snapshots)) >= 2, f"the answer did not stream: {snapshots}"

    # live figures from response.done: TTFT, tokens/s, speculation, with details in a tooltip
    meta = answer.locator(".msg-meta")
    expect(meta).to_contain_text("to first token")
    expect(meta).to_contain_text("tok/s")
    expect(meta).to_contain_text(re.compile(r"speculation accepted \d+/\d+|no speculation"))
    tip = meta.locator(".tip")
    expect(tip).to_contain_text("Time to first token")
    expect(tip).to_contain_text("Speculation:")
    meta.hover()
    expect(tip).to_be_visible()

    # regenerate: the answer is replaced, not added
    first_id = answer.get_attribute("data-id")
    answer.locator(".regenerate-msg").click()
    expect(page.locator(".msg-assistant")).to_have_count(1)
    regenerated = page.locator(".msg-assistant").last
    expect(regenerated).not_to_have_attribute("data-id", first_id or "")
    wait_done(regenerated)

    # edit and resend the last user message (Enter in the editor sends it)
    page.locator(".msg-user .edit-msg").click()
    editor = page.locator(".edit-input")
    expect(editor).to_be_focused()
    editor.fill("Say hello in French.")
    editor.press("Enter")
    expect(page.locator(".msg-user")).to_have_count(1)
    expect(page.locator(".msg-user .msg-body")).to_have_text("Say hello in French.")
    wait_done(page.locator(".msg-assistant").last)
    expect(page.locator(".msg-assistant")).to_have_count(1)
    # the server's session holds exactly the edited conversation (answers are re-sent lazily)
    mirror = state(page)["mirror"]
    assert [(m["role"], m["text"]) for m in mirror] == [("user", "Say hello in French.")]


def test_stop_mid_answer_with_button_and_escape(page: Any) -> None:
    set_params(page, max_tokens=1000, temperature=0)
    answer = send(page, "Write a long, detailed story about a dragon and a knight.")
    wait_words(answer)
    expect(answer).to_have_attribute("data-status", "streaming")
    page.click("#stop")
    wait_done(answer, "cancelled")
    expect(answer.locator(".msg-status")).to_have_text("Stopped")
    expect(page.locator("#stop")).to_be_hidden()
    tokens = int(re.search(r"(\d+) tokens", answer.locator(".msg-meta").inner_text()).group(1))
    assert 0 < tokens < 1000
    assert answer.locator(".msg-body").inner_text().strip()  # the partial answer stays

    # Esc stops too (on a regenerated answer)
    answer.locator(".regenerate-msg").click()
    again = page.locator(".msg-assistant").last
    wait_words(again)
    page.keyboard.press("Escape")
    wait_done(again, "cancelled")


def test_code_block_from_real_model_output_and_screenshots(
        browser: Any, server: ServerProcess, screenshot_dir: Path) -> None:
    """Greedy decoding asked for code: the model's own fenced block is rendered as a
    highlighted code block with a working copy button. Screenshots of this page: light and
    dark, desktop and phone width."""
    context, page, errors = open_page(browser, f"{server.url}/")
    try:
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "open",
                                                               timeout=30_000)
        set_params(page, temperature=0, max_tokens=48)
        wait_done(send(page, "Hi! What can you do?"))  # a second conversation in the list
        page.click("#new-chat")
        set_params(page, max_tokens=160)
        prompts = ["Write a Python function that adds two numbers, in a markdown code block.",
                   "Show a Python hello world program in a code block."]
        for prompt in prompts:  # two tries: robust to a model that answers in prose
            answer = send(page, prompt)
            wait_done(answer)
            if answer.locator(".code-block").count():
                break
            page.click("#new-chat")
        code = answer.locator(".code-block pre code").first
        expect(code).to_have_class(re.compile(r"\bhljs\b"))
        assert code.inner_text().strip()
        assert code.locator("span[class^='hljs-']").count() > 0, "not highlighted"
        expect(answer.locator(".code-head span").first).to_have_text(re.compile(r"\w+"))

        page.mouse.move(0, 0)
        page.screenshot(path=str(screenshot_dir / "desktop-light.png"))
        page.emulate_media(color_scheme="dark")
        page.screenshot(path=str(screenshot_dir / "desktop-dark.png"))
        page.set_viewport_size({"width": 375, "height": 740})
        page.wait_for_timeout(400)  # the sidebar slides out of view
        page.screenshot(path=str(screenshot_dir / "phone-dark.png"))
        page.emulate_media(color_scheme="light")
        page.screenshot(path=str(screenshot_dir / "phone-light.png"))

        copy = answer.locator(".copy-code").first
        copy.click()
        expect(copy).to_contain_text("Copied")
        copied = page.evaluate("navigator.clipboard.readText()")
        assert copied == code.evaluate("e => e.textContent")
    finally:
        context.close()
    assert not errors


def test_conversations_switch_rename_delete_and_survive_reload(page: Any) -> None:
    set_params(page, max_tokens=12, temperature=0)
    wait_done(send(page, "First conversation: say hello."))
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    wait_done(send(page, "Second conversation: say goodbye."))
    items = page.locator("#conversation-list .conv")
    expect(items).to_have_count(2)

    # rename the current (second) conversation
    current = page.locator("#conversation-list .conv[aria-current='true']")
    current.locator(".conv-rename").click()
    name = page.locator(".conv-rename-input")
    name.fill("Renamed chat")
    name.press("Enter")
    expect(current.locator(".conv-open")).to_have_text("Renamed chat")
    expect(page.locator("#chat-title")).to_have_text("Renamed chat")

    # switch back to the first one and continue it (the server's session is re-synced)
    page.locator(".conv-open", has_text="First conversation").click()
    expect(page.locator(".msg-user .msg-body").first).to_have_text(
        "First conversation: say hello.")
    wait_done(send(page, "And now say thanks."))
    expect(page.locator(".msg-user")).to_have_count(2)
    mirror = state(page)["mirror"]
    assert [m["role"] for m in mirror] == ["user", "assistant", "user"]
    assert mirror[0]["text"] == "First conversation: say hello."

    # reload: everything survives, the current conversation included
    before = page.locator("#messages").inner_text()
    page.reload()
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
    expect(items).to_have_count(2)
    expect(page.locator(".conv-open", has_text="Renamed chat")).to_have_count(1)
    expect(page.locator(".msg-user")).to_have_count(2)
    assert page.locator("#messages").inner_text() == before
    expect(page.locator(".msg-assistant .msg-meta").first).to_contain_text("tok/s")

    # delete needs a second click (confirm); survives a reload too
    delete = page.locator(".conv", has_text="Renamed chat").locator(".conv-delete")
    delete.click()
    expect(delete).to_have_text("Delete?")
    delete.click()
    expect(items).to_have_count(1)
    page.reload()
    expect(items).to_have_count(1)
    expect(page.locator(".conv-open", has_text="Renamed chat")).to_have_count(0)


XSS = """Here is **bold** and a table:

| a | b |
|---|---|
| 1 | 2 |

A [markdown link](javascript:window.__pwned=4) and an ![image](x "t").

<script>window.__pwned = 1</script>
<img src=x onerror="window.__pwned = 2">
<a href="javascript:window.__pwned = 3">link</a>
<iframe src="javascript:window.__pwned = 5"></iframe>
<svg><animate onbegin="window.__pwned = 6" attributeName="x"/></svg>
<div id="input" style="position:fixed;inset:0;background:red">overlay</div>
<details open ontoggle="window.__pwned = 7">x</details>

```js
console.log("<script>not run</script>")
```
"""


def test_untrusted_html_in_model_output_does_not_run(page: Any) -> None:
    """Rendered through the path model answers take (window.quickdraft.addAssistantMessage
    renders like a streamed answer), then again from localStorage after a reload."""
    for attempt in range(2):
        if attempt == 0:
            page.evaluate("text => window.quickdraft.addAssistantMessage(text)", XSS)
        else:
            page.reload()
            expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
        body = page.locator(".msg-assistant .msg-body").last
        expect(body.locator("strong")).to_have_text("bold")
        expect(body.locator("table td")).to_have_count(2)
        expect(body.locator(".code-block code")).to_contain_text('console.log("<script>')
        expect(body.locator("a", has_text="markdown link")).to_have_count(1)
        for link in body.locator("a").all():
            link.click()
        page.wait_for_timeout(300)
        assert page.evaluate("window.__pwned") is None
        found = page.evaluate("""() => {
            const root = document.getElementById('messages');
            const attrs = [...root.querySelectorAll('*')].flatMap(
                e => [...e.attributes].map(a => a.name + '=' + a.value));
            return {
                scripts: root.querySelectorAll(
                    '.msg-body :is(script, iframe, object, embed, svg:not(button svg))').length,
                handlers: attrs.filter(a => a.startsWith('on')),
                js: attrs.filter(a => /javascript:/i.test(a)),
                styles: attrs.filter(a => a.startsWith('style=')),
                input: document.getElementById('input').tagName,
            };
        }""")
        assert found == {"scripts": 0, "handlers": [], "js": [], "styles": [],
                         "input": "TEXTAREA"}, found
    # the sanitiser itself (not only the page's CSP) removed it all: the rendered HTML
    clean = page.evaluate("""t => {
        const box = document.createElement('div');
        window.quickdraft.renderMarkdown(t, box);
        return box.innerHTML;
    }""", XSS)
    assert "&lt;script&gt;not run" in clean  # code stays visible as text
    for bad in ("<script", "onerror", "javascript:", "<iframe", "onbegin", "ontoggle",
                "style="):
        assert bad not in clean, bad


def test_server_error_event_is_shown(page: Any) -> None:
    set_params(page, max_tokens=100000)  # more than the context: context_length_exceeded
    answer = send(page, "Hi")
    wait_done(answer, "failed")
    expect(answer.locator(".msg-error")).to_contain_text("context length")
    expect(answer.locator(".msg-error")).to_contain_text("context_length_exceeded")
    expect(page.locator("#send")).to_be_visible()
    # reset to the server's defaults: the max-tokens field is empty ("inf") again
    page.click("#toggle-settings")
    page.click("#reset-params")
    expect(page.locator("#p-max-tokens")).to_have_value("")


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
    assert json.dumps(mirror).count("dragon") == 1
