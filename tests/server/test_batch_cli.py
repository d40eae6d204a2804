"""``quickdraft batch`` as a user sees it: a light start (no torch for the module or for
``--url``), progress as plain lines without carriage returns when stderr is not a terminal
(against a server and in local mode), none with ``--quiet``, a tqdm bar on a terminal whose
rate is counted from when the batch started running."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quickdraft.server.batch_cli import Progress
from tests.server.conftest import Served, make_settings, serve, tiny_factory
from tests.server.test_batch_api import chat_line, jsonl
from tests.server.test_cli import quickdraft_cmd

N_LINES = 6
LINE = re.compile(r"batch batch_\w+: (\d+)/(\d+) done, (\d+) failed, [\d.]+ req/s")
HEAVY = ("torch", "transformers", "quickdraft.engine.async_engine",
         "quickdraft.engine.llm_engine")


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([*quickdraft_cmd(), "batch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def batch_obj(done: int, total: int = 40, failed: int = 0, started: float | None = None,
              status: str = "in_progress") -> dict[str, Any]:
    return {"id": "batch_x", "status": status, "in_progress_at": started,
            "request_counts": {"total": total, "completed": done - failed, "failed": failed}}


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---------------------------------------------------------------------- start-up


def test_module_imports_neither_torch_nor_the_engine():
    code = ("import sys, quickdraft.server.batch_cli\n"
            "print([m for m in sys.modules if m == 'torch' or m.startswith('quickdraft.engine')"
            " or m == 'transformers'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_url_mode_imports_no_torch(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(jsonl(chat_line("a", "hi")))
    code = ("import sys, runpy; sys.argv = ['quickdraft', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('quickdraft', run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code, file=sys.stderr)\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, "batch", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)
    assert "EXIT 1" in done.stderr, done.stderr
    assert "HEAVY []" in done.stderr, done.stderr


# ---------------------------------------------------------------------- the progress display


def test_plain_lines_every_tenth_and_every_few_seconds():
    out, clock = io.StringIO(), Clock(1000.0)
    p = Progress(False, out, every=10.0, clock=clock)
    p.update(batch_obj(0, total=0, status="validating"))  # no total yet: nothing
    clock.now = 1002.0
    p.update(batch_obj(0, started=1000))  # the first line as soon as the total is known
    clock.now = 1004.0
    p.update(batch_obj(3, started=1000))  # under 10 %, under 10 s: quiet
    clock.now = 1005.0
    p.update(batch_obj(4, started=1000))  # 10 %
    clock.now = 1016.0
    p.update(batch_obj(5, started=1000))  # 10 s since the last line
    clock.now = 1020.0
    p.update(batch_obj(40, failed=2, started=1000, status="completed"))
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    assert text.splitlines() == [
        "batch batch_x: 0/40 done, 0 failed, 0.0 req/s",
        "batch batch_x: 4/40 done, 0 failed, 0.8 req/s",
        "batch batch_x: 5/40 done, 0 failed, 0.3 req/s",
        "batch batch_x: 40/40 done, 2 failed, 2.0 req/s",  # 40 in the 20 s since it started
    ]


def test_rate_counts_from_the_start_never_before_this_run_and_resumed_counts_only_new():
    clock = Clock(500.0)
    p = Progress(False, io.StringIO(), clock=clock)
    clock.now = 510.0
    p.update(batch_obj(10, started=490))  # a stamp before this run: counted from 500
    assert p.rate(10, 510.0) == 1.0
    resumed = Progress(False, io.StringIO(), resumed=True, clock=clock)
    resumed.update(batch_obj(30, started=100))  # 30 done by an earlier run
    clock.now = 515.0
    assert resumed.rate(35, clock.now) == 1.0


def test_quiet_prints_nothing():
    out = io.StringIO()
    p = Progress(True, Terminal(), clock=Clock(0.0))
    q = Progress(True, out, clock=Clock(0.0))
    for progress in (p, q):
        progress.say("loading model")
        progress.update(batch_obj(20, started=0))
        progress.close()
    assert out.getvalue() == ""


def test_terminal_bar_shows_the_real_rate():
    term, now = Terminal(), time.time()
    p = Progress(False, term, clock=lambda: now - 10)  # this run began 10 s ago
    p.update(batch_obj(20, failed=1, started=now - 10))
    p.close()
    text = term.getvalue()
    assert "\r" in text and "20/40" in text and "failed=1" in text
    rate = float(re.findall(r"([\d.]+)req/s", text)[-1])
    assert 1.5 < rate <= 2.0, text  # 20 requests in ~10 s, not 20 in the bar's own lifetime


# ---------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def cserved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    db = tmp_path_factory.mktemp("batch-cli") / "batches.sqlite3"
    with serve(make_settings(batch_db_path=str(db), batch_max_in_flight=2),
               tiny_factory(tiny_model_dir, num_kv_blocks=1024)) as s:
        yield s


def input_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(*[chat_line(f"c{i}", f"Say {i}.", max_tokens=6)
                             for i in range(N_LINES)]))
    return path


def progress_lines(stderr: str) -> list[tuple[int, int, int]]:
    return [(int(m[1]), int(m[2]), int(m[3])) for m in map(LINE.fullmatch, stderr.splitlines())
            if m]


def test_url_mode_without_a_terminal_prints_plain_lines(cserved, tmp_path):
    src = input_file(tmp_path)
    done = run_cli(str(src), "-o", str(tmp_path / "out.jsonl"), "--url", cserved.http,
                   "--poll-interval", "0.05")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    lines = progress_lines(done.stderr)
    assert lines and lines[-1] == (N_LINES, N_LINES, 0), done.stderr
    assert f"completed: {N_LINES} answered, 0 failed" in done.stderr

    quiet = run_cli(str(src), "-o", str(tmp_path / "quiet.jsonl"), "--url", cserved.http,
                    "--poll-interval", "0.05", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert progress_lines(quiet.stderr) == [] and "\r" not in quiet.stderr
    assert quiet.stderr.strip().splitlines() == [
        line for line in quiet.stderr.strip().splitlines() if line.startswith("quickdraft: ")]


def test_local_mode_says_it_loads_the_model_then_prints_plain_lines(tiny_model_dir, tmp_path):
    src = input_file(tmp_path)
    done = run_cli(str(src), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_model_dir),
                   "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "0.05",
                   "--poll-interval", "0.05")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("quickdraft: loading model"), done.stderr
    assert progress_lines(done.stderr)[-1] == (N_LINES, N_LINES, 0), done.stderr
