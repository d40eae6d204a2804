"""The ASGI app: routes, middleware and error shapes. ``create_app`` is the one factory (the CLI
and the tests use it); the engine loads in the background once the app starts."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from quickdraft.server import openai_api
from quickdraft.server.batch_api import BatchService
from quickdraft.server.errors import ProtocolError
from quickdraft.server.gateway import EngineFactory, Gateway, default_engine_factory
from quickdraft.server.guard import LOCALHOST_ORIGIN_REGEX, Guard
from quickdraft.server.metrics import CONTENT_TYPE
from quickdraft.server.settings import ServerSettings
from quickdraft.server.ws import websocket_endpoint


def create_app(settings: ServerSettings, engine_factory: EngineFactory | None = None
               ) -> Starlette:
    """``engine_factory`` builds the AsyncLLM (in a background thread); default: from
    ``settings.engine``."""
    gw = Gateway(settings, engine_factory or default_engine_factory(settings.engine))
    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", openai_api.list_models),
        Route("/v1/models/{model:path}", openai_api.get_model),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        WebSocketRoute("/v1/ws", websocket_endpoint),
    ]
    # --- batch jobs (server/batch_api.py): routes, and the worker runs inside the lifespan ---
    batches = BatchService(settings, gw)
    routes += batches.routes()
    lifespan = batches.lifespan(gw.lifespan)
    # --- end batch jobs ---
    # --- browser chat UI (web/, docs/web.md): "/" and /static/*; open without an API key (the
    # page asks for one when /v1/ws closes with 1008). CSP: only this server's scripts run. ---
    import logging
    import re
    from pathlib import Path

    from starlette.responses import FileResponse
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    web_dir = Path(__file__).resolve().parent.parent / "web"
    if (web_dir / "index.html").is_file():
        async def chat_page(request: Request) -> Response:
            host = request.headers.get("host", "")
            ws = f" ws://{host} wss://{host}" if re.fullmatch(r"[\w.:\[\]-]+", host) else ""
            csp = ("default-src 'self'; script-src 'self'; style-src 'self'; "
                   f"img-src 'self' data:; connect-src 'self'{ws}; object-src 'none'; "
                   "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
            return FileResponse(web_dir / "index.html", headers={
                "Content-Security-Policy": csp, "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})
        routes += [Route("/", chat_page), Mount("/static", StaticFiles(directory=web_dir))]
    else:  # a broken install: say so instead of a quiet 404 at /
        logging.getLogger(__name__).error("the web UI is missing (%s); / is not served",
                                          web_dir / "index.html")
    # --- end browser chat UI ---
    middleware = [
        Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                   allow_origin_regex=LOCALHOST_ORIGIN_REGEX, allow_methods=["GET", "POST"],
                   allow_headers=["Authorization", "Content-Type"]),
        Middleware(Guard, settings=settings),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={ProtocolError: openai_api.protocol_error_handler,
                                        HTTPException: http_error, Exception: server_error})
    app.state.gateway = gw
    app.state.batches = batches
    return app


async def health(request: Request) -> Response:
    """200 once the model serves; 503 while loading, draining, or if loading failed."""
    gw: Gateway = request.app.state.gateway
    body: dict[str, Any] = {"status": gw.status, "model": gw.model_name}
    engine = getattr(gw.llm, "engine", None)
    backend = getattr(engine, "backend", None)
    if backend is not None:  # which kernels run the model, on which device, and why
        body["backend"] = backend.describe()
    weights = getattr(getattr(engine, "runner", None), "weights", None)
    if weights is not None:  # int4 (the GGUF's own blocks) or dense weights, and why
        body["weights"] = weights.describe()
    threads = getattr(engine, "threads", None)
    if threads is not None:  # CPU threads per step, and the load that chose them
        body["threads"] = threads.describe()
    describe = getattr(engine, "describe_speculation", None)
    if describe is not None:  # the default method and what drafts for it
        body["speculation"] = describe()
    if native := native_kernels(engine):  # "ok", or why a kernel fell back to torch
        body["native_kernels"] = native
        if lane := attention_lane():  # "amx", "dot" or "fp32", once loaded
            body["attention_lane"] = lane
        if missing := sorted(k for k, v in native.items() if v != "ok"):
            body["errors"] = [f"native kernel {k} unavailable: the slow torch fallback runs"
                              for k in missing]
    if gw.error:
        body["error"] = gw.error
    ready = gw.status == "ready" and gw.llm is not None and gw.llm.is_running
    return JSONResponse(body, 200 if ready else 503)


def attention_lane() -> str | None:
    """The CPU attention kernel's lane in this process: ``"amx"`` (bf16 tile multiplies, on
    CPUs with AMX-BF16), ``"dot"`` (bf16 dot products, AVX512-BF16) or ``"fp32"`` (see
    kernels.cpu_attention); None when the kernel is not loaded (e.g. an fp32 model, which
    attends in torch)."""
    from quickdraft.kernels import cpu_attention

    return cpu_attention.loaded_lane()


def native_kernels(engine: Any) -> dict[str, str]:
    """The CPU path's native kernels and their state; empty off the CPU."""
    backend = getattr(engine, "backend", None)
    if backend is None or backend.device.type != "cpu":
        return {}
    from quickdraft.kernels import cbuild

    return cbuild.status()


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    refresh = getattr(gw.llm, "refresh_stats", None)  # a remote engine's (Ray Serve)
    if refresh is not None:
        await refresh()  # poll every engine replica's stats now
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    err = ProtocolError(code, str(exc.detail), status=exc.status_code)
    return JSONResponse({"error": err.to_dict()}, exc.status_code, exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    err = ProtocolError("internal_error", "internal server error", status=500,
                        type="server_error")
    return JSONResponse({"error": err.to_dict()}, 500)
