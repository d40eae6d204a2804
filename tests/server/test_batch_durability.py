"""Durability: a ``quickdraft serve`` process is SIGKILLed while a batch runs, restarted on the
same database, and finishes the job: exactly one result per custom_id, lines answered before
the crash kept as they were, greedy outputs equal to those of a run without a crash (the
``quickdraft batch`` CLI in local mode). Then the CLI against the server (``--url``)."""

from __future__ import annotations

import os
import queue
import re
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.server.test_cli import quickdraft_cmd

CHAT = "/v1/chat/completions"
N_LINES = 40
ENGINE_ARGS = ("--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "0.05")


def request_lines() -> bytes:
    lines = [orjson.dumps({"custom_id": f"req-{i:02d}", "method": "POST", "url": CHAT, "body": {
        "messages": [{"role": "user", "content": f"Write item {i} of the list, please."}],
        "max_tokens": 120 + 3 * i, "temperature": 0, "ignore_eos": True}})
        for i in range(N_LINES)]
    lines.insert(7, b'{"custom_id": "broken", ')  # one bad line, in both runs
    return b"\n".join(lines) + b"\n"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([*quickdraft_cmd(), "batch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class Server:
    """``quickdraft serve`` in a subprocess; its URL is read from stdout."""

    def __init__(self, model: Path, db: Path) -> None:
        env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
        self.proc = subprocess.Popen(
            [*quickdraft_cmd(), "serve", "--model", str(model), *ENGINE_ARGS, "--port", "0",
             "--batch-db", str(db), "--log-level", "warning"],
            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "the server exited"
                continue
            if match := re.search(r"serving \S+ at (http://\S+)", line):
                return match.group(1)
        raise AssertionError("the server never said it was serving")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def results(data: bytes) -> dict[str, Any]:
    return {o["custom_id"]: o for o in map(orjson.loads, data.splitlines())}


def text_of(line: dict[str, Any]) -> str:
    return str(line["response"]["body"]["choices"][0]["message"]["content"])


def test_sigkill_mid_batch_then_restart_finishes_exactly_once(tiny_model_dir, tmp_path):
    data = request_lines()
    (tmp_path / "in.jsonl").write_bytes(data)
    db = tmp_path / "batches.sqlite3"

    first = Server(tiny_model_dir, db)
    try:
        base = first.url()
        with httpx.Client(base_url=base, timeout=30) as http:
            file_id = http.post("/v1/files", data={"purpose": "batch"},
                                files={"file": ("in.jsonl", data)}).json()["id"]
            batch_id = http.post("/v1/batches", json={
                "input_file_id": file_id, "endpoint": CHAT,
                "completion_window": "24h"}).json()["id"]
            deadline = time.monotonic() + 60
            while True:
                counts = http.get(f"/v1/batches/{batch_id}").json()["request_counts"]
                if 0 < counts["completed"] < N_LINES:
                    break
                assert counts["completed"] < N_LINES, "finished before the kill"
                assert time.monotonic() < deadline, counts
                time.sleep(0.01)
        first.kill()  # no drain, no shutdown hook: the database is all that survives
    finally:
        first.kill()

    with sqlite3.connect(db) as conn:  # what the crashed run had answered
        before = {cid: orjson.loads(result) for cid, result in conn.execute(
            "SELECT custom_id, result FROM lines WHERE batch_id = ? AND status = 'done'",
            (batch_id,))}
    assert 0 < len(before) < N_LINES

    second = Server(tiny_model_dir, db)
    try:
        base = second.url()
        with httpx.Client(base_url=base, timeout=30) as http:
            deadline = time.monotonic() + 90
            while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] \
                    != "completed":
                assert time.monotonic() < deadline, batch
                time.sleep(0.05)
            assert batch["request_counts"] == {"total": N_LINES + 1, "completed": N_LINES,
                                               "failed": 1}
            raw = http.get(f"/v1/files/{batch['output_file_id']}/content").content
            errors = http.get(f"/v1/files/{batch['error_file_id']}/content").content

            # The CLI against the running server (upload, create, poll, download).
            small = tmp_path / "small.jsonl"
            small.write_bytes(b"".join(data.splitlines(keepends=True)[:3]))
            remote = run_cli(str(small), "-o", str(tmp_path / "remote.jsonl"), "--url", base,
                             "--quiet")
            assert remote.returncode == 0, remote.stderr
            assert "completed: 3 answered, 0 failed" in remote.stderr
            remote_out = results((tmp_path / "remote.jsonl").read_bytes())
            assert list(remote_out) == ["req-00", "req-01", "req-02"]
    finally:
        second.kill()

    out_lines = raw.splitlines()
    got = results(raw)
    assert len(out_lines) == len(got) == N_LINES  # exactly one result per custom_id
    assert list(got) == [f"req-{i:02d}" for i in range(N_LINES)]  # in input order
    for cid, line in before.items():  # answered before the crash: kept, not run again
        assert got[cid]["id"] == line["id"]
    [error] = errors.splitlines()
    assert orjson.loads(error)["error"]["code"] == "invalid_json"

    # The same file without a crash: the CLI in local mode (same store and worker code).
    proc = run_cli(str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "ref.jsonl"), "--errors",
                   str(tmp_path / "ref-errors.jsonl"), "--model", str(tiny_model_dir),
                   *ENGINE_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert f"completed: {N_LINES} answered, 1 failed" in proc.stderr
    assert f"{N_LINES + 1}/{N_LINES + 1}" in proc.stderr  # the progress bar
    ref = results((tmp_path / "ref.jsonl").read_bytes())
    assert list(ref) == list(got)
    assert {cid: text_of(x) for cid, x in got.items()} == \
        {cid: text_of(x) for cid, x in ref.items()}  # greedy: crash or not, the same answers
    assert [orjson.loads(x)["error"]["code"] for x in
            (tmp_path / "ref-errors.jsonl").read_bytes().splitlines()] == ["invalid_json"]
    assert {cid: text_of(x) for cid, x in remote_out.items()} == \
        {cid: text_of(ref[cid]) for cid in remote_out}
