"""What every endpoint shares: the engine (loaded in the background after the socket binds),
admission limits, open WebSocket sessions, prompt tokenization off the event loop, metrics,
and the drain that SIGTERM starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.server.errors import engine_failed, model_loading, shutting_down
from quickdraft.server.limits import Admission, ConnectionLimit
from quickdraft.server.metrics import GatewayMetrics
from quickdraft.server.prompt_tokenizer import PromptTokenizer
from quickdraft.server.settings import ServerSettings

log = logging.getLogger(__name__)
EngineFactory = Callable[[], AsyncLLM]
ABORT_WAIT = 5.0  # seconds for aborted requests to report back before sockets close
SHUTDOWN_CLOSE_CODE = 1012  # "service restart"


class Session(Protocol):
    """What the drain needs from an open WebSocket session (server.ws.Connection)."""

    def cancel_all(self, reason: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


def default_engine_factory(config: EngineConfig) -> EngineFactory:
    return lambda: AsyncLLM(LLMEngine(config, progress=True))


class Gateway:
    def __init__(self, settings: ServerSettings, engine_factory: EngineFactory) -> None:
        self.settings = settings
        self.model_name = settings.model_name
        self.created = int(time.time())
        self.status = "loading"  # loading | ready | failed | draining | stopped
        self.error: str | None = None
        self.llm: AsyncLLM | None = None
        self.admission = Admission(settings.max_inflight_requests)
        self.ws_limit = ConnectionLimit(settings.max_connections)
        self.sessions: set[Session] = set()
        self.http_requests: set[str] = set()  # engine request ids of HTTP requests in flight
        self.metrics = GatewayMetrics(self.model_name, self._stats)
        self._factory = engine_factory
        self._tokenizer = PromptTokenizer("quickdraft-tokenize")
        self._loaded: asyncio.Event | None = None

    def _stats(self) -> dict[str, Any] | None:
        llm = self.llm
        return llm.stats() if llm is not None and llm.is_running else None

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        self.start_loading()
        try:
            yield
        finally:
            await self.close()

    def start_loading(self) -> None:
        """Build the engine in a daemon thread; the event loop keeps serving /health."""
        loop = asyncio.get_running_loop()
        self._loaded = asyncio.Event()

        def load() -> None:
            try:
                result: AsyncLLM | BaseException = self._factory()
            except BaseException as exc:  # reported through /health and the CLI
                result = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._on_loaded, result)

        threading.Thread(target=load, name="quickdraft-load", daemon=True).start()

    def _on_loaded(self, result: AsyncLLM | BaseException) -> None:
        if isinstance(result, BaseException):
            self.status, self.error = "failed", f"{type(result).__name__}: {result}"
            log.error("loading the model failed: %s", self.error)
        elif self.status == "stopped":
            result.shutdown()
        else:
            self.llm = result
            if self.status == "loading":
                self.status = "ready"
        assert self._loaded is not None
        self._loaded.set()

    async def wait_loaded(self) -> bool:
        """True once the engine runs, False if loading failed."""
        assert self._loaded is not None, "start_loading() first"
        await self._loaded.wait()
        return self.llm is not None

    async def close(self) -> None:
        self.status = "stopped"
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        self._tokenizer.close()

    # ------------------------------------------------------------------ serving

    def engine(self) -> AsyncLLM:
        """The running engine, or the error to answer with."""
        if self.admission.draining:
            raise shutting_down()
        llm = self.llm
        if llm is None:
            raise model_loading() if self.status == "loading" else \
                engine_failed(f"the model failed to load: {self.error}")
        if not llm.is_running:
            raise engine_failed("the engine has stopped")
        return llm

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]:
        """Apply the chat template in the tokenizer thread (big prompts must not stall I/O)."""
        return await self._tokenizer.chat(llm, messages, param)

    async def text_prompt(self, llm: AsyncLLM, prompt: str) -> list[int]:
        return await self._tokenizer.text(llm, prompt)

    # ------------------------------------------------------------------ drain

    async def drain(self, grace: float) -> None:
        """Refuse new work, let answers in flight finish for up to ``grace`` seconds, cancel
        what is left, then close every WebSocket with 1012."""
        log.info("draining: %d requests in flight, up to %.0f s", self.admission.in_flight,
                 grace)
        self.status = "draining"
        self.admission.draining = True
        if not await self._wait_idle(grace):
            log.warning("drain timeout: cancelling %d requests", self.admission.in_flight)
            for session in list(self.sessions):
                session.cancel_all("server_shutdown")
            if self.llm is not None:
                for rid in list(self.http_requests):
                    self.llm.abort(rid)
            await self._wait_idle(ABORT_WAIT)
        await asyncio.gather(*(s.close(SHUTDOWN_CLOSE_CODE, "server shutting down")
                               for s in list(self.sessions)), return_exceptions=True)

    async def _wait_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.admission.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return not self.admission.in_flight
