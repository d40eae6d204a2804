"""What the browser chat UI's tests do on the page (fill the settings, send a message, wait
for an answer or its first words, read the page's state), and Playwright's ``expect`` with the
timeout they share. Playwright is imported only once a test runs (its fixtures skip the tests
where Chromium is missing)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def playwright_expect(chromium_path: Path) -> None:
    """Every assertion waits up to 15 s (imported by each browser test module: autouse)."""
    from playwright.sync_api import expect as pw_expect

    pw_expect.set_options(timeout=15_000)


def expect(actual: Any, message: str | None = None) -> Any:
    """playwright.sync_api.expect, imported when first asserted."""
    from playwright.sync_api import expect as pw_expect

    return pw_expect(actual, message)


ANSWER_TIMEOUT = 60_000  # ms: one short answer on a shared CPU core


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
