"""``quickdraft batch INPUT.jsonl -o OUTPUT.jsonl``: run a file of requests in OpenAI's Batch API
format, against a server (``--url``: upload, create, poll, download) or in this process (the
same store and worker as the server, at background priority). docs/batch.md.

Start-up stays light: this module imports neither torch nor the engine (``--help`` and
``--url`` never load them); local mode imports the engine when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

FINAL = ("completed", "failed", "cancelled", "expired")
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
LINE_EVERY = 10.0  # seconds between plain progress lines when no 10 % step prompts one


def detect_endpoint(data: bytes) -> str:
    """The ``url`` of the first request line that names a supported endpoint (default chat)."""
    for raw in data.splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            obj = orjson.loads(raw)
            if isinstance(obj, dict) and obj.get("url") in ENDPOINTS:
                return str(obj["url"])
    return CHAT_ENDPOINT


def add_batch_parser(sub: Any) -> None:
    """Add ``batch`` to the ``quickdraft`` subcommands."""
    from quickdraft.server.cli import add_engine_args  # the CLI module imports this one

    p = sub.add_parser("batch", help="run a JSONL file of requests (OpenAI Batch API format), "
                       "locally or on a server")
    p.add_argument("input", help="JSONL: one {custom_id, method, url, body} request per line")
    p.add_argument("-o", "--output", required=True, help="where the answers go (JSONL)")
    p.add_argument("--errors", default=None,
                   help="where failed requests go (JSONL; default: only a summary on stderr)")
    p.add_argument("--endpoint", default=None, choices=list(ENDPOINTS),
                   help="the endpoint every line calls (default: the url of the first "
                        "request line)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every 10 %% or "
                        f"{LINE_EVERY:.0f} s) and no model-loading messages")
    p.add_argument("--poll-interval", type=float, default=0.5,
                   help="seconds between progress checks")
    r = p.add_argument_group("on a server")
    r.add_argument("--url", default=None,
                   help="the server, e.g. http://127.0.0.1:8000 (default: none, the batch "
                        "runs in this process)")
    r.add_argument("--api-key", default=None,
                   help="API key (default: $QUICKDRAFT_API_KEY, else none)")
    loc = p.add_argument_group("in this process (no --url)")
    loc.add_argument("--batch-db", default=None,
                     help="keep the job in this SQLite file: a run that was stopped resumes "
                          "where it stopped (default: a temporary file)")
    loc.add_argument("--max-in-flight", type=int, default=8,
                     help="requests in the engine at once")
    loc.add_argument("--served-model-name", default=None,
                     help="the model name request bodies may give (default: the model's "
                          "served name)")
    loc.add_argument("--num-threads", type=int, default=None,
                     help="CPU threads per step (default: all cores, fewer while other "
                          "processes keep them busy)")
    add_engine_args(p)
    p.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    if args.max_in_flight < 1 or args.poll_interval <= 0:
        print("quickdraft: error: --max-in-flight must be >= 1 and --poll-interval > 0",
              file=sys.stderr)
        return 2
    try:
        data = Path(args.input).read_bytes()
    except OSError as exc:
        print(f"quickdraft: error: cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return 2
    endpoint = args.endpoint or detect_endpoint(data)
    try:
        if args.url:
            batch = run_remote(args, data, endpoint)
        else:
            batch = asyncio.run(run_local(args, data, endpoint))
    except KeyboardInterrupt:
        print("\nquickdraft: stopped", file=sys.stderr)
        return 130
    except RemoteError as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 1
    return report(args, batch)


class RemoteError(Exception):
    """The server refused a request or could not be reached."""


# ---------------------------------------------------------------------- progress and results


@dataclass(frozen=True)
class Counts:
    """A batch object's ``request_counts``: done = completed + failed."""

    total: int
    completed: int
    failed: int

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @classmethod
    def of(cls, batch: dict[str, Any]) -> Counts:
        counts = batch.get("request_counts") or {}
        return cls(counts.get("total") or 0, counts.get("completed") or 0,
                   counts.get("failed") or 0)


