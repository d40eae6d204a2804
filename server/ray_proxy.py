"""The gateway's engine on Ray Serve: :class:`RemoteLLM` offers exactly the parts of
:class:`AsyncLLM` that the gateway calls (``generate``, ``abort``, ``stats``, ``is_running``,
``shutdown``, and ``engine.tokenizer`` / ``engine.apply_chat_template`` /
``engine.max_model_len``), over a handle of the engine deployment (server/ray_engine.py), plus
``refresh_stats``, which the gateway's /metrics awaits before it renders: its ``stats`` are
each engine replica's own (server/ray_stats.py).

Prompts are tokenized in the gateway with the model's own tokenizer (:class:`LocalFrontend`),
so no round trip precedes a request. Each request carries an affinity key for the router
(server/ray_router.py): the session of the HTTP request or WebSocket connection that asked
(:class:`CallScope`, set by the gateway's middleware), else a digest of the prompt's first
KV blocks. Which replica served each request is written back into the same ``CallScope``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from quickdraft.engine.async_engine import EngineDeadError
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.server.affinity import DEFAULT_KEY_BLOCKS, prefix_key
from quickdraft.server.ray_engine import DeltaBatch, EngineRequest
from quickdraft.server.ray_stats import SCRAPE_TIMEOUT, ReplicaStatsPoller
from quickdraft.spec.params import SpeculationParams

log = logging.getLogger(__name__)
CONTROL_TIMEOUT = 10.0  # seconds an abort may take


@dataclass
class CallScope:
    """One HTTP request or WebSocket connection on the gateway, as the engine proxy sees it:
    its affinity key in, and the replica (and prefix-cache hit) of each request out."""

    key: str | None = None
    replicas: dict[str, str] = field(default_factory=dict)  # request id -> engine replica
    cached_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens
    last_request: str | None = None


CALL_SCOPE: ContextVar[CallScope | None] = ContextVar("quickdraft_call_scope", default=None)


class LocalFrontend:
    """The parts of ``LLMEngine`` the gateway uses before a request leaves it: the tokenizer,
    the chat template and the context length, without the weights."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return list(ids)


class RemoteLLM:
    """AsyncLLM's face over the engine deployment's ``DeploymentHandle``; lives on the
    gateway replica's event loop ``loop``."""

    def __init__(self, handle: Any, frontend: LocalFrontend, *, block_size: int,
                 loop: asyncio.AbstractEventLoop, key_blocks: int = DEFAULT_KEY_BLOCKS,
                 scrape_timeout: float = SCRAPE_TIMEOUT) -> None:
        self.engine = frontend
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._block_size = block_size
        self._key_blocks = key_blocks
        self._loop = loop
        self._ids = itertools.count()
        self._active: set[str] = set()  # ids of the requests streaming through here
        self._aborted: set[str] = set()  # active ids aborted (sent again once routed)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stats = ReplicaStatsPoller(handle, timeout=scrape_timeout)
        self._running = True

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        speculation: SpeculationParams | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas from an engine replica; leaving early aborts the request there."""
        if not self._running:
            raise EngineDeadError("the gateway's engine proxy is shut down")
        rid = request_id or f"ray-req-{next(self._ids)}"
        scope = CALL_SCOPE.get()
        key = self.affinity_key(scope, prompt, prompt_token_ids, cache_salt)
        request = EngineRequest(rid, prompt, prompt_token_ids, sampling_params or SamplingParams(),
                                priority, speculation, cache_salt)
        stream = self._stream.generate.remote(request, affinity_key=key)
        finished, replica = False, None
        self._active.add(rid)
        try:
            async for batch in stream:
                assert isinstance(batch, DeltaBatch)
                if replica is None:
                    replica = batch.replica
                    self._on_routed(rid, replica, scope)
                if batch.error is not None:
                    finished = True
                    raise batch.error.rebuild()
                for out in batch.outputs:
                    finished = out.finished
                    if finished and scope is not None and out.usage is not None:
                        scope.cached_tokens[rid] = out.usage.num_cached_tokens
                    yield out
                    if finished:
                        return
            finished = True
            raise EngineDeadError(f"engine replica {replica} ended the stream early")
        except (RayError, RayServeException) as exc:  # the replica died, or none is up
            finished = True
            raise EngineDeadError(f"engine replica {replica or '(unassigned)'} failed: "
                                  f"{type(exc).__name__}") from exc
        finally:
            self._active.discard(rid)
            self._aborted.discard(rid)
            if not finished:  # the caller left: stop the remote request
                stream.cancel()
                self._send_abort(rid)

    def affinity_key(self, scope: CallScope | None, prompt: str | None,
                     ids: list[int] | None, cache_salt: str | None) -> str:
        """The caller's session, else a digest of the prompt's first KV blocks."""
        if scope is not None and scope.key is not None:
            return scope.key
        if ids is None:
            ids = list(self.engine.tokenizer.encode(prompt or "", add_special_tokens=False))
        return prefix_key(ids, self._block_size, cache_salt, self._key_blocks)

    def _on_routed(self, rid: str, replica: str, scope: CallScope | None) -> None:
        if scope is not None:
            scope.replicas[rid] = replica
            scope.last_request = rid
        if rid in self._aborted:  # aborted while it was being routed: abort it again
            self._send_abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe, like AsyncLLM.abort: the request's final output (abort) still comes
        through its stream."""
        self._loop.call_soon_threadsafe(self._abort_now, request_id)

    def _abort_now(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)
            self._send_abort(request_id)

    def _send_abort(self, request_id: str) -> None:
        """Every replica gets the abort (a broadcast bypasses the replicas' request limits, so
        a full replica still hears it); the one running the request frees its blocks."""
        self._spawn(self._control("abort", request_id))

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, Any]:
        """Each engine replica's stats, as of the last :meth:`refresh_stats`:
        ``{"replicas": {replica id: stats}, "replicas_up": {replica id: 1 or 0}}``."""
        return self._stats.snapshot

    async def refresh_stats(self) -> None:
        """Poll every engine replica's stats now (the gateway's /metrics, before it renders);
        a replica that does not answer within ``scrape_timeout`` seconds is left out and
        counts as down."""
        if self._running:
            await self._stats.refresh()

    async def _control(self, method: str, *args: Any) -> list[Any] | None:
        """``method(*args)`` on every engine replica: their results, or None (logged) if the
        call failed or timed out."""
        try:
            response = self._handle.broadcast(method, *args)
            results = await asyncio.wait_for(response.results_async(), CONTROL_TIMEOUT)
        except (RayError, RayServeException, TimeoutError, RuntimeError) as exc:
            log.warning("engine %s call failed: %s: %s", method, type(exc).__name__, exc)
            return None
        return list(results)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def is_running(self) -> bool:
        return self._running

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop polling; the engine replicas belong to Serve and keep running."""
        self._running = False
        with contextlib.suppress(RuntimeError):  # the loop has closed
            self._loop.call_soon_threadsafe(self._cancel_tasks)

    def _cancel_tasks(self) -> None:
        self._stats.cancel()
        for task in list(self._tasks):
            task.cancel()

