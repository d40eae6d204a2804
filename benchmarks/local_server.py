"""What the gateway benchmarks (``serve_bench.py``, ``serve_bench_ray.py``) share about a
``quickdraft serve`` they start and talk to: a free port, its health check and the wait for
it, stopping the process, and the JSON chunks of a streamed OpenAI response (Server-Sent
Events)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``url``'s /health says 200; SystemExit after ``timeout`` seconds or once ``proc``
    has exited."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not become healthy (exit code "
                             f"{proc.poll() if proc else None})")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains), then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a streamed response's ``data:`` lines, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        yield orjson.loads(line[6:])
