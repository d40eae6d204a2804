"""The engine deployment of the Ray Serve app: one :class:`AsyncLLM` per replica.

Each replica owns its model, KV cache and prefix cache. ``generate`` streams a request's deltas
as :class:`DeltaBatch` objects: everything that is ready goes out together, and after the first
batch (sent at once, for the time to first token) at most one batch leaves per
``stream_interval`` seconds, so a fast engine does not cost one Ray object per token. Every
answer names the replica (``replica``), so the gateway can say who served a request.

Errors travel as data (:class:`RemoteError`), not as Ray task errors, so the gateway rebuilds
the engine's own exception types (``InvalidParameterError`` with its ``param``,
``EngineDeadError``) and answers exactly as with a local engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import InvalidParameterError, SamplingParams
from quickdraft.spec.params import SpeculationParams

STREAM_INTERVAL = 0.02  # seconds between two batches of one request after its first


@dataclass(frozen=True)
class EngineRequest:
    """One ``AsyncLLM.generate`` call, as sent to an engine replica."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int = 0
    speculation: SpeculationParams | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class RemoteError:
    """An exception of the engine replica, as data: ``kind`` is invalid | dead | error."""

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        if isinstance(exc, InvalidParameterError):
            return cls("invalid", exc.message, exc.param)
        if isinstance(exc, EngineDeadError):
            return cls("dead", str(exc))
        return cls("error", f"{type(exc).__name__}: {exc}")

    def rebuild(self) -> Exception:
        """The exception the gateway raises in place of the replica's."""
        if self.kind == "invalid":
            return InvalidParameterError(self.param or "request", self.message)
        if self.kind == "dead":
            return EngineDeadError(self.message)
        return RuntimeError(self.message)


@dataclass(frozen=True)
class DeltaBatch:
    """The deltas of one request that were ready together (in order), or its error."""

    replica: str
    outputs: list[RequestOutput] = field(default_factory=list)
    error: RemoteError | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None or any(o.finished for o in self.outputs)


def replica_names() -> tuple[str, str]:
    """(this Serve replica's short id, its actor's full name); ("local", "") outside Serve."""
    try:
        from ray import serve

        rid = serve.get_replica_context().replica_id
    except Exception:  # not in a Serve replica (unit tests, local runs)
        return "local", ""
    return rid.unique_id, rid.to_full_id_str()


class EngineReplica:
    """The engine deployment's class (``serve.deployment(EngineReplica)``): an AsyncLLM built
    from ``config`` in the replica, its streams, aborts, stats and health."""

    def __init__(self, config: EngineConfig, stream_interval: float = STREAM_INTERVAL) -> None:
        self.llm = AsyncLLM(LLMEngine(config, progress=False))
        self.config = config
        self.stream_interval = stream_interval
        self.replica, self.actor_name = replica_names()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: EngineRequest,
                       affinity_key: str | None = None) -> AsyncIterator[DeltaBatch]:
        """Stream ``request``'s deltas in batches. ``affinity_key`` is read by the router
        (server/ray_router.py), not here. Cancelling the stream aborts the engine request."""
        ready: asyncio.Queue[RequestOutput | RemoteError] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(request, ready))
        try:
            async for batch in self._batches(ready):
                yield batch
        finally:
            pump.cancel()  # leaving AsyncLLM.generate early aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _pump(self, request: EngineRequest,
                    ready: asyncio.Queue[RequestOutput | RemoteError]) -> None:
        """Move the engine's deltas into ``ready`` as they come."""
        try:
            async for out in self.llm.generate(
                    request.prompt, request.params, prompt_token_ids=request.prompt_token_ids,
                    request_id=request.request_id, priority=request.priority,
                    speculation=request.speculation, cache_salt=request.cache_salt):
                ready.put_nowait(out)
        except Exception as exc:
            ready.put_nowait(RemoteError.of(exc))

    async def _batches(self, ready: asyncio.Queue[RequestOutput | RemoteError]
                       ) -> AsyncIterator[DeltaBatch]:
        sent = -float("inf")  # monotonic time of the last batch
        while True:
            items = [await ready.get()]
            if not _ends(items[-1]):
                wait = sent + self.stream_interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # let more deltas gather
            while not _ends(items[-1]) and not ready.empty():
                items.append(ready.get_nowait())
            sent = time.monotonic()
            error = items[-1] if isinstance(items[-1], RemoteError) else None
            outputs = [o for o in items if isinstance(o, RequestOutput)]
            batch = DeltaBatch(self.replica, outputs, error)
            yield batch
            if batch.ended:
                return

    def abort(self, request_id: str) -> str:
        """Abort ``request_id`` if this replica runs it (its blocks are free within a step);
        the replica's id."""
        self.llm.abort(request_id)
        return self.replica

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, Any]:
        """``AsyncLLM.stats()`` plus ``replica`` (short id) and ``actor`` (full actor name)."""
        return {**self.llm.stats(), "replica": self.replica, "actor": self.actor_name}

    def info(self) -> dict[str, Any]:
        """What a gateway needs to know of the engine before it serves."""
        engine = self.llm.engine
        return {"replica": self.replica, "max_model_len": engine.max_model_len,
                "block_size": self.config.block_size, "max_num_seqs": self.config.max_num_seqs,
                "model_dir": engine.info.model_dir}

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine loop died is replaced."""
        if not self.llm.is_running:
            raise EngineDeadError("the engine loop of this replica has stopped")

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _ends(item: RequestOutput | RemoteError) -> bool:
    return isinstance(item, RemoteError) or item.finished
