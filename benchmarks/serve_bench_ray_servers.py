"""The servers of ``benchmarks/serve_bench_ray.py``: its configurations, a plain
``quickdraft serve`` subprocess, the Ray Serve applications on a local Ray, their health checks
and the prefix-cache counters of each."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from local_server import free_port, stop_server, wait_healthy
from serve_bench_ray_load import Target

from quickdraft.server.serve import serve_engine_config

CONFIGS: dict[str, tuple[int, bool | None]] = {  # name: (engine replicas, affinity)
    "plain": (1, None), "ray-1": (1, True), "ray-2": (2, True), "ray-2-noaff": (2, False)}
ENGINE_FLAGS = ("model", "dtype", "block_size", "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "seed", "speculation",
                "num_speculative_tokens", "num_threads")


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for name in ENGINE_FLAGS:
        if (value := getattr(args, name)) is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


@contextlib.contextmanager
def plain_server(args: argparse.Namespace) -> Iterator[tuple[str, subprocess.Popen[bytes],
                                                            list[str]]]:
    """``quickdraft serve`` on a free port (started, not yet waited for)."""
    port = free_port()
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", "--drain-timeout", "5", *engine_flags(args)]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent)
    try:
        yield f"http://127.0.0.1:{port}", proc, cmd
    finally:
        stop_server(proc)


@contextlib.contextmanager
def ray_apps(args: argparse.Namespace, names: list[str]) -> Iterator[dict[str, Target]]:
    """A local Ray, Serve's proxy on a free port and one application per Ray configuration
    (gateway + engine replicas) under the route prefix ``/<name>``."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from quickdraft.server.ray_app import ENGINE_DEPLOYMENT, RayOptions, build_app
    from quickdraft.server.settings import ServerSettings

    settings = ServerSettings(engine=serve_engine_config(args), log_level="warning")
    gateway_cpus = 0.25
    need = sum(CONFIGS[n][0] * args.engine_cpus + gateway_cpus for n in names)
    ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build_app(settings, RayOptions(
            replicas=CONFIGS[n][0], affinity=bool(CONFIGS[n][1]), engine_cpus=args.engine_cpus,
            gateway_cpus=gateway_cpus)), name=n, route_prefix=f"/{n}") for n in names])
        targets = {}
        for n in names:
            handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, n)

            async def counters(handle: Any = handle) -> dict[str, tuple[int, int]]:
                stats = await asyncio.to_thread(
                    lambda: handle.broadcast("stats").results(timeout_s=60))
                return {s["replica"]: (s["prefix_cache_queries"], s["prefix_cache_hits"])
                        for s in stats}

            url = f"http://127.0.0.1:{port}/{n}"
            wait_healthy(url, args.server_timeout)
            targets[n] = Target(n, CONFIGS[n][0], CONFIGS[n][1], url, counters)
        yield targets
    finally:
        serve.shutdown()
        ray.shutdown()


def plain_counters(url: str) -> Callable[[], Awaitable[dict[str, tuple[int, int]]]]:
    async def counters() -> dict[str, tuple[int, int]]:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            text = (await http.get(f"{url}/metrics")).text
        values = {}
        for line in text.splitlines():
            for name in ("prefix_cache_queries", "prefix_cache_hits"):
                if line.startswith(f"quickdraft:{name}_total"):
                    values[name] = int(float(line.split()[-1]))
        return {"local": (values["prefix_cache_queries"], values["prefix_cache_hits"])}

    return counters

