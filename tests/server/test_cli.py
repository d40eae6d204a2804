"""The ``quickdraft`` console script: ``generate`` on the real default model (greedy output equals
the engine's), ``chat`` driven through a pseudo-terminal (streaming, stats line, Ctrl-C stops an
answer and the chat goes on, ``/exit``), and clean exit status 2 on bad input."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

STATS = re.compile(r"\[(\d+) tokens, TTFT \d+ ms, [\d.]+ tok/s(?:, speculation [^\]]*)?\]")


def quickdraft_cmd() -> list[str]:
    """The console script of this interpreter's environment (the module as a fallback)."""
    script = Path(sys.executable).parent / "quickdraft"
    if script.exists():
        return [str(script)]
    found = shutil.which("quickdraft")
    return [found] if found else [sys.executable, "-m", "quickdraft"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([*quickdraft_cmd(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# ---------------------------------------------------------------------- generate


@pytest.mark.slow
def test_generate_greedy_matches_engine(default_model_dir):
    prompt = "Name three colors."
    # --weights pinned: "auto" times a decode step, and a busy machine may then pick the
    # other format (different rounding) in one process than in the other
    proc = run_cli("generate", prompt, "--temperature", "0", "--max-tokens", "20", "--quiet",
                   "--model", str(default_model_dir), "--weights", "int4")
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout
    assert answer.strip(), proc.stderr
    match = STATS.search(proc.stderr)  # the stats line goes to stderr, never into the answer
    assert match and 0 < int(match.group(1)) <= 20, proc.stderr
    assert "tokens, TTFT" not in answer
    assert "\x1b[" not in proc.stderr + answer  # no ANSI colours into a pipe

    # The same request on the engine directly, with the CLI's default engine settings.
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), weights="int4"), progress=False)
    ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
    [ref] = engine.generate([ids], SamplingParams(max_tokens=20, temperature=0.0))
    assert answer == ref.text
    assert int(match.group(1)) == len(ref.token_ids)


def test_generate_missing_model_exits_2():
    proc = run_cli("generate", "hi", "--model", "/nonexistent", timeout=120)
    assert proc.returncode == 2
    assert "/nonexistent" in proc.stderr and "does not exist" in proc.stderr
    assert proc.stderr.startswith("quickdraft: error:")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_generate_invalid_sampling_param_exits_2(tiny_model_dir):
    proc = run_cli("generate", "hi", "--model", str(tiny_model_dir), "--temperature", "-1",
                   "--kv-cache-memory", "0.01", "--quiet", timeout=120)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- chat


@pytest.fixture
def chat(tiny_model_dir):
    pexpect = pytest.importorskip("pexpect")
    cmd, *args = quickdraft_cmd()
    # The tiny random model never emits EOS, so every answer runs to --max-tokens: long
    # enough (seconds) that Ctrl-C surely lands mid-answer, short enough for a quick test.
    args += ["chat", "--model", str(tiny_model_dir), "--dtype", "float32",
             "--temperature", "0", "--max-tokens", "1000", "--kv-cache-memory", "0.05"]
    child = pexpect.spawn(cmd, args, encoding="utf-8", timeout=60, dimensions=(50, 200),
                          env={**os.environ, "TERM": "dumb", "PYTHONIOENCODING": "utf-8"})
    yield child
    if child.isalive():
        child.terminate(force=True)


def read_answer(child, message: str) -> tuple[str, int, bool]:
    """Send a message, wait for its stats line; return (answer, tokens, streamed)."""
    child.expect_exact("> ")
    child.sendline(message)
    child.expect_exact(message + "\r\n")  # the echo of what we typed
    child.expect(r"\S")  # the first visible piece of the answer
    first = child.after
    # Streamed: the first piece arrived while the stats line was still far off.
    streamed = "tokens, TTFT" not in child.buffer
    child.expect(STATS)
    answer = first + child.before
    return answer, int(child.match.group(1)), streamed


def test_chat_stream_interrupt_and_exit(chat):
    pexpect = pytest.importorskip("pexpect")
    start = time.monotonic()
    chat.expect("Ctrl-C stops an answer")  # the banner: the engine is loaded

    answer, n_tokens, streamed = read_answer(chat, "Hello!")
    assert n_tokens == 1000 and streamed
    assert answer.strip() and "[stopped]" not in answer

    chat.expect_exact("> ")
    chat.sendline("/reset")

    # A long answer, interrupted as soon as it starts showing.
    chat.expect_exact("> ")
    chat.sendline("Tell me a very long story about dragons.")
    chat.expect_exact("dragons.\r\n")
    chat.expect(r"\S")
    chat.sendintr()
    chat.expect_exact("[stopped]")
    assert "tokens, TTFT" not in chat.before  # it was stopped, not finished

    # The chat goes on: the next message is answered in full.
    answer, n_tokens, _ = read_answer(chat, "What is two plus two?")
    assert n_tokens == 1000 and answer.strip()

    chat.expect_exact("> ")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0 and chat.signalstatus is None
    assert time.monotonic() - start < 120
