"""Fixtures for the browser tests: a real ``quickdraft serve`` (a subprocess on a free port,
default model) and Debian's Chromium driven by Playwright (Python, sync API).

Needs ``apt-get install -y chromium`` and ``pip install playwright`` (the ``test`` extra); the
browser tests skip with the reason when either is missing. Screenshots go to
``$QUICKDRAFT_SCREENSHOT_DIR`` if set, else to a pytest temporary directory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("QUICKDRAFT_CHROMIUM", "/usr/bin/chromium"))
START_TIMEOUT = 180.0  # the first start converts the embedded model (20-50 s); later ~10 s
API_KEY = "web-test-key-0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m quickdraft serve`` on 127.0.0.1:port with the default model; restartable on
    the same port (the reconnect test kills it and starts it again)."""

    def __init__(self, port: int, workdir: Path, *extra: str) -> None:
        self.port = port
        self.workdir = workdir
        self.extra = extra
        self.log_path = workdir / f"server-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quickdraft", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning",
             "--batch-db", str(self.workdir / f"batches-{self.port}.sqlite3"), *self.extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"quickdraft serve exited {self.proc.returncode}:\n"
                                     + self.log_tail())
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("quickdraft serve never became healthy:\n" + self.log_tail())

    def kill(self) -> None:
        """SIGKILL: a crash, no drain, no close frame (browsers see 1006)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: the browser tests need Debian's Chromium "
                    "(apt-get install -y chromium)")
    pytest.importorskip("playwright", reason="the browser tests need `pip install playwright`")
    return CHROMIUM


@pytest.fixture(scope="session")
def browser(chromium_path: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(chromium_path), headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server(chromium_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """One real server (default model, no API key) for a test module."""
    proc = ServerProcess(free_port(), tmp_path_factory.mktemp("web-server"))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = os.environ.get("QUICKDRAFT_SCREENSHOT_DIR")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_page(browser: Any, url: str, *, width: int = 1280, height: int = 800,
              color_scheme: str = "light") -> tuple[Any, Any, list[str]]:
    """A fresh browser context (empty localStorage) on ``url``; returns (context, page, errors)
    where errors collects uncaught page exceptions."""
    context = browser.new_context(viewport={"width": width, "height": height},
                                  color_scheme=color_scheme)
    parts = urlsplit(url)
    context.grant_permissions(["clipboard-read", "clipboard-write"],
                              origin=f"{parts.scheme}://{parts.netloc}")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    return context, page, errors


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    """The chat page on the module's server, connected; fails on any uncaught JS exception."""
    from playwright.sync_api import expect

    context, pg, errors = open_page(browser, f"{server.url}/?reconnect_max_ms=1000")
    expect(pg.locator("#conn-status")).to_have_attribute("data-state", "open", timeout=30_000)
    try:
        yield pg
    finally:
        context.close()
    assert not errors, f"uncaught exceptions in the page: {errors}"
