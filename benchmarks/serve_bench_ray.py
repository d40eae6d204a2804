"""Scale-out benchmark on Ray Serve (``python benchmarks/serve_bench.py --ray``, or this file):
one engine replica against two on chat sessions that share system prompts, the prefix-cache
hit rate with replica affinity on and off, and the cost of the Ray hop against a plain
``quickdraft serve``.

Configurations, all started at once and measured in alternation (round r runs them in an
order rotated by r, so none is always first or last on a shared machine):

  plain        ``quickdraft serve``: one engine, no Ray (a subprocess)
  ray-1        the Ray Serve app (server/ray_app.py), 1 engine replica
  ray-2        2 engine replicas, affinity on (sessions and shared prompt prefixes keep a replica)
  ray-2-noaff  2 engine replicas, affinity off (``RayOptions(affinity=False)``: the router
               ignores affinity keys and sends each request to the least-loaded replica)

Every Ray configuration is its own Serve application (gateway + engines) under its own route
prefix (``/ray-1/v1/ws``...) of one local Ray; all engines have the same configuration as the
plain server (``--num-threads 1``, speculation off by default: the hop is measured, not
speculation).

Workload, per configuration and round: ``--sessions`` WebSocket chat sessions (the client
SDK's ``ChatSession``: the server keeps the conversation, each turn sends only the new
message; one connection each, so with affinity every turn of a session meets the replica that
holds its history) of ``--turns`` turns, session i on system prompt i mod ``--system-prompts``
(about ``--system-words`` words each), one session starting every ``--stagger`` seconds;
alongside them, ``--stateless``
OpenAI streaming chat calls (a system prompt and one question, no session id: the gateway keys
them by their prompt's first KV blocks) one after another. Greedy, ``ignore_eos``,
``--max-tokens`` tokens per answer. Each round's system prompts start with a fresh tag, so
every round starts from cold prefix caches and rounds of one configuration are comparable.

Measured: TTFT (send to the first token-carrying chunk), TPOT ((end - first token) /
(tokens - 1)), p50/p90 per configuration and transport; the prefix-cache hit rate = prompt
tokens found in the prefix cache / prompt tokens looked up over the round (the engines' own
counters: ``/metrics`` of the plain server, ``stats`` of each Ray replica); requests per
replica (``x-quickdraft-replica``, ``response.replica``); sticky sessions = sessions all of
whose turns one replica served.

Hop probe: ``--probe`` pairs of requests one at a time (nothing else running), alternating
plain and ray-1, over WebSocket and HTTP: the Ray hop's own TTFT and TPOT cost, no queueing.

On a 2-core machine all engines, the gateways, Ray's own processes and the load generator share
two cores: two replicas cannot run faster than one there, so this reports the hop overhead and
the hit rates; throughput scaling needs a core (or GPU) per replica and is not measured here.

Writes benchmarks/results/serve_bench_ray.json and .png, prints markdown tables::

    python benchmarks/serve_bench.py --ray                 # ~5 minutes on 2 cores

This file holds the CLI and the run (start the servers, warm up, alternate the rounds, probe,
report); beside it ``serve_bench_ray_load.py`` (the workload and its clients),
``serve_bench_ray_servers.py`` (the configurations and their servers) and
``serve_bench_ray_report.py`` (summaries, the hop overhead, tables and plot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's packages

from common import RESULTS_DIR, fmt, machine_info, machine_summary, write_json
from local_server import wait_healthy
from serve_bench_ray_load import (
    JSONDict,
    Params,
    Rec,
    Target,
    Workload,
    build_workload,
    probe,
    run_round,
)
from serve_bench_ray_report import _pct, overheads, plot, summarize, summarize_config, tables
from serve_bench_ray_servers import (
    CONFIGS,
    ENGINE_FLAGS,
    plain_counters,
    plain_server,
    ray_apps,
)

from quickdraft.server.cli import add_engine_args

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per engine")
    p.set_defaults(speculation="off", kv_cache_memory=0.25)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=6, help="WebSocket chat sessions a round")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--stagger", type=float, default=0.5,
                   help="seconds between the starts of two sessions")
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-words", type=int, default=250)
    p.add_argument("--stateless", type=int, default=6, help="OpenAI calls a round")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--probe", type=int, default=10, help="one-at-a-time requests per "
                   "(configuration, transport) for the Ray hop; 0: none")
    p.add_argument("--engine-cpus", type=float, default=0.25,
                   help="Ray CPUs reserved per engine replica (a reservation, not a limit)")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    return args


async def measure(args: argparse.Namespace, targets: list[Target]) -> JSONDict:
    p = Params(args.max_tokens, args.stagger)
    warm = Workload([(f"Warm-up {k}.", ["Hi"]) for k in range(2)],
                    [(f"Warm-up call {k}.", "Hi") for k in range(4)])
    for t in targets:  # first requests (kernel warm-up, lazy imports) are not measured
        rnd = await run_round(t, warm, p)
        if any(r["error"] for r in rnd["records"]):
            raise SystemExit(f"{t.name}: warm-up failed: {rnd['records']}")
    run_tag = f"{random.Random().getrandbits(32):08x}"
    for i in range(args.rounds):
        wl = build_workload(args, f"{run_tag}-{i}")
        for t in targets[i % len(targets):] + targets[:i % len(targets)]:
            rnd = await run_round(t, wl, p)
            t.rounds.append(rnd)
            s = summarize(rnd["records"])
            log(f"round {i + 1}/{args.rounds} {t.name:11s}: {s['n']} requests, {s['errors']} "
                f"errors, {rnd['duration_s']:.1f} s, TTFT p50 {fmt(s['ttft_ms']['p50'])} ms, "
                f"TPOT p50 {fmt(s['tpot_ms']['p50'])} ms, prefix hit rate "
                f"{_pct(rnd['hit_rate'])}")
    by_name = {t.name: t for t in targets}
    probes: dict[str, list[Rec]] = {}
    if args.probe and "plain" in by_name and "ray-1" in by_name:
        log(f"hop probe: {args.probe} requests one at a time per configuration and transport")
        probes = await probe(by_name["plain"], by_name["ray-1"], args.probe, p, run_tag)
    probe_records = {k: [asdict(r) | {"ttft": r.ttft if r.ok else None, "tpot": r.tpot}
                         for r in v] for k, v in probes.items()}
    return {"rounds": {t.name: t.rounds for t in targets},
            "probe": {k: summarize(v) for k, v in probe_records.items()},
            "probe_records": probe_records}


def main(argv: list[str] | None = None) -> JSONDict:
    args = parse_args(argv)
    info = machine_info()
    log(f"machine: {machine_summary(info)}")
    names = args.configs
    ray_names = [n for n in names if n != "plain"]
    with contextlib.ExitStack() as stack:
        plain: Target | None = None
        cmd: list[str] | None = None
        proc = None
        if "plain" in names:
            url, proc, cmd = stack.enter_context(plain_server(args))
            plain = Target("plain", 1, None, url, plain_counters(url))
            log(f"starting plain quickdraft serve at {url}")
        ray_targets: dict[str, Target] = {}
        if ray_names:
            log(f"starting a local Ray and the apps {', '.join(ray_names)} (engine replicas "
                f"{', '.join(str(CONFIGS[n][0]) for n in ray_names)})")
            ray_targets = stack.enter_context(ray_apps(args, ray_names))
        if plain is not None:
            wait_healthy(plain.url, args.server_timeout, proc)
        by_name = {**({"plain": plain} if plain else {}), **ray_targets}
        targets = [by_name[n] for n in names]
        log(f"all up; {args.rounds} rounds of {args.sessions} sessions x {args.turns} turns + "
            f"{args.stateless} stateless calls per configuration")
        measured = asyncio.run(measure(args, targets))
    log("done; servers stopped")
    summary = {n: summarize_config(measured["rounds"][n]) for n in names}
    config = {**vars(args), "results_dir": str(args.results_dir),
              "engine": {k: getattr(args, k) for k in ENGINE_FLAGS}}
    result = {"config": config, "machine": info, "plain_cmd": cmd,
              "configs": {n: {"replicas": CONFIGS[n][0], "affinity": CONFIGS[n][1]}
                          for n in names},
              "summary": summary,
              "overhead": overheads(measured["rounds"], measured["probe_records"]),
              **measured}
    name = f"serve_bench_ray{'_' + args.tag if args.tag else ''}"
    write_json(result, args.results_dir / f"{name}.json")
    plot(result, args.results_dir / f"{name}.png")
    print(tables(result))
    return result


if __name__ == "__main__":
    main()
