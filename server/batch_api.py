"""OpenAI-compatible Batch API: ``/v1/files`` (upload a JSONL input, read any file) and
``/v1/batches`` (create, retrieve, list, cancel). Jobs live in SQLite (server/batch_store.py)
and run in the background (server/batch_worker.py) at background priority; docs/batch.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from quickdraft.server.batch_cli import ENDPOINTS
from quickdraft.server.batch_store import BatchStore
from quickdraft.server.batch_worker import BatchWorker
from quickdraft.server.errors import ProtocolError, invalid, missing, wrong_type
from quickdraft.server.gateway import Gateway
from quickdraft.server.guard import tenant
from quickdraft.server.openai_api import read_json
from quickdraft.server.params import JSON, Fields
from quickdraft.server.settings import ServerSettings

COMPLETION_WINDOWS = ("24h",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MULTIPART_SLACK = 64 << 10  # bytes of multipart framing allowed beyond the file itself
Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[None]]


class BatchService:
    """The batch routes' state: the worker (which owns the store), started and stopped with the
    gateway."""

    def __init__(self, settings: ServerSettings, gateway: Gateway) -> None:
        self.settings = settings
        self.worker = BatchWorker(settings.batch_db_path, gateway,
                                  max_in_flight=settings.batch_max_in_flight,
                                  metrics=gateway.metrics)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files/{file_id}", get_file, methods=["GET"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches", list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        ]

    def lifespan(self, inner: Lifespan) -> Lifespan:
        """``inner`` (the gateway's lifespan) with the worker running inside it: the worker
        starts once the app does and stops before the engine shuts down."""

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            async with inner(app):
                self.worker.start()
                try:
                    yield
                finally:
                    await self.worker.stop()

        return lifespan


def service(request: Request) -> BatchService:
    svc: BatchService = request.app.state.batches
    return svc


async def _store(request: Request, *, create: bool = True) -> BatchStore | None:
    return await service(request).worker.store(create=create)


def _not_found(kind: str, value: str, param: str) -> ProtocolError:
    return ProtocolError(f"{kind}_not_found", f"No such {kind}: {value!r}", param, status=404)


# ---------------------------------------------------------------------- files


async def upload_file(request: Request) -> Response:
    """Multipart form: ``file`` (JSONL) and ``purpose`` ("batch")."""
    limit = service(request).settings.max_upload_size
    too_large = ProtocolError("file_too_large", f"the file exceeds the upload limit of {limit} "
                              "bytes", "file", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + MULTIPART_SLACK:
        raise too_large
    received = 0

    async def receive() -> Message:  # counts the body as it streams in (chunked uploads too)
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > limit + MULTIPART_SLACK:
            raise too_large
        return message

    form = await Request(request.scope, receive).form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose is None:
            raise missing("purpose")
        if purpose != "batch":
            raise invalid("purpose", f"only 'batch' is supported, got {purpose!r}")
        if upload is None:
            raise missing("file")
        if not isinstance(upload, UploadFile):
            raise wrong_type("file", "a file upload (multipart/form-data)")
        data = await upload.read()
    finally:
        await form.close()
    if len(data) > limit:
        raise too_large
    if not data:
        raise invalid("file", "the file is empty")
    store = await _store(request)
    assert store is not None
    name = (upload.filename or "input.jsonl")[:255]
    return JSONResponse(await asyncio.to_thread(store.create_file, data, name, "batch"))


async def _file(request: Request) -> tuple[BatchStore, JSON]:
    file_id = request.path_params["file_id"]
    store = await _store(request, create=False)
    obj = None if store is None else await asyncio.to_thread(store.get_file, file_id)
    if store is None or obj is None:
        raise _not_found("file", file_id, "file_id")
    return store, obj


async def get_file(request: Request) -> Response:
    _, obj = await _file(request)
    return JSONResponse(obj)


async def file_content(request: Request) -> Response:
    store, obj = await _file(request)
    data = await asyncio.to_thread(store.file_content, obj["id"])
    if data is None:
        raise _not_found("file", obj["id"], "file_id")
    return Response(data, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{obj["filename"]}"'})


# ---------------------------------------------------------------------- batches


async def create_batch(request: Request) -> Response:
    svc = service(request)
    f = Fields(await read_json(request, svc.settings.max_message_size))
    f.only(("input_file_id", "endpoint", "completion_window", "metadata"))
    file_id = f.string("input_file_id", required=True) or ""
    endpoint = f.string("endpoint", required=True)
    if endpoint not in ENDPOINTS:
        raise ProtocolError("unsupported_value", f"endpoint: must be one of {list(ENDPOINTS)}, "
                            f"got {endpoint!r}", "endpoint")
    window = f.string("completion_window", required=True)
    if window not in COMPLETION_WINDOWS:
        raise ProtocolError("unsupported_value", f"completion_window: must be one of "
                            f"{list(COMPLETION_WINDOWS)}, got {window!r}", "completion_window")
    metadata = _metadata(f)
    store = await _store(request)
    assert store is not None
    input_file = await asyncio.to_thread(store.get_file, file_id)
    if input_file is None:
        raise _not_found("file", file_id, "input_file_id")
    if input_file["purpose"] != "batch":
        raise invalid("input_file_id", f"file {file_id} has purpose "
                      f"{input_file['purpose']!r}; a batch input needs purpose 'batch'")
    batch = await asyncio.to_thread(store.create_batch, file_id, endpoint, window, metadata,
                                    svc.worker.link.model_name, tenant(request.scope))
    svc.worker.wake()
    return JSONResponse(batch)


def _metadata(f: Fields) -> dict[str, str] | None:
    value = f.obj.get("metadata")
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise wrong_type("metadata", f"an object of at most {MAX_METADATA_PAIRS} string pairs")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str) \
                or len(item) > MAX_METADATA_VALUE:
            raise invalid(f"metadata.{key}", f"keys are strings of at most {MAX_METADATA_KEY} "
                          f"characters, values strings of at most {MAX_METADATA_VALUE}")
    return dict(value)


async def _batch(request: Request) -> JSON:
    batch_id = request.path_params["batch_id"]
    store = await _store(request, create=False)
    batch = None if store is None else await asyncio.to_thread(store.get_batch, batch_id)
    if batch is None:
        raise _not_found("batch", batch_id, "batch_id")
    return batch


async def get_batch(request: Request) -> Response:
    return JSONResponse(await _batch(request))


async def list_batches(request: Request) -> Response:
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise invalid("limit", f"must be an integer in [1, 100], got {raw_limit!r}")
    after = request.query_params.get("after") or None
    store = await _store(request, create=False)
    page: list[JSON] = []
    more = False
    if store is not None:
        try:
            page, more = await asyncio.to_thread(store.list_batches, int(raw_limit), after)
        except KeyError:
            raise _not_found("batch", after or "", "after") from None
    elif after is not None:
        raise _not_found("batch", after, "after")
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": more})


async def cancel_batch(request: Request) -> Response:
    """``validating`` / ``in_progress`` -> ``cancelling`` (in-flight lines are aborted, the
    output keeps what finished) -> ``cancelled``. Cancelling a cancelling or cancelled batch
    changes nothing; a finished one is a 409."""
    svc = service(request)
    batch = await _batch(request)
    store = await _store(request)
    assert store is not None
    updated = await asyncio.to_thread(store.request_cancel, batch["id"])
    batch = updated or batch
    if batch["status"] not in ("cancelling", "cancelled"):
        raise ProtocolError("batch_not_cancellable", f"batch {batch['id']} is "
                            f"{batch['status']} and can no longer be cancelled", "batch_id",
                            status=409)
    svc.worker.wake()
    return JSONResponse(batch)
