"""``quickdraft batch INPUT.jsonl -o OUTPUT.jsonl``: run a file of requests in OpenAI's Batch API
format, against a server (``--url``: upload, create, poll, download) or in this process (the
same store and worker as the server, at background priority). docs/batch.md."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FINAL = ("completed", "failed", "cancelled", "expired")


def add_batch_parser(sub: Any) -> None:
    """Add ``batch`` to the ``quickdraft`` subcommands."""
    from quickdraft.server.cli import add_engine_args  # the CLI module imports this one

    p = sub.add_parser("batch", help="run a JSONL file of requests (OpenAI Batch API format), "
                       "locally or on a server")
    p.add_argument("input", help="JSONL: one {custom_id, method, url, body} request per line")
    p.add_argument("-o", "--output", required=True, help="where the answers go (JSONL)")
    p.add_argument("--errors", default=None,
                   help="where failed requests go (JSONL; default: only a summary on stderr)")
    p.add_argument("--endpoint", default=None,
                   choices=["/v1/chat/completions", "/v1/completions"],
                   help="default: the url of the first request line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between progress checks")
    r = p.add_argument_group("on a server")
    r.add_argument("--url", default=None,
                   help="the server, e.g. http://127.0.0.1:8000 (without it the batch runs "
                        "in this process)")
    r.add_argument("--api-key", default=None, help="API key (also $QUICKDRAFT_API_KEY)")
    loc = p.add_argument_group("in this process (no --url)")
    loc.add_argument("--batch-db", default=None,
                     help="keep the job in this SQLite file: a run that was stopped resumes "
                          "where it stopped (default: a temporary file)")
    loc.add_argument("--max-in-flight", type=int, default=8,
                     help="requests in the engine at once (default 8)")
    loc.add_argument("--served-model-name", default=None,
                     help="the model name request bodies may give")
    loc.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
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
    from quickdraft.server.batch_worker import detect_endpoint

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


class Progress:
    def __init__(self, quiet: bool) -> None:
        self._bar: Any = None
        self._quiet = quiet

    def update(self, batch: dict[str, Any]) -> None:
        counts = batch.get("request_counts") or {}
        total = counts.get("total") or 0
        if self._quiet or not total:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", desc=batch["id"], file=sys.stderr)
        done = counts.get("completed", 0) + counts.get("failed", 0)
        self._bar.set_postfix(failed=counts.get("failed", 0), refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
    from quickdraft.engine.async_engine import AsyncLLM
    from quickdraft.server.batch_worker import BatchWorker, LocalLink
    from quickdraft.server.serve import serve_engine_config
    from quickdraft.server.settings import ServerSettings

    config = serve_engine_config(args)
    model_name = ServerSettings(engine=config, served_model_name=args.served_model_name
                                ).model_name
    llm = await asyncio.to_thread(AsyncLLM.from_config, config, progress=not args.quiet)
    link = LocalLink(llm, model_name)
    with tempfile.TemporaryDirectory(prefix="quickdraft-batch-") as tmp:
        db = args.batch_db or os.path.join(tmp, "batches.sqlite3")
        worker = BatchWorker(db, link, max_in_flight=args.max_in_flight, idle_poll=0.5)
        progress = Progress(args.quiet)
        try:
            store = await worker.store()
            assert store is not None
            batch_id = await asyncio.to_thread(store.find_active_batch, data, endpoint)
            if batch_id is not None:
                print(f"quickdraft: resuming {batch_id} from {db}", file=sys.stderr)
            else:
                name = Path(args.input).name
                file_id = (await asyncio.to_thread(store.create_file, data, name, "batch"))["id"]
                batch_id = (await asyncio.to_thread(store.create_batch, file_id, endpoint,
                                                    "24h", None, model_name))["id"]
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
