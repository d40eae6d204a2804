"""Scale-out on Ray Serve: the gateway deployment, the application builders and
``quickdraft serve --ray``.

::

    clients ── Serve HTTP proxy ──▶ QuickdraftGateway (our Starlette app, N ≥ 1)
                                        │ RemoteLLM: tokenizes locally, keys each request
                                        ▼ (AffinityRouter picks the replica)
                                    QuickdraftEngine replicas (one AsyncLLM each)

The gateway deployment serves the unchanged app of :func:`server.app.create_app`; its engine
factory builds a :class:`RemoteLLM` over the engine deployment's handle. A middleware around
the app (:class:`ReplicaTagging`) gives the proxy each call's session key and writes back which
replica answered: the ``x-quickdraft-replica`` header (and ``x-quickdraft-cached-tokens``,
the prompt tokens served by the replica's prefix cache, when the answer is complete before its
headers go out) and ``response.replica`` in the WebSocket ``response.done`` event.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs

import orjson
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.engine import loader
from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.config import EngineConfig
from quickdraft.server.affinity import DEFAULT_KEY_BLOCKS, session_key
from quickdraft.server.app import create_app
from quickdraft.server.gateway import EngineFactory
from quickdraft.server.ray_engine import STREAM_INTERVAL, EngineReplica
from quickdraft.server.ray_proxy import CALL_SCOPE, CallScope, LocalFrontend, RemoteLLM
from quickdraft.server.ray_router import ROUTER_PATH
from quickdraft.server.settings import ServerSettings

APP_NAME = "quickdraft"
ENGINE_DEPLOYMENT = "QuickdraftEngine"
GATEWAY_DEPLOYMENT = "QuickdraftGateway"
REPLICA_HEADER = "x-quickdraft-replica"
CACHED_TOKENS_HEADER = "x-quickdraft-cached-tokens"
SESSION_HEADER = "x-session-id"
ENGINE_WAIT = 900.0  # seconds a new gateway waits for its first engine replica


# ---------------------------------------------------------------------- middleware


def call_key(scope: Scope) -> str | None:
    """The affinity key of an HTTP request or WebSocket connection: ``x-session-id``, else
    ``?session=`` (WebSocket only), else one fresh key per WebSocket connection; HTTP requests
    without a session get None (the proxy keys them by their prompt's prefix)."""
    for name, value in scope.get("headers", []):
        if name == SESSION_HEADER.encode() and value.strip():
            return session_key(value.decode("latin-1").strip())
    if scope["type"] != "websocket":
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("session") and query["session"][0].strip():
        return session_key(query["session"][0].strip())
    return session_key("ws-" + uuid.uuid4().hex)


class ReplicaTagging:
    """ASGI middleware of the gateway deployment: opens a :class:`CallScope` per HTTP request
    or WebSocket connection and names the serving replica in what goes back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        call = CallScope(call_key(scope))
        token = CALL_SCOPE.set(call)

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                tag_headers(message, call)
            elif message["type"] == "websocket.send" and message.get("text"):
                message = {**message, "text": tag_done(message["text"], call)}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            CALL_SCOPE.reset(token)


def tag_headers(message: Message, call: CallScope) -> None:
    rid = call.last_request
    if rid is None:
        return
    headers = MutableHeaders(scope=message)
    headers[REPLICA_HEADER] = call.replicas[rid]
    if rid in call.cached_tokens:
        headers[CACHED_TOKENS_HEADER] = str(call.cached_tokens[rid])


def tag_done(text: str, call: CallScope) -> str:
    """``response.replica`` added to a ``response.done`` event (other events pass as they
    are); the replica is that of the response's engine request (None if it never ran)."""
    if '"response.done"' not in text:
        return text
    event = orjson.loads(text)
    response = event.get("response")
    if event.get("type") != "response.done" or not isinstance(response, dict):
        return text
    rid = str(response.get("id"))
    response["replica"] = call.replicas.pop(rid, None)
    call.cached_tokens.pop(rid, None)
    return orjson.dumps(event).decode()


# ---------------------------------------------------------------------- deployments


def remote_engine_factory(handle: Any, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                          key_blocks: int = DEFAULT_KEY_BLOCKS) -> EngineFactory:
    """The gateway's engine factory (run in its loading thread): waits for an engine replica,
    loads the tokenizer locally and returns the proxy."""

    def build() -> AsyncLLM:
        info = handle.info.remote().result(timeout_s=ENGINE_WAIT)
        model_dir = Path(info["model_dir"])
        if not (model_dir / "config.json").is_file():  # another node: resolve it here
            model_dir = loader.resolve_model(config.model, progress=False)
        frontend = LocalFrontend(loader.load_tokenizer(model_dir), info["max_model_len"])
        proxy = RemoteLLM(handle, frontend, block_size=info["block_size"], loop=loop,
                          key_blocks=key_blocks)
        return cast(AsyncLLM, proxy)  # the same duck type: the gateway calls nothing else

    return build


@serve.ingress()
class GatewayIngress:
    """The gateway deployment: our Starlette app (built in the replica, after __init__), its
    engine a :class:`RemoteLLM` of the engine deployment ``engine``."""

    def __init__(self, settings: ServerSettings, engine: Any,
                 key_blocks: int = DEFAULT_KEY_BLOCKS) -> None:
        self.settings = settings
        self.engine_handle = engine
        self.key_blocks = key_blocks

    async def __serve_build_asgi_app__(self) -> ASGIApp:
        loop = asyncio.get_running_loop()
        factory = remote_engine_factory(self.engine_handle, self.settings.engine, loop,
                                        self.key_blocks)
        return ReplicaTagging(create_app(self.settings, factory))


@dataclass(frozen=True)
class RayOptions:
    """How the app is laid out on Ray: engine replicas (fixed, or autoscaled between
    ``min_replicas`` and ``max_replicas``), resources per replica, streaming and affinity."""

    replicas: int = 1
    min_replicas: int | None = None  # both set: autoscaling instead of ``replicas``
    max_replicas: int | None = None
    engine_cpus: float = 1.0
    engine_gpus: float = 0.0
    gateway_cpus: float = 0.25
    gateway_replicas: int = 1
    stream_interval: float = STREAM_INTERVAL
    key_blocks: int = DEFAULT_KEY_BLOCKS
    affinity: bool = True  # False: the router ignores affinity keys (least-loaded only)


def engine_limits(config: EngineConfig) -> tuple[int, int]:
    """(soft, hard) requests in flight per engine replica: the router prefers another
    replica beyond ``soft`` (the engine's batch, ``max_num_seqs``); Serve sends none beyond
    ``hard``, which leaves room for queued requests and control calls."""
    soft = config.max_num_seqs
    return soft, 2 * soft + 8


def autoscaling(config: EngineConfig, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """Serve's autoscaling_config: scale out when replicas average 3/4 of a full batch."""
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": max(1, math.ceil(0.75 * config.max_num_seqs))}


def drain_options(drain_timeout: float) -> dict[str, Any]:
    """Serve's graceful shutdown for ``--drain-timeout``: a replica that stops (scale-down,
    redeploy, ``serve.delete``) takes no new requests and lets those in flight finish for up
    to ``drain_timeout`` seconds before Serve kills it, checking every tenth of that (0.1 to
    1 s: an idle replica stops within one check)."""
    return {"graceful_shutdown_timeout_s": drain_timeout,
            "graceful_shutdown_wait_loop_s": min(1.0, max(0.1, drain_timeout / 10))}


def serve_logging(level: str) -> dict[str, Any]:
    """The deployments' logging_config for ``quickdraft serve --log-level``: Serve's access log
    only at info and below."""
    level = {"trace": "debug"}.get(level, level)
    return {"log_level": level.upper(), "enable_access_log": level in ("info", "debug")}


def build_app(settings: ServerSettings, opts: RayOptions = RayOptions()) -> Any:
    """The Serve application (``serve.run(build_app(...))``): gateway -> engine replicas."""
    cfg = settings.engine
    soft, hard = engine_limits(cfg)
    logs = serve_logging(settings.log_level)
    scale: dict[str, Any] = {"num_replicas": opts.replicas}
    if opts.min_replicas is not None and opts.max_replicas is not None:
        scale = {"autoscaling_config": autoscaling(cfg, opts.min_replicas, opts.max_replicas)}
    router: dict[str, Any] = {"request_router_class": ROUTER_PATH,
                              "request_router_kwargs": {"soft_limit": soft,
                                                        "affinity": opts.affinity}}
    drain = drain_options(settings.drain_timeout)
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT, **scale, max_ongoing_requests=hard, health_check_period_s=10,
        ray_actor_options={"num_cpus": opts.engine_cpus, "num_gpus": opts.engine_gpus},
        request_router_config=RequestRouterConfig(**router), logging_config=logs, **drain,
    )(EngineReplica).bind(cfg, opts.stream_interval)
    gateway = serve.deployment(
        name=GATEWAY_DEPLOYMENT, num_replicas=opts.gateway_replicas,
        max_ongoing_requests=settings.max_connections + settings.max_inflight_requests,
        ray_actor_options={"num_cpus": opts.gateway_cpus}, logging_config=logs, **drain,
    )(GatewayIngress)
    return gateway.bind(settings, engine, opts.key_blocks)


def app_builder(args: dict[str, Any]) -> Any:
    """``import_path`` for ``serve run`` / ``serve deploy`` configs (docs/scale-out.md):
    ``args`` has optional ``engine`` (EngineConfig fields), ``server`` (ServerSettings
    fields) and ``ray`` (RayOptions fields) mappings."""
    server = dict(args.get("server") or {})
    for key in ("api_keys", "allowed_origins"):
        if key in server:
            server[key] = tuple(server[key])
    settings = ServerSettings(engine=EngineConfig(**(args.get("engine") or {})), **server)
    return build_app(settings, RayOptions(**(args.get("ray") or {})))


# ---------------------------------------------------------------------- quickdraft serve --ray


def serve_on_ray(settings: ServerSettings, *, replicas: int = 1,
                 address: str | None = None) -> int:
    """``quickdraft serve --ray``: start a local Ray (or join ``address``), run the app with
    ``replicas`` engine replicas (one GPU each when the cluster has GPUs and the engine may
    use one), print the URLs and serve until SIGINT/SIGTERM; the exit status."""
    import signal
    import sys
    import threading

    import ray

    if replicas < 1:
        print(f"quickdraft: error: --replicas must be >= 1, got {replicas}", file=sys.stderr)
        return 2
    level = logging.getLevelNamesMapping()[serve_logging(settings.log_level)["log_level"]]
    ray.init(address=address, logging_level=level)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        opts = ray_options(settings.engine, replicas, ray.cluster_resources())
        print(f"quickdraft: starting {replicas} engine replica(s) of {settings.model_name} on "
              f"Ray ({opts.engine_cpus:g} CPU, {opts.engine_gpus:g} GPU each)", file=sys.stderr,
              flush=True)
        try:
            serve.run(build_app(settings, opts), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # a deployment failed (its replica logs say why)
            print(f"quickdraft: error: the Serve app failed to start: {exc}", file=sys.stderr)
            return 2
        print(urls(settings), flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        print("quickdraft: stopping the Serve app", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
        return 0
    finally:
        if address is None:  # the Ray we started
            serve.shutdown()
            ray.shutdown()


def ray_options(config: EngineConfig, replicas: int, resources: dict[str, float]) -> RayOptions:
    """``replicas`` engine replicas: one GPU each when the cluster has one and the engine's
    device allows CUDA; ``num_threads`` CPUs each when set, else an even share of the
    cluster's CPUs (at most 1; Ray's CPUs are a reservation, not a limit)."""
    gpus = 1.0 if resources.get("GPU", 0) >= 1 and config.device != "cpu" else 0.0
    gateway = RayOptions.gateway_cpus
    share = math.floor(100 * (resources.get("CPU", 1.0) - gateway) / replicas) / 100
    cpus = float(config.num_threads) if config.num_threads else min(1.0, share)
    return RayOptions(replicas=replicas, engine_cpus=max(cpus, 0.01), engine_gpus=gpus)


def urls(settings: ServerSettings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    base = f"{host}:{settings.port}"
    return (f"quickdraft: serving {settings.model_name} on Ray Serve at http://{base}\n"
            f"  WebSocket        ws://{base}/v1/ws  (?session=ID or x-session-id: sticky)\n"
            f"  OpenAI base URL  http://{base}/v1\n"
            f"  health, metrics  http://{base}/health, /metrics (engine series per replica)\n"
            f"  replicas         response header {REPLICA_HEADER}, response.done replica")
