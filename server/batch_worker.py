"""Runs batch jobs: validates input files, executes their lines at background priority through
the same AsyncLLM as interactive traffic (a bounded number in flight), records each answer in
the store, and finalizes jobs. Used by the gateway (server/batch_api.py) and by
``quickdraft batch`` without a server (server/batch_cli.py).

One control loop owns all scheduling: each step reads the active batches from the store and
moves every one of them on (validate, run, finalize, cancel). Lines are queued one batch at a
time in creation order; a batch's lines are loaded from the store (only those without a result),
so a restart resumes each job where it stopped. A line whose engine request could not run
(model loading, server draining, engine stopped) is not answered: it stays pending and runs
again later. Given the server's metrics, each line the engine ran is counted there at the
worker's priority.

The endpoint names and ``detect_endpoint`` live in server/batch_cli.py, which must stay light.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.server.batch_lines import BatchInputError, parse_input, response_line
from quickdraft.server.batch_requests import (
    BACKGROUND,
    Answer,
    EngineLink,
    Unavailable,
    execute,
)
from quickdraft.server.batch_store import BatchStore, PendingLine, new_id
from quickdraft.server.errors import ProtocolError

if TYPE_CHECKING:
    from quickdraft.server.metrics import GatewayMetrics

try:
    import fcntl
except ImportError:  # not POSIX: no guard against a second process on the same database
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
DEFAULT_MAX_IN_FLIGHT = 8
RETRY_DELAY = 1.0  # seconds before retrying when the engine cannot take requests
IDLE_POLL = 5.0  # seconds between store checks when nothing wakes the worker


# ---------------------------------------------------------------------- the worker


class BatchWorker:
    """Owns the store (opened lazily: a server that never sees a batch creates no database)
    and the control loop. ``run()`` until ``stop()``; ``wake()`` after changing a batch.
    With ``metrics`` (the server's), each line the engine ran is counted in the request-level
    metrics under its priority class; ``quickdraft batch`` in local mode passes none."""

    def __init__(self, db_path: str | Path, link: EngineLink, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, priority: int = BACKGROUND,
                 idle_poll: float = IDLE_POLL, metrics: GatewayMetrics | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.db_path = Path(db_path).expanduser()
        self.link = link
        self.max_in_flight = max_in_flight
        self.priority = priority
        self.idle_poll = idle_poll
        self.metrics = metrics
        self._store: BatchStore | None = None
        self._store_lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._queue: deque[PendingLine] = deque()
        self._queued: Counter[str] = Counter()  # batch id -> lines in the queue
        self._running: dict[asyncio.Task[None], PendingLine] = {}
        self._loaded: set[str] = set()  # in_progress batches whose pending lines were queued
        self._retry_at = 0.0
        self._main: asyncio.Task[None] | None = None
        # Set by stop(): the loop ends at its next turn even if the cancellation is lost
        # (Python 3.11's asyncio.wait_for can swallow a cancel that races its inner wait
        # finishing, and then stop() waited for a loop that never ended).
        self._stopping = False
        self._lock_fd: int | None = None
        self._fd_guard = threading.Lock()  # _try_lock runs in a thread; stop() may race it
        self._lock_warned = False

    # ------------------------------------------------------------------ lifecycle

    async def store(self, *, create: bool = True) -> BatchStore | None:
        """The store; None if ``create`` is false and the database does not exist yet."""
        if self._store is None:
            if self._store_lock is None:
                self._store_lock = asyncio.Lock()
            async with self._store_lock:
                if self._store is None and (create or self.db_path.exists()):
                    self._store = await asyncio.to_thread(BatchStore, self.db_path)
        return self._store

    def start(self) -> None:
        self._stopping = False
        self._main = asyncio.get_running_loop().create_task(self.run(), name="batch-worker")

    async def stop(self) -> None:
        """Cancel in-flight lines (they stay pending: a restart runs them) and close."""
        self._stopping = True
        main, self._main = self._main, None
        tasks = list(self._running)
        for task in [*tasks, *([main] if main else [])]:
            task.cancel()
        await asyncio.gather(*tasks, *([main] if main else []), return_exceptions=True)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None
        with self._fd_guard:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # also released by the kernel if this process dies
                self._lock_fd = None

    def _try_lock(self) -> bool:
        """Only one process runs the batches of a database: an exclusive lock on
        ``<db>.lock``, held until stop(). Others keep serving the API and take over once the
        holder exits."""
        if self._lock_fd is not None or fcntl is None:
            return True
        fd = os.open(f"{self.db_path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        with self._fd_guard:
            if self._stopping:  # stop() ran meanwhile: do not keep a lock nobody releases
                os.close(fd)
                return False
            self._lock_fd = fd
        return True

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        self._wake = asyncio.Event()
        if not await self.link.wait_loaded():
            log.error("batch worker: the engine failed to load; no batch will run")
            return
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._wake.clear()
            delay = self.idle_poll
            try:
                await self.step()
            except Exception:
                log.exception("batch worker step failed; retrying")
                delay = RETRY_DELAY
            if self._queue and loop.time() < self._retry_at:
                delay = min(delay, self._retry_at - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(delay, 0.01))

    # ------------------------------------------------------------------ one step

    async def step(self) -> None:
        store = await self.store(create=False)
        if store is None:
            return
        if not await asyncio.to_thread(self._try_lock):
            if not self._lock_warned:
                log.warning("another process runs the batches of %s; this one waits",
                            self.db_path)
                self._lock_warned = True
            return
        for batch in await asyncio.to_thread(store.active_batches):
            if batch.status == "validating":
                await self._validate(store, batch.id, batch.endpoint, batch.input_file_id)
            elif batch.status == "cancelling":
                self._drop(batch.id)
                if not self._in_flight(batch.id):
                    await asyncio.to_thread(store.finalize, batch.id)
            elif batch.status == "finalizing":
                await asyncio.to_thread(store.finalize, batch.id)
                self._loaded.discard(batch.id)
            elif batch.status == "in_progress":
                await self._advance(store, batch.id)
        self._fill(store)

    async def _validate(self, store: BatchStore, batch_id: str, endpoint: str,
                        input_file_id: str) -> None:
        data = await asyncio.to_thread(store.file_content, input_file_id)
        if data is None:
            await asyncio.to_thread(store.fail_batch, batch_id, [BatchInputError(
                "file_not_found", f"the input file {input_file_id} is gone").to_dict()])
            return
        try:
            lines = await asyncio.to_thread(parse_input, data, endpoint)
        except BatchInputError as err:
            await asyncio.to_thread(store.fail_batch, batch_id, [err.to_dict()])
            return
        await asyncio.to_thread(store.start_batch, batch_id, lines)
        self.wake()  # the next step starts its lines

    async def _advance(self, store: BatchStore, batch_id: str) -> None:
        if batch_id not in self._loaded:
            if self._queue:
                return  # one batch at a time: this one waits for the queue to run dry
            pending = await asyncio.to_thread(store.pending_lines, batch_id)
            self._queue.extend(pending)
            self._queued[batch_id] += len(pending)
            self._loaded.add(batch_id)
        if self._queued[batch_id] or self._in_flight(batch_id):
            return
        # Every queued line ran. If the store still has pending lines (an answer could not be
        # recorded), load them again next step; otherwise finalize.
        self._loaded.discard(batch_id)
        if await asyncio.to_thread(store.mark_finalizing, batch_id):
            await asyncio.to_thread(store.finalize, batch_id)

    def _in_flight(self, batch_id: str) -> bool:
        return any(line.batch_id == batch_id for line in self._running.values())

    def _drop(self, batch_id: str) -> None:
        """A cancelled batch: unqueue its lines and abort those in flight."""
        self._loaded.discard(batch_id)
        if self._queued.pop(batch_id, 0):
            self._queue = deque(ln for ln in self._queue if ln.batch_id != batch_id)
        for task, line in self._running.items():
            if line.batch_id == batch_id:
                task.cancel()

    def _fill(self, store: BatchStore) -> None:
        loop = asyncio.get_running_loop()
        if not self._queue or loop.time() < self._retry_at:
            return
        try:
            self.link.engine()
        except ProtocolError:  # loading, draining, stopped: try again shortly
            self._retry_at = loop.time() + RETRY_DELAY
            return
        while self._queue and len(self._running) < self.max_in_flight:
            line = self._queue.popleft()
            self._queued[line.batch_id] -= 1
            task = loop.create_task(self._run_line(store, line))
            self._running[task] = line
            task.add_done_callback(self._line_done)

    def _line_done(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        if not task.cancelled() and task.exception() is not None:  # its answer was not stored
            log.error("batch line failed unexpectedly", exc_info=task.exception())
            self._retry_at = asyncio.get_running_loop().time() + RETRY_DELAY
        self.wake()

    async def _run_line(self, store: BatchStore, line: PendingLine) -> None:
        try:
            answer = await execute(self.link, line.endpoint, line.body, self.priority,
                                     line.tenant)
        except Unavailable as exc:
            log.info("batch %s line %d postponed: %s", line.batch_id, line.idx, exc)
            if line.batch_id in self._loaded:
                self._queue.appendleft(line)
                self._queued[line.batch_id] += 1
            self._retry_at = asyncio.get_running_loop().time() + RETRY_DELAY
            return
        except Exception:  # a bug, not the request's fault: answer 500 rather than retry forever
            log.exception("batch %s line %d failed", line.batch_id, line.idx)
            err = ProtocolError("internal_error", "internal server error", status=500,
                                type="server_error")
            answer = Answer(500, new_id("req_"), {"error": err.to_dict()})
        result = response_line(line.custom_id, answer.status_code, answer.request_id,
                               answer.body)
        await asyncio.to_thread(store.record, line.batch_id, line.idx, answer.ok, result,
                                answer.prompt_tokens, answer.completion_tokens)
        self._observe(answer)

    def _observe(self, answer: Answer) -> None:
        """Count a recorded line in the metrics, as the HTTP endpoint counts a request (only
        lines the engine ran; a postponed line is counted when it finally runs)."""
        if self.metrics is not None and answer.finish_reason is not None:
            self.metrics.observe(answer.usage, answer.finish_reason, answer.latency,
                                 self.priority)
