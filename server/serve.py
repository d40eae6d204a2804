"""``quickdraft serve``: command-line wiring (the server itself is in server.runner, imported
only when the command runs, so other subcommands start without uvicorn)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.server.settings import ServerSettings, SettingsError, read_api_key_file

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
API_KEY_ENV = "QUICKDRAFT_API_KEY"


def add_serve_parser(sub: Any) -> None:
    """Add ``serve`` to the ``quickdraft`` subcommands."""
    from quickdraft.server.cli import add_engine_args  # the CLI module imports this one

    p = sub.add_parser("serve",
                       help="serve the WebSocket gateway and the OpenAI-compatible HTTP API")
    add_engine_args(p)
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads per step (default: all cores, fewer while other "
                   "processes keep them busy)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=_DEFAULTS["host"],
                   help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=_DEFAULTS["port"], help="TCP port")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients use and /v1/models shows (default: the "
                   "model's name, e.g. SmolLM2-135M-Instruct)")
    s.add_argument("--api-key", action="append", default=[],
                   help=f"accepted API key (repeatable; also ${API_KEY_ENV}; default: none, "
                   "no authentication)")
    s.add_argument("--api-key-file", default=None,
                   help="file with one API key per line (# comments)")
    s.add_argument("--allowed-origins", action="append", default=[],
                   help="browser origins allowed besides same-origin and localhost "
                        "(comma-separated, repeatable; * allows any)")
    for name, help_text in (
            ("max_connections", "open WebSocket sessions"),
            ("max_responses_per_connection", "concurrent responses on one WebSocket"),
            ("max_inflight_requests", "engine requests in flight, all clients"),
            ("max_message_size", "bytes per WebSocket message / HTTP body"),
            ("max_conversation_items", "items per WebSocket conversation")):
        s.add_argument("--" + name.replace("_", "-"), type=int, default=_DEFAULTS[name],
                       help=f"{help_text} (default {_DEFAULTS[name]})")
    s.add_argument("--drain-timeout", type=float, default=_DEFAULTS["drain_timeout"],
                   help="seconds in-flight answers get to finish on SIGTERM")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's and quickdraft's log level")
    # --- batch jobs (docs/batch.md) ---
    b = p.add_argument_group("batch jobs")
    b.add_argument("--batch-db", default=None,
                   help="SQLite file for batch jobs (default: batches.sqlite3 in "
                        "$QUICKDRAFT_CACHE or ~/.cache/quickdraft)")
    b.add_argument("--batch-max-in-flight", type=int, default=_DEFAULTS["batch_max_in_flight"],
                   help="batch requests in the engine at once "
                        f"(default {_DEFAULTS['batch_max_in_flight']})")
    b.add_argument("--max-upload-size", type=int, default=_DEFAULTS["max_upload_size"],
                   help=f"bytes per uploaded file (default {_DEFAULTS['max_upload_size']})")
    # --- end batch jobs ---
    r = p.add_argument_group("scale-out on Ray Serve (docs/scale-out.md; pip install "
                             "'quickdraft[ray]')")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: one gateway, --replicas engine replicas")
    r.add_argument("--replicas", type=int, default=1, help="engine replicas with --ray "
                   "(default 1)")
    r.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one)")
    p.set_defaults(func=run_serve)


def serve_engine_config(args: argparse.Namespace) -> EngineConfig:
    from quickdraft.server.cli import engine_config

    return dataclasses.replace(engine_config(args), num_threads=args.num_threads)


def serve_settings(args: argparse.Namespace) -> ServerSettings:
    keys = list(args.api_key)
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    origins = [o.strip() for value in args.allowed_origins for o in value.split(",")
               if o.strip()]
    return ServerSettings(
        engine=serve_engine_config(args), host=args.host, port=args.port,
        served_model_name=args.served_model_name, api_keys=tuple(keys),
        allowed_origins=tuple(origins), max_connections=args.max_connections,
        max_responses_per_connection=args.max_responses_per_connection,
        max_inflight_requests=args.max_inflight_requests,
        max_message_size=args.max_message_size,
        max_conversation_items=args.max_conversation_items,
        drain_timeout=args.drain_timeout, log_level=args.log_level,
        **batch_settings(args))


def batch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The batch-job settings from the flags (the database path only when given)."""
    kw: dict[str, Any] = {"batch_max_in_flight": args.batch_max_in_flight,
                          "max_upload_size": args.max_upload_size}
    if args.batch_db:
        kw["batch_db_path"] = args.batch_db
    return kw


def run_serve(args: argparse.Namespace) -> int:
    try:
        settings = serve_settings(args)
    except (SettingsError, ConfigError) as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2
    if args.ray:
        try:
            from quickdraft.server.ray_app import serve_on_ray
        except ImportError as exc:
            print(f"quickdraft: error: --ray needs Ray Serve ({exc}); pip install "
                  "'quickdraft[ray]'", file=sys.stderr)
            return 2
        return serve_on_ray(settings, replicas=args.replicas, address=args.ray_address)
    from quickdraft.server.runner import serve

    return serve(settings)
