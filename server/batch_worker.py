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
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import jinja2
import orjson

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.engine.sampling_params import InvalidParameterError
from quickdraft.server.batch_cli import CHAT_ENDPOINT
from quickdraft.server.batch_store import BatchStore, LineRecord, PendingLine, new_id
from quickdraft.server.errors import ProtocolError, engine_failed, invalid, unsupported
from quickdraft.server.openai_api import parse_messages, parse_options, parse_prompt
from quickdraft.server.openai_format import CompletionFormat
from quickdraft.server.params import (
    JSON,
    PRIORITY_CLASSES,
    Fields,
    build_sampling,
    cache_namespace,
    fit_max_tokens,
)

if TYPE_CHECKING:
    from quickdraft.server.metrics import GatewayMetrics

try:
    import fcntl
except ImportError:  # not POSIX: no guard against a second process on the same database
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
BACKGROUND = PRIORITY_CLASSES["background"]
MAX_LINES = 50_000  # requests in one batch (OpenAI's limit)
DEFAULT_MAX_IN_FLIGHT = 8
RETRY_DELAY = 1.0  # seconds before retrying when the engine cannot take requests
IDLE_POLL = 5.0  # seconds between store checks when nothing wakes the worker


class Unavailable(Exception):
    """The engine cannot run requests now; the line stays pending and runs later."""


class BatchInputError(Exception):
    """The input file as a whole is unusable: the batch fails."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> JSON:
        return {"code": self.code, "message": self.message, "param": None, "line": None}


class EngineLink(Protocol):
    """What the worker needs from its host: :class:`server.gateway.Gateway` or
    :class:`LocalLink`."""

    model_name: str

    async def wait_loaded(self) -> bool: ...

    def engine(self) -> AsyncLLM: ...

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]: ...

    async def text_prompt(self, llm: AsyncLLM, prompt: str) -> list[int]: ...


class LocalLink:
    """An :class:`EngineLink` over an AsyncLLM owned by the caller (no gateway)."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-batch-tokenize")

    async def wait_loaded(self) -> bool:
        return True

    def engine(self) -> AsyncLLM:
        if not self.llm.is_running:
            raise engine_failed("the engine has stopped")
        return self.llm

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, llm.engine.apply_chat_template,
                                              messages)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise invalid(param, f"the chat template refused the messages: {exc}") from exc

    async def text_prompt(self, llm: AsyncLLM, prompt: str) -> list[int]:
        loop = asyncio.get_running_loop()
        encode = partial(llm.engine.tokenizer.encode, prompt, add_special_tokens=False)
        return list(await loop.run_in_executor(self._pool, encode))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- input and output lines


def error_line(custom_id: str | None, code: str, message: str) -> JSON:
    """An error-file line for a request that got no HTTP response (refused before running)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def response_line(custom_id: str, status_code: int, request_id: str, body: JSON) -> JSON:
    """An output-file line (status 200) or an error-file line (an HTTP error response)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def parse_input(data: bytes, endpoint: str, max_lines: int = MAX_LINES) -> list[LineRecord]:
    """Split a JSONL input file into request lines (blank lines skipped). A malformed line is
    kept as a refused line with its error-file entry, so the rest of the job carries on; raises
    BatchInputError if the file as a whole is unusable."""
    raw_lines = [(n, raw) for n, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    if not raw_lines:
        raise BatchInputError("empty_file", "the input file holds no request lines")
    if len(raw_lines) > max_lines:
        raise BatchInputError("too_many_requests", f"the input file holds {len(raw_lines)} "
                              f"requests; a batch takes at most {max_lines}")
    records: list[LineRecord] = []
    seen: dict[str, int] = {}
    for idx, (n, raw) in enumerate(raw_lines):
        custom_id, body, error = _parse_line(raw, n, endpoint, seen)
        if error is not None:
            code, message = error
            records.append(LineRecord(idx, custom_id, None,
                                      error_line(custom_id, code, f"line {n}: {message}")))
        else:
            records.append(LineRecord(idx, custom_id, body))
    return records


def _parse_line(raw: bytes, n: int, endpoint: str, seen: dict[str, int]
                ) -> tuple[str | None, JSON | None, tuple[str, str] | None]:
    """(custom_id, body, None) or (custom_id or None, None, (code, message))."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, None, ("invalid_json", f"not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return None, None, ("invalid_request", "a request line must be a JSON object")
    cid = obj.get("custom_id")
    if cid is None:
        return None, None, ("missing_required_parameter", "custom_id is required")
    if not isinstance(cid, str) or not cid:
        return None, None, ("invalid_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        return cid, None, ("duplicate_custom_id", f"custom_id {cid!r} is already used on line "
                           f"{seen[cid]}; each request needs its own")
    seen[cid] = n
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    missing = [k for k, v in (("method", method), ("url", url), ("body", body)) if v is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        return cid, None, ("missing_required_parameter", f"{', '.join(missing)} {verb} required")
    if not isinstance(method, str) or method.upper() != "POST":
        return cid, None, ("invalid_method", f"method must be 'POST', got {method!r}")
    if url != endpoint:
        return cid, None, ("invalid_url", f"url {url!r} does not match the batch's endpoint "
                           f"{endpoint!r}")
    if not isinstance(body, dict):
        return cid, None, ("invalid_request", "body must be a JSON object")
    return cid, body, None


# ---------------------------------------------------------------------- one line


@dataclass(frozen=True)
class Answer:
    """One line's HTTP-shaped answer; ``finish_reason`` (and ``usage``, ``latency``: seconds
    from submitting to the engine to its last output) are set when the engine ran it."""

    status_code: int
    request_id: str
    body: JSON
    usage: Usage | None = None
    finish_reason: str | None = None
    latency: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status_code == 200

    @property
    def prompt_tokens(self) -> int:
        """For the batch's ``usage``: answered (200) lines only."""
        return self.usage.prompt_tokens if self.usage and self.ok else 0

    @property
    def completion_tokens(self) -> int:
        """For the batch's ``usage``: answered (200) lines only."""
        return self.usage.completion_tokens if self.usage and self.ok else 0


