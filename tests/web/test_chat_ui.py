"""The browser chat UI (web/, docs/web.md) in headless Chromium against a real
``quickdraft serve`` with the default model: streaming, stop, regenerate, edit, conversations
in localStorage, Markdown from real model output, sanitising, error events (the keyboard,
themes, phone width, the API-key prompt and reconnecting: test_chat_ui_connection_and_layout.py).
Written to hold whatever the small model says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
from tests.web.conftest import ServerProcess, open_page

pytestmark = pytest.mark.slow


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
