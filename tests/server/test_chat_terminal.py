"""``quickdraft chat`` in a pseudo-terminal: readline editing (Left arrow, insert) and history
(Up arrow, the history file), the slash commands, ``--url`` against a server on the tiny
model (an exchange, Ctrl-C taking a turn back out), and a server that is down."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import make_settings, serve, tiny_factory

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[2]
STATS = re.compile(r"\[(\d+) tokens, TTFT \d+ ms, [\d.]+ tok/s[^\]]*\]")
LEFT, UP = "\x1b[D", "\x1b[A"
SAMPLING = ["--temperature", "0", "--max-tokens", "8"]
Spawn = Callable[..., Any]


def chat_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This checkout's quickdraft, a dumb terminal, the history file under ``tmp_path``."""
    env = {**os.environ, "TERM": "dumb", "PYTHONIOENCODING": "utf-8",
           "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    env.pop("NO_COLOR", None)
    return {**env, **extra}


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``python -m quickdraft chat ARGS`` in a pseudo-terminal (cwd: ``tmp_path``); wait
    for its first prompt."""
    children: list[Any] = []

    def start(*args: str, **env: str) -> Any:
        child = pexpect.spawn(sys.executable, ["-m", "quickdraft", "chat", *args],
                              cwd=str(tmp_path), env=chat_env(tmp_path, **env),
                              encoding="utf-8", timeout=60, dimensions=(50, 200))
        children.append(child)
        child.expect(r"ready: \S+")
        child.expect_exact("> ")
        return child
    yield start
    for child in children:
        if child.isalive():
            child.terminate(force=True)


def local_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "0.05",
            *SAMPLING, *extra]


def ask(child: Any, keys: str) -> str:
    """Type ``keys`` and Enter; wait for the stats line and the next prompt; the output."""
    child.send(keys + "\r")
    child.expect(STATS)
    out: str = child.before + child.after
    child.expect_exact("> ")
    return out


def command(child: Any, line: str) -> str:
    """Run a slash command; what it printed before the next prompt."""
    child.sendline(line)
    child.expect_exact("> ")
    out: str = child.before
    return out


def save(child: Any, path: Path) -> list[dict[str, str]]:
    assert f"to {path}]" in command(child, f"/save {path}")
    messages: list[dict[str, str]] = json.loads(path.read_text(encoding="utf-8"))
    return messages


def quit_with(child: Any, line: str) -> None:
    child.sendline(line)
    child.expect_exact("[bye]")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


def user_lines(messages: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_line_editing_and_history(spawn, tiny_model_dir, tmp_path):
    child = spawn(*local_args(tiny_model_dir))
    # "wrld", three times Left (the cursor after "w"), then "o": the line sent is "world".
    out = ask(child, "wrld" + LEFT * 3 + "o")
    assert "\x1b[2m" in out  # the stats line is dim on a terminal
    ask(child, UP + "!")  # Up recalls "world"; "!" is appended to it
    assert user_lines(save(child, tmp_path / "c.json")) == ["world", "world!"]
    quit_with(child, "/quit")
    history = (tmp_path / "state" / "quickdraft" / "chat_history").read_text().splitlines()
    assert history[:2] == ["world", "world!"] and history[-1] == "/quit"


def test_slash_commands(spawn, tiny_model_dir, tmp_path):
    child = spawn(*local_args(tiny_model_dir), NO_COLOR="1")
    listing = command(child, "/help")
    for name in ("/help", "/system TEXT", "/reset", "/save [PATH]", "/quit", "/exit", "//text"):
        assert name in listing
    refused = command(child, "/frobnicate now")
    assert "unknown command /frobnicate — /help lists the commands" in refused
    assert "tokens, TTFT" not in refused  # nothing was sent to the model
    assert "[system prompt set; conversation cleared]" in command(child, "/system Be brief.")
    assert "\x1b[" not in ask(child, "//etc")  # "/etc" is sent; NO_COLOR: no colours

    printed = command(child, "/save")  # the default path: chat-YYYYmmdd-HHMMSS.json in the cwd
    match = re.search(r"\[saved 3 messages to (\S+chat-\d{8}-\d{6}\.json)\]", printed)
    assert match, printed
    messages = json.loads(Path(match.group(1)).read_text(encoding="utf-8"))
    assert Path(match.group(1)).parent == tmp_path
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "/etc"

    assert "[conversation cleared]" in command(child, "/reset")
    assert save(child, tmp_path / "after-reset.json") == [
        {"role": "system", "content": "Be brief."}]
    assert "[system prompt removed; conversation cleared]" in command(child, "/system")
    assert save(child, tmp_path / "empty.json") == []
    assert "error: cannot write" in command(child, f"/save {tmp_path / 'no' / 'such.json'}")
    quit_with(child, "/exit")


def test_url_chats_with_a_server(spawn, tiny_model_dir, tmp_path):
    with serve(make_settings(), tiny_factory(tiny_model_dir)) as served:
        # The tiny model never stops by itself: 1000 tokens leave time for a Ctrl-C.
        child = spawn("--url", served.http, "--temperature", "0", "--max-tokens", "1000")
        assert "[system prompt set" in command(child, "/system Be brief.")
        out = ask(child, "Hello!")
        assert int(STATS.search(out).group(1)) == 1000  # type: ignore[union-attr]

        child.send("Tell me a long story.\r")
        child.expect_exact("story.\r\n")
        child.expect(r"\S")  # the answer is streaming
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact("> ")

        messages = save(child, tmp_path / "remote.json")  # the stopped turn is not in it
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "Hello!"
        assert messages[2]["content"]
        quit_with(child, "/quit")


def test_url_with_no_server_fails_fast(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "quickdraft", "chat", "--url",
                           f"ws://127.0.0.1:{port}"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=chat_env(tmp_path),
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 10
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("quickdraft: error: cannot connect to ws://127.0.0.1:")