class Progress:
    """A batch's progress on ``stream`` (stderr): a live tqdm bar on a terminal; elsewhere
    plain lines, no carriage returns (at the start, every 10 % and at least every ``every``
    seconds); nothing when quiet. ``update`` takes each polled batch object.

    The rate is requests finished (completed or failed) per second of wall time since the batch
    started running (``in_progress_at``, kept within [``since``, now] so that whole-second
    stamps and a server clock that differs from ours cannot skew it). A ``resumed`` batch
    counts only what this run finishes, from ``since``."""

    def __init__(self, quiet: bool, stream: IO[str] | None = None, *, resumed: bool = False,
                 every: float = LINE_EVERY, clock: Callable[[], float] = time.time) -> None:
        self._stream = stream or sys.stderr
        self._quiet = quiet
        self._resumed = resumed
        self._every = every
        self._clock = clock
        self._since = clock()  # when this run created (or resumed) the batch
        self._start: float | None = None
        self._base = 0  # requests done before the start (a resumed batch's earlier runs)
        self._bar: Any = None
        self._last_line: tuple[int, float] | None = None  # (tenths done, when) of the last line

    @property
    def terminal(self) -> bool:
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    def update(self, batch: dict[str, Any]) -> None:
        counts = Counts.of(batch)
        if self._quiet or not counts.total:  # total is 0 while the input is validated
            return
        now = self._clock()
        if self._start is None:
            started = float(batch.get("in_progress_at") or now)
            self._start = min(max(started, self._since), now)
            self._base = counts.done if self._resumed else 0
        if self.terminal:
            self._draw(batch["id"], counts)
        else:
            self._line(batch["id"], counts, now)

    def rate(self, done: int, now: float) -> float:
        """Requests per second finished since the start (0 before any time has passed)."""
        elapsed = now - (self._start if self._start is not None else now)
        return (done - self._base) / elapsed if elapsed > 0 else 0.0

    def _draw(self, batch_id: str, counts: Counts) -> None:
        if self._bar is None:
            from tqdm import tqdm

            # smoothing=0: tqdm's rate is (n - initial) / (now - start_t), the average rate
            sized = _columns(self._stream) > 0  # a terminal of 0 columns would show nothing
            self._bar = tqdm(total=counts.total, initial=self._base, unit="req", desc=batch_id,
                             file=self._stream, smoothing=0, dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 40)
            self._bar.start_t = self._start  # tqdm's clock is time.time, as ours
        self._bar.set_postfix(failed=counts.failed, refresh=False)
        if counts.done > self._bar.n:
            self._bar.n = counts.done
        self._bar.refresh()  # also between answers: elapsed time and rate stay live

    def _line(self, batch_id: str, counts: Counts, now: float) -> None:
        tenth = counts.done * 10 // counts.total
        last = self._last_line
        if last is not None and tenth <= last[0] and now - last[1] < self._every:
            return
        self._last_line = (tenth, now)
        print(f"batch {batch_id}: {counts.done}/{counts.total} done, {counts.failed} failed, "
              f"{self.rate(counts.done, now):.1f} req/s", file=self._stream, flush=True)

    def say(self, message: str) -> None:
        """A status message (model loading, resuming) unless quiet."""
        if not self._quiet:
            print(f"quickdraft: {message}", file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _columns(stream: IO[str]) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it does not say."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return 0


def report(args: argparse.Namespace, batch: dict[str, Any]) -> int:
    counts = batch.get("request_counts") or {}
    ok, failed = counts.get("completed", 0), counts.get("failed", 0)
    where = f" (see {args.errors})" if failed and args.errors else ""
    print(f"quickdraft: batch {batch['id']} {batch['status']}: {ok} answered, {failed} "
          f"failed{where}; output in {args.output}", file=sys.stderr)
    for err in (batch.get("errors") or {}).get("data") or []:
        print(f"  {err.get('code')}: {err.get('message')}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def write_results(args: argparse.Namespace, output: bytes, errors: bytes) -> None:
    Path(args.output).write_bytes(output)
    if args.errors:
        Path(args.errors).write_bytes(errors)
    elif errors:
        first = errors.splitlines()[0].decode(errors="replace")
        print(f"quickdraft: some requests failed (pass --errors FILE to keep them); the first: "
              f"{first[:300]}", file=sys.stderr)


# ---------------------------------------------------------------------- in this process


async def run_local(args: argparse.Namespace, data: bytes, endpoint: str) -> dict[str, Any]:
    """Load the model here and run the batch through the worker (no metrics: no server)."""
    notes = Progress(args.quiet)
    notes.say(f"loading model {args.model or '(the default)'} ...")
    started = time.monotonic()
    from quickdraft.engine.async_engine import AsyncLLM
    from quickdraft.server.batch_requests import LocalLink
    from quickdraft.server.batch_worker import BatchWorker
    from quickdraft.server.serve import serve_engine_config
    from quickdraft.server.settings import ServerSettings

    config = serve_engine_config(args)
    model_name = ServerSettings(engine=config, served_model_name=args.served_model_name
                                ).model_name
    llm = await asyncio.to_thread(AsyncLLM.from_config, config, progress=not args.quiet)
    notes.say(f"loaded {model_name} in {time.monotonic() - started:.1f} s")
    link = LocalLink(llm, model_name)
    with tempfile.TemporaryDirectory(prefix="quickdraft-batch-") as tmp:
        db = args.batch_db or os.path.join(tmp, "batches.sqlite3")
        worker = BatchWorker(db, link, max_in_flight=args.max_in_flight, idle_poll=0.5)
        progress = notes
        try:
            store = await worker.store()
            assert store is not None
            batch_id = await asyncio.to_thread(store.find_active_batch, data, endpoint)
            if batch_id is not None:
                progress = Progress(args.quiet, resumed=True)
                print(f"quickdraft: resuming {batch_id} from {db}", file=sys.stderr)
            else:
                name = Path(args.input).name
                file_id = (await asyncio.to_thread(store.create_file, data, name, "batch"))["id"]
                batch_id = (await asyncio.to_thread(store.create_batch, file_id, endpoint,
                                                    "24h", None, model_name))["id"]
                progress = Progress(args.quiet)  # the rate counts from here
            worker.start()
            while True:
                batch = await asyncio.to_thread(store.get_batch, batch_id)
                assert batch is not None
                progress.update(batch)
                if batch["status"] in FINAL:
                    break
                await asyncio.sleep(args.poll_interval)
            output = await _content(store, batch.get("output_file_id"))
            errors = await _content(store, batch.get("error_file_id"))
        finally:
            progress.close()
            await worker.stop()
            link.close()
            await asyncio.to_thread(llm.shutdown)
    write_results(args, output, errors)
    return batch


async def _content(store: Any, file_id: str | None) -> bytes:
    if not file_id:
        return b""
    data = await asyncio.to_thread(store.file_content, file_id)
    return data or b""


# ---------------------------------------------------------------------- against a server


def run_remote(args: argparse.Namespace, data: bytes, endpoint: str) -> dict[str, Any]:
    import httpx

    base = args.url.rstrip("/").removesuffix("/v1")
    key = args.api_key or os.environ.get("QUICKDRAFT_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    progress = Progress(args.quiet)
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        def call(method: str, path: str, **kw: Any) -> httpx.Response:
            try:
                r = client.request(method, path, **kw)
            except httpx.HTTPError as exc:
                raise RemoteError(f"{method} {base}{path}: {exc}") from exc
            if r.status_code >= 400:
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text[:300]
                raise RemoteError(f"{method} {path}: HTTP {r.status_code}: {message}")
            return r

        upload = call("POST", "/v1/files", data={"purpose": "batch"},
                      files={"file": (Path(args.input).name, data, "application/jsonl")})
        batch = call("POST", "/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": endpoint,
            "completion_window": "24h"}).json()
        try:
            while batch["status"] not in FINAL:
                progress.update(batch)
                time.sleep(args.poll_interval)
                batch = call("GET", f"/v1/batches/{batch['id']}").json()
            progress.update(batch)
        except KeyboardInterrupt:
            progress.close()
            print(f"\nquickdraft: cancelling {batch['id']}", file=sys.stderr)
            call("POST", f"/v1/batches/{batch['id']}/cancel")
            raise
        finally:
            progress.close()

        def content(file_id: str | None) -> bytes:
            return call("GET", f"/v1/files/{file_id}/content").content if file_id else b""

        write_results(args, content(batch.get("output_file_id")),
                      content(batch.get("error_file_id")))
    return batch
