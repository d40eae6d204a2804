"""Asyncio facade over :class:`LLMEngine`: the step loop runs in its own thread.

Callers on the event loop never touch the engine directly. They put commands (add, abort) on
a thread-safe queue; the engine thread drains it before every step, so an abort frees the
request's blocks within one step. Outputs travel back through ``loop.call_soon_threadsafe``
into one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.params import SpeculationParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    priority: int
    speculation: SpeculationParams | None
    sink: Callable[[RequestOutput | BaseException], None]
    cache_salt: str | None = None  # the tenant (prefix-cache and suffix-trie namespace)


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncLLM:
    """``async for delta in llm.generate(...)`` over an engine stepping in a background thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="quickdraft-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True) -> AsyncLLM:
        return cls(LLMEngine(config, progress=progress))

    # ------------------------------------------------------------------ event-loop side

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
        """Stream deltas; leaving the loop early (break, cancel) aborts the request."""
        if self._error is not None or self._stopped.is_set():
            raise EngineDeadError(f"engine is not running: {self._error}")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            # RuntimeError: the caller's event loop has closed, nobody is listening.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._commands.put(_Add(rid, prompt, prompt_token_ids,
                                sampling_params or SamplingParams(), priority, speculation,
                                sink, cache_salt))
        if self._stopped.is_set():  # stopped meanwhile: its final drain may have missed this add
            raise EngineDeadError(f"engine is not running: {self._error}")
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed before the next step."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # the loop itself broke: fail every waiter
            log.exception("engine loop died")
            self._error = exc
            for sink in self._sinks.values():
                sink(EngineDeadError(f"engine loop died: {exc}"))
            self._sinks.clear()
        finally:
            self._stopped.set()
            self._fail_waiters(EngineDeadError("engine shut down"))

    def _fail_waiters(self, error: EngineDeadError) -> None:
        """After the loop ends, no caller may keep waiting: in-flight and queued requests."""
        sinks = list(self._sinks.values())
        self._sinks.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                sinks.append(command.sink)
        for sink in sinks:
            sink(error)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False means shut down."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                self._deliver(self.engine.abort(command.request_id))
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params,
                prompt_token_ids=command.prompt_token_ids, priority=command.priority,
                speculation=command.speculation, cache_salt=command.cache_salt)
        except Exception as exc:  # invalid request: report to its caller only
            command.sink(exc)
            return
        self._sinks[command.request_id] = command.sink

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def stats(self) -> dict[str, Any]:
        """A snapshot for health/metrics endpoints (read without locking: approximate)."""
        kv = self.engine.kv.stats()
        spec = self.engine.speculator.stats
        return {
            "num_running": len(self.engine.scheduler.running),
            "num_waiting": len(self.engine.scheduler.waiting),
            "kv_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_preemptions": self.engine.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "spec_num_steps": spec.num_steps,
            "spec_num_drafted": spec.num_drafted,
            "spec_num_accepted": spec.num_accepted,
            "spec_accepted_per_position": list(spec.accepted_per_position),
            "spec_drafted_per_position": list(spec.drafted_per_position),
            "spec_proposer_seconds": spec.proposer_seconds,
            "spec_num_tree_steps": spec.num_tree_steps,
            "spec_num_tree_nodes": spec.num_tree_nodes,
            "spec_num_skipped_lookups": spec.num_skipped_lookups,
            "spec_num_unpayable_lookups": self.engine.speculator.proposers.num_unpayable_lookups,
            "spec_num_guard_off_steps": self.engine.speculator.num_guard_off_steps,
            "spec_num_guard_suspensions": self.engine.speculator.num_guard_suspensions,
            "spec_by_source": {k: list(v) for k, v in spec.by_source.items()},
            "spec_step_cost_ratio": (self.engine.step_cost.recent_ratio()
                                     if self.engine.step_cost is not None else 0.0),
            "spec_step_overhead_seconds": (self.engine.step_cost.overhead
                                           if self.engine.step_cost is not None else 0.0),
            **self._suffix_stats(),
        }

    def _suffix_stats(self) -> dict[str, int]:
        suffix = self.engine.speculator.suffix
        if suffix is None:
            return {}
        s = suffix.stats()
        return {"suffix_tenants": s["partitions"], "suffix_cached_tokens": s["tokens"]}