async def execute(link: EngineLink, endpoint: str, body: JSON,
                  priority: int = BACKGROUND, tenant: str | None = None) -> Answer:
    """Run one request body the way POST ``endpoint`` would (same parsing, same response
    shape), never streamed, at ``priority``, in ``tenant``'s cache namespace (refined by the
    body's ``cache_salt``, as over HTTP). An HTTP error becomes an Answer with its status
    and ``{"error": ...}`` body; raises Unavailable if the engine cannot take requests now."""
    try:
        llm = link.engine()
    except ProtocolError as err:  # loading, draining, stopped
        raise Unavailable(err.message) from err
    chat = endpoint == CHAT_ENDPOINT
    fmt: CompletionFormat | None = None
    try:
        f = Fields(body)  # error params name fields as the HTTP API does
        opts = parse_options(f, link.model_name, chat=chat)
        if opts.stream:
            raise unsupported("stream", "batch requests cannot be streamed")
        if chat:
            ids = await link.chat_prompt(llm, parse_messages(f), "messages")
        else:
            prompt = parse_prompt(f)
            ids = prompt if isinstance(prompt, list) else await link.text_prompt(llm, prompt)
        prompt_param = "messages" if chat else "prompt"
        max_tokens = fit_max_tokens(len(ids), opts.max_tokens, llm.engine.max_model_len,
                                    param=opts.max_tokens_param, prompt_param=prompt_param)
        params = build_sampling({**opts.sampling, "max_tokens": max_tokens,
                                 "logprobs": opts.logprobs}, "", opts.max_tokens_param)
        fmt = CompletionFormat(chat=chat, model=link.model_name,
                               tokenizer=llm.engine.tokenizer, logprobs=opts.logprobs)
        start = time.monotonic()
        outputs = await _generate(llm, ids, params, fmt.id, priority, opts.speculation,
                                  prompt_param, cache_namespace(tenant, opts.cache_salt))
    except ProtocolError as err:
        return Answer(err.status, fmt.id if fmt else new_id("req_"), {"error": err.to_dict()})
    final, latency = outputs[-1], time.monotonic() - start
    if final.finish_reason == "abort":
        raise Unavailable("the request was aborted")
    if final.finish_reason == "error":
        if not llm.is_running:
            raise Unavailable(final.error or "the engine stopped")
        failed = engine_failed(final.error or "the engine failed this request")
        return Answer(failed.status, fmt.id, {"error": failed.to_dict()}, final.usage,
                      "error", latency)
    return Answer(200, fmt.id, fmt.body(outputs), final.usage, final.finish_reason, latency)


async def _generate(llm: AsyncLLM, ids: list[int], params: Any, request_id: str,
                    priority: int, speculation: Any, prompt_param: str,
                    cache_salt: str | None) -> list[RequestOutput]:
    stream = cast(AsyncGenerator[RequestOutput, None], llm.generate(
        prompt_token_ids=ids, sampling_params=params, request_id=request_id,
        priority=priority, speculation=speculation, cache_salt=cache_salt))
    outputs: list[RequestOutput] = []
    try:
        async with contextlib.aclosing(stream):  # cancelled: aclose() aborts the request
            async for out in stream:
                outputs.append(out)
    except InvalidParameterError as err:  # refused by the engine itself
        param = prompt_param if err.param in ("prompt", "prompt_token_ids") else err.param
        raise invalid(param, err.message) from err
    except EngineDeadError as err:
        raise Unavailable(str(err)) from err
    if not outputs:
        raise Unavailable("the engine returned no output")
    return outputs


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
