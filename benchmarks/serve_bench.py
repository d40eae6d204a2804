"""Load benchmark of the gateway: WebSocket (the client SDK) and HTTP/SSE (OpenAI-compatible
streaming) against ``quickdraft serve``, and the same load against ``AsyncLLM`` in-process
(no gateway) as the baseline that gives the gateway's overhead.

Workload: the chat conversations of ``benchmarks/prompts/spec_bench.json`` (8 categories x 3,
one or several turns), shuffled with ``--workload-seed`` and cycled to ``--num-requests``; greedy,
at most ``--max-tokens`` new tokens. Each request is ``interactive`` with probability
``--interactive-fraction``, else ``background`` (the ``priority`` field). Arrivals are a
gamma process at ``--rate`` requests/s (``--burstiness`` 1 = Poisson, < 1 burstier; ``inf`` =
all at once), at most ``--max-concurrency`` in flight (a request waiting for a slot has not
started: its TTFT counts from when it is sent). Every transport gets the same requests,
priorities and arrival times at each rate.

Per request: TTFT = send to the first chunk carrying tokens; E2E = send to the end; TPOT =
(E2E - TTFT) / (output tokens - 1); ITL = gaps between token-carrying chunks (a WebSocket
delta or an SSE chunk may carry several tokens: speculation, and WebSocket deltas merge while
the client lags). p50/p90/p99 per priority class and overall; throughput = output tokens / s
of the run; goodput = requests / s that met both ``--slo-ttft-ms`` and ``--slo-tpot-ms``.
Overhead = gateway p50 minus in-process p50 at the same rate (TTFT in ms, TPOT in %).

Idle-sockets mode (``--idle-sockets N --idle-streaming M``): N sockets that only hold their
session, M sockets streaming one answer each at once, idle ones held ``--idle-hold`` s (past
a 20 s keepalive ping), then every idle socket must still answer a ``session.update``; any
failure counts as an error (goal: 256 + 32 with zero errors).

The server is started here (``quickdraft serve`` on a free port, ``/health`` polled) unless
``--url`` names one. Writes benchmarks/results/serve_bench.json and serve_bench.png, prints
markdown tables. Full run on the default model (tens of minutes on a 2-core CPU)::

    python benchmarks/serve_bench.py --rates 0.5,1,2,4 --num-requests 64 \
        --idle-sockets 256 --idle-streaming 32

``--ray`` runs the scale-out benchmark instead (benchmarks/serve_bench_ray.py: plain
``quickdraft serve`` against Ray Serve with one and two engine replicas, affinity on and off;
the other flags are that script's, see ``--ray --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's packages

from common import (
    RESULTS_DIR,
    machine_info,
    machine_summary,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
)
from local_server import free_port, stop_server, wait_healthy
from serve_bench_load import CLASSES, JSONDict, Request, build_workload, idle_sockets, sweep

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.server.cli import add_engine_args
from quickdraft.server.serve import serve_engine_config

PROMPTS_PATH = Path(__file__).resolve().parent / "prompts" / "spec_bench.json"
ENGINE_FLAGS = ("model", "dtype", "block_size", "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "seed", "draft_model",
                "speculation", "num_speculative_tokens", "num_threads")


# ---------------------------------------------------------------------- server process


@contextlib.contextmanager
def server_process(args: argparse.Namespace) -> Iterator[tuple[str, list[str]]]:
    """``quickdraft serve`` on a free port until /health says 200; (base URL, command)."""
    port = free_port()
    conns = max(256, args.idle_sockets + args.idle_streaming + args.max_concurrency) + 16
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--drain-timeout", "5",
           "--max-connections", str(conns), "--max-inflight-requests",
           str(max(64, args.max_concurrency, args.idle_streaming))]
    for name in ENGINE_FLAGS:
        if (value := getattr(args, name)) is not None:
            cmd += ["--" + name.replace("_", "-"), str(value)]
    if not args.prefix_caching:  # transports rerun the same prompts: keep them all cold
        cmd.append("--no-prefix-caching")
    cpus = args.server_cpus
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, args.server_timeout, proc)
        yield url, cmd
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------- report


def overhead(runs: list[JSONDict]) -> list[JSONDict]:
    """Gateway p50 against in-process p50 at the same rate."""
    base = {r["rate"]: r["summary"]["all"] for r in runs if r["transport"] == "inproc"}
    rows = []
    for r in runs:
        b, s = base.get(r["rate"]), r["summary"]["all"]
        if r["transport"] == "inproc" or b is None or None in (
                s["ttft_ms"]["p50"], b["ttft_ms"]["p50"], s["tpot_ms"]["p50"],
                b["tpot_ms"]["p50"]):
            continue
        rows.append({"transport": r["transport"], "rate": r["rate"],
                     "ttft_p50_ms": s["ttft_ms"]["p50"] - b["ttft_ms"]["p50"],
                     "tpot_p50_pct": 100 * (s["tpot_ms"]["p50"] / b["tpot_ms"]["p50"] - 1)})
    return rows


def tables(runs: list[JSONDict], over: list[JSONDict], idle: JSONDict | None) -> str:
    rows = []
    for r in runs:
        for cls in ("all", *CLASSES):
            s = r["summary"][cls]
            rows.append([r["transport"], r["rate"], cls, s["requests"], s["errors"],
                         s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["tpot_ms"]["p50"],
                         s["tpot_ms"]["p99"], s["itl_ms"]["p99"], s["e2e_s"]["p50"],
                         s["throughput_tok_s"], s["goodput_req_s"]])
    text = markdown_table(["transport", "rate", "class", "n", "err", "TTFT p50 ms",
                           "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
                           "E2E p50 s", "tok/s", "goodput req/s"], rows)
    if over:
        text += "\n\nGateway overhead (p50, against in-process at the same rate):\n\n"
        text += markdown_table(["transport", "rate", "TTFT +ms", "TPOT +%"],
                               [[o["transport"], o["rate"], o["ttft_p50_ms"], o["tpot_p50_pct"]]
                                for o in over])
    if idle is not None:
        text += (f"\n\nIdle sockets: {idle['idle_sockets']} idle + {idle['streaming']} "
                 f"streaming, held {idle['held_s']:.0f} s: {idle['errors']} errors")
    return text


def plot(runs: list[JSONDict], path: Path) -> None:
    fig, ax = new_figure(11, 4.5)
    ax.remove()
    axes = fig.subplots(1, 2)
    for i, name in enumerate(dict.fromkeys(r["transport"] for r in runs)):
        mine = [r for r in runs if r["transport"] == name]
        xs = [r["rate"] if r["rate"] != "inf" else r["summary"]["all"]["request_rate"]
              for r in mine]  # all at once: the rate achieved
        for ax_, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            for q, style in (("p50", "-o"), ("p99", ":x")):
                ax_.plot(xs, [r["summary"]["all"][key][q] or np.nan for r in mine], style,
                         color=f"C{i}", label=f"{name} {q}")
    for ax_, title in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax_.set_xlabel("request rate (req/s)")
        ax_.set_title(title)
        ax_.grid(alpha=0.3)
        ax_.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--ray", action="store_true", help="run the Ray Serve scale-out benchmark "
                   "(benchmarks/serve_bench_ray.py) instead; --ray --help for its flags")
    p.add_argument("--url", default=None, help="a running server (http://HOST:PORT); "
                   "default: start one (in-process baseline needs the local model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--transports", default="ws,http,inproc")
    p.add_argument("--rates", default="0.5,1,2,4", help="requests/s, comma-separated; inf ok")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--interactive-fraction", type=float, default=0.5)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=Path, default=PROMPTS_PATH)
    p.add_argument("--idle-sockets", type=int, default=0)
    p.add_argument("--idle-streaming", type=int, default=32)
    p.add_argument("--idle-hold", type=float, default=25.0)
    p.add_argument("--server-cpus", default=None, help="pin the server (and the in-process "
                   "baseline) to these cores, e.g. 0 or 0-1")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--workload-seed", type=int, default=0,
                   help="shuffles prompts, draws priorities and arrivals (--seed is the engine's)")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.transports = args.transports.split(",")
    args.server_cpus = _cpus(args.server_cpus)
    return args


def _cpus(spec: str | None) -> set[int] | None:
    if not spec:
        return None
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


async def run_all(args: argparse.Namespace, reqs: list[Request]) -> JSONDict:
    runs: list[JSONDict] = []
    idle, cmd = None, None
    gateway = [t for t in args.transports if t in ("ws", "http")]
    if gateway or args.idle_sockets:
        with contextlib.ExitStack() as stack:
            url = args.url or None
            if url is None:
                url, cmd = stack.enter_context(server_process(args))
            for name in gateway:
                runs += await sweep(name, args, reqs, url, None)
            if args.idle_sockets:
                idle = await idle_sockets(args, url, reqs)
                print(f"idle sockets: {idle['errors']} errors", file=sys.stderr)
    if "inproc" in args.transports:
        if args.server_cpus:
            os.sched_setaffinity(0, args.server_cpus)
        llm = AsyncLLM.from_config(serve_engine_config(args), progress=False)
        try:
            runs += await sweep("inproc", args, reqs, None, llm)
        finally:
            llm.shutdown()
    return {"runs": runs, "idle": idle, "server_cmd": cmd}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--ray" in argv:  # the scale-out benchmark: its own flags
        import serve_bench_ray

        serve_bench_ray.main([a for a in argv if a != "--ray"])
        return
    args = parse_args(argv)
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)
    reqs = build_workload(args.prompts, args.num_requests, args.interactive_fraction,
                          args.workload_seed)
    result = asyncio.run(run_all(args, reqs))
    over = overhead(result["runs"])
    config = {**vars(args), "prompts": str(args.prompts),
              "server_cpus": sorted(args.server_cpus) if args.server_cpus else None,
              "rates": [r if math.isfinite(r) else "inf" for r in args.rates]}
    name = f"serve_bench{'_' + args.tag if args.tag else ''}"
    write_json({"config": config, "machine": info, **result, "overhead": over},
               RESULTS_DIR / f"{name}.json")
    if result["runs"]:
        plot(result["runs"], RESULTS_DIR / f"{name}.png")
    print(tables(result["runs"], over, result["idle"]))


if __name__ == "__main__":
    main()
