"""Running the app on uvicorn: the socket binds first, the model loads behind it, the URL is
printed once it serves; SIGTERM / Ctrl-C drain (a second signal stops at once)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import uvicorn

from quickdraft.server.app import attention_lane, create_app, native_kernels
from quickdraft.server.gateway import EngineFactory, Gateway
from quickdraft.server.settings import ServerSettings

log = logging.getLogger(__name__)
_SECRET = re.compile(r"(api_key=|quickdraft\.api-key\.)[^&\s\"',]+", re.IGNORECASE)


class RedactKeys(logging.Filter):
    """Keeps API keys sent as a query parameter or subprotocol out of the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _SECRET.sub(r"\1***", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._spawn(self._announce())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def bound_address(self) -> tuple[str, int]:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def _announce(self) -> None:
        if not await self.gateway.wait_loaded():
            print(f"quickdraft: error: {self.gateway.error}", file=sys.stderr, flush=True)
            self.exit_code = 2
            self.should_exit = True
            return
        host, port = self.bound_address()
        if ":" in host:
            host = f"[{host}]"
        print(f"quickdraft: serving {self.gateway.model_name} at http://{host}:{port}\n"
              f"  WebSocket        ws://{host}:{port}/v1/ws\n"
              f"  OpenAI base URL  http://{host}:{port}/v1\n"
              f"  health, metrics  http://{host}:{port}/health, /metrics{self._kernels()}",
              flush=True)

    def _kernels(self) -> str:
        """What runs the model (weights, threads), as /health reports it: one line each."""
        engine = getattr(self.gateway.llm, "engine", None)
        weights = getattr(getattr(engine, "runner", None), "weights", None)
        threads = getattr(engine, "threads", None)
        lines = ""
        if weights is not None:
            lines += f"\n  weights          {weights.format} ({weights.reason})"
            if weights.native_layers:
                lines += (f"\n  decoder layers   {weights.native_layers} in one native call "
                          "each (kernels/cpu_layer.cpp)")
        if threads is not None:
            t = threads.describe()
            lines += f"\n  CPU threads      {t['threads']} of {t['max_threads']}, {t['mode']}"
        native = native_kernels(engine)
        if missing := {k: v for k, v in native.items() if v != "ok"}:
            lines += "".join(f"\n  ERROR            native kernel {k} unavailable ({v}); "
                             "the slow torch fallback runs" for k, v in sorted(missing.items()))
        elif native:
            lines += f"\n  native kernels   {', '.join(sorted(native))}"
        if native and (lane := attention_lane()):
            lines += f"\n  attention lane   {lane}"
        return lines

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then exit 0. A second one: stop now."""
        if self._draining or self._loop is None or not self.started:
            self.force_exit = self._draining
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._spawn, self._drain())

    async def _drain(self) -> None:
        grace = self.gateway.settings.drain_timeout
        print(f"quickdraft: draining: {self.gateway.admission.in_flight} answers in flight, "
              f"up to {grace:.0f} s (signal again to stop now)", file=sys.stderr, flush=True)
        try:
            await self.gateway.drain(grace)
        finally:
            self.should_exit = True


def build_server(settings: ServerSettings,
                 engine_factory: EngineFactory | None = None) -> GatewayServer:
    app = create_app(settings, engine_factory)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, ws="websockets-sansio",
        ws_max_size=settings.max_message_size, log_level=settings.log_level,
        lifespan="on", timeout_graceful_shutdown=5)
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).addFilter(RedactKeys())
    return GatewayServer(config, app.state.gateway)


def serve(settings: ServerSettings, engine_factory: EngineFactory | None = None) -> int:
    """Run until drained; the exit status (2 if the model failed to load)."""
    server = build_server(settings, engine_factory)
    print(f"quickdraft: loading {settings.model_name} (listening on {settings.host}:"
          f"{settings.port} meanwhile; /health says 503 until ready)", file=sys.stderr,
          flush=True)
    server.run()
    if not server.started:
        return 1  # uvicorn could not bind (it logged why)
    return server.exit_code
