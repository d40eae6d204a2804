"""Start-up and shutdown: the socket serves /health (503) while the model loads, 200 once it
serves; a failed load is reported; SIGTERM drains (a subprocess ``quickdraft serve``: the stream
in flight completes, new work is refused, then the socket closes with 1012 and the process exits
0); past the drain timeout, answers are cancelled before the close."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
import torch
from websockets.exceptions import ConnectionClosed

from tests.server.conftest import (
    LONG,
    TIMEOUT,
    collect,
    make_settings,
    of_type,
    recv,
    recv_until,
    respond,
    say,
    send,
    serve,
    session,
    tiny_factory,
    ws_open,
)
from tests.server.test_cli import quickdraft_cmd

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def closed_code(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            recv(ws)
    assert info.value.rcvd is not None
    return info.value.rcvd.code


def test_health_503_while_loading_then_200(tiny_model_dir):
    gate = threading.Event()
    build = tiny_factory(tiny_model_dir)

    def slow_factory():
        assert gate.wait(TIMEOUT)
        return build()

    with serve(make_settings(), slow_factory, wait_ready=False) as s:
        r = httpx.get(f"{s.http}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(f"{s.http}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert "retry-after" in r.headers
        with ws_open(s.ws_url) as ws:
            assert closed_code(ws) == 1013
        assert httpx.get(f"{s.http}/metrics").status_code == 200  # zeros, not an error
        gate.set()
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{s.http}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = httpx.get(f"{s.http}/health").json()
        assert body["status"] == "ready"
        # the kernel backend chosen at start-up, and why
        backend = body["backend"]
        assert set(backend) == {"kernel_backend", "device", "cuda_graphs", "batch_invariant",
                                "reason"}
        if not torch.cuda.is_available():  # the torch path on CPU
            assert backend["kernel_backend"] == "torch" and backend["device"] == "cpu"
            assert backend["cuda_graphs"] is False and "cpu" in backend["reason"]
        threads = body["threads"]  # CPU threads per step and the load that chose them
        assert set(threads) == {"mode", "threads", "max_threads", "other_load"}
        assert 1 <= threads["threads"] <= threads["max_threads"]
        # the default method and what drafts for it (the tiny test model has no shipped
        # head; its corpus is the shipped one's text in its tokenizer's ids: millions)
        speculation = body["speculation"]
        assert speculation.pop("suffix_corpus_tokens") > 1_000_000
        assert speculation == {"method": "suffix", "draft_head": False, "draft_model": False}
        # the CPU attention kernel's lane in this process, once it is loaded (never built
        # for /health)
        from quickdraft.kernels import cpu_attention
        assert body.get("attention_lane") == cpu_attention.loaded_lane()
        weights = body["weights"]  # int4-q8, int4 or dense, and why (here fp32: no 4-bit)
        assert weights["format"] == "dense" and "4-bit weights not possible" in weights["reason"]
        assert httpx.post(f"{s.http}/v1/chat/completions", json=CHAT).status_code == 200


def test_failed_load_is_reported():
    def broken_factory():
        raise RuntimeError("weights are corrupt")

    with serve(make_settings(), broken_factory, wait_ready=False) as s:
        deadline = time.monotonic() + TIMEOUT
        while (body := httpx.get(f"{s.http}/health").json())["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert body["status"] == "failed" and "weights are corrupt" in body["error"]
        # then the server exits with status 2 (runner.GatewayServer._announce); a request
        # sent before it closes gets a 500 (on a slow machine it may already be closed)
        try:
            r = httpx.post(f"{s.http}/v1/chat/completions", json=CHAT)
        except httpx.TransportError:
            pass
        else:
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        s.thread.join(TIMEOUT)
        assert not s.thread.is_alive() and s.server.exit_code == 2


def test_drain_timeout_cancels_then_closes(tiny_model_dir):
    with serve(make_settings(drain_timeout=0.3), tiny_factory(tiny_model_dir)) as s:
        baseline = s.free_blocks()
        with ws_open(s.ws_url) as ws:
            session(ws)
            say(ws, "Never stop.")
            rid = respond(ws, **{**LONG, "max_output_tokens": 2000})
            recv_until(ws, of_type("response.output_text.delta", response_id=rid))
            s.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            _, done, _ = collect(ws, rid)
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "server_shutdown"
            assert s.free_blocks() == baseline
            assert closed_code(ws) == 1012
        s.thread.join(TIMEOUT)
        assert not s.thread.is_alive()


class Process:
    """A ``quickdraft serve`` subprocess whose stdout lines are read in the background."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
        self.proc = subprocess.Popen([*quickdraft_cmd(), "serve", *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for_url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
                continue
            if match := re.search(r"serving \S+ at (http://\S+)", line):
                return match.group(1)
        raise AssertionError("the server never said it was serving")


def test_sigterm_drains_then_closes_1012(tiny_model_dir):
    p = Process("--model", str(tiny_model_dir), "--dtype", "float32", "--port", "0",
                "--num-threads", "1", "--kv-cache-memory", "0.02", "--speculation", "off",
                "--drain-timeout", "120", "--log-level", "warning")
    try:
        base = p.wait_for_url()
        assert httpx.get(f"{base}/health").status_code == 200
        # the start-up lines also say what runs the model (as /health does)
        said = [p.lines.get(timeout=10) for _ in range(5)]
        assert any("weights          dense (4-bit weights not possible: dtype float32" in ln
                   for ln in said), said
        assert any("CPU threads      1 of 1, fixed" in ln for ln in said), said
        ws_url = base.replace("http://", "ws://") + "/v1/ws"
        with ws_open(ws_url) as ws:
            session(ws)
            say(ws, "Tell me everything.")
            rid = respond(ws, max_output_tokens=800, temperature=0, ignore_eos=True)
            recv_until(ws, of_type("response.output_text.delta", response_id=rid))
            p.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + TIMEOUT
            while httpx.get(f"{base}/health").status_code != 503:  # draining
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert httpx.get(f"{base}/health").json()["status"] == "draining"
            r = httpx.post(f"{base}/v1/chat/completions", json=CHAT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            with ws_open(ws_url) as late:
                assert closed_code(late) == 1012
            send(ws, {"type": "response.create", "event_id": "late"})
            error, _ = recv_until(ws, of_type("error"))
            assert error["error"]["code"] == "server_shutting_down"
            _, done, _ = collect(ws, rid, timeout=120)  # the answer in flight completes
            assert done["response"]["status"] == "completed"
            assert done["response"]["usage"]["output_tokens"] == 800
            assert closed_code(ws) == 1012
        assert p.proc.wait(TIMEOUT) == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def test_serve_bad_model_exits_2():
    proc = subprocess.run([*quickdraft_cmd(), "serve", "--model", "/nonexistent", "--port",
                           "0", "--log-level", "warning"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "quickdraft: error:" in proc.stderr and "/nonexistent" in proc.stderr
    assert "Traceback" not in proc.stderr
