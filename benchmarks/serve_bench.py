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
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's packages

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    new_figure,
    percentiles,
    save_figure,
    write_json,
)

from quickdraft.client import AsyncClient, Backoff
from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.server.cli import add_engine_args
from quickdraft.server.params import PRIORITY_CLASSES
from quickdraft.server.serve import serve_engine_config

PROMPTS_PATH = Path(__file__).resolve().parent / "prompts" / "spec_bench.json"
ENGINE_FLAGS = ("model", "dtype", "block_size", "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "seed", "draft_model",
                "speculation", "num_speculative_tokens", "num_threads")
CLASSES = ("interactive", "background")
JSONDict = dict[str, Any]


# ---------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    messages: list[dict[str, str]]
    category: str
    priority: str


def load_conversations(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    data = json.loads(path.read_text())
    return [(cat, c["messages"]) for cat, convs in data["categories"].items() for c in convs]


def build_workload(path: Path, n: int, interactive: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    convs = load_conversations(path)
    rng.shuffle(convs)
    return [Request(convs[i % len(convs)][1], convs[i % len(convs)][0],
                    "interactive" if rng.random() < interactive else "background")
            for i in range(n)]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start: gamma inter-arrival times, mean 1/rate (shape = burstiness)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return list(np.cumsum(gaps) - gaps[0])


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float
    ignore_eos: bool


# ---------------------------------------------------------------------- measurements


@dataclass
class Record:
    priority: str
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    def mark(self) -> None:
        self.token_times.append(time.perf_counter())

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


Send = Callable[[Request, Record], Awaitable[None]]


async def drive(reqs: list[Request], send: Send, offsets: list[float],
                max_concurrency: int) -> tuple[list[Record], float]:
    """Send each request at its offset (at most ``max_concurrency`` at once)."""
    slots = asyncio.Semaphore(max_concurrency)
    records = [Record(r.priority) for r in reqs]

    async def one(req: Request, rec: Record) -> None:
        async with slots:
            rec.start = time.perf_counter()
            try:
                await send(req, rec)
            except Exception as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            rec.end = time.perf_counter()

    t0 = time.perf_counter()
    tasks = []
    for req, rec, offset in zip(reqs, records, offsets, strict=True):
        if (wait := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req, rec)))
    await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0


def summarize(records: list[Record], duration: float, slo_ttft: float,
              slo_tpot: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_ms": percentiles([r.ttft for r in ok], 1e3),
        "tpot_ms": percentiles(tpots, 1e3),
        "itl_ms": percentiles([x for r in ok for x in r.itls], 1e3),
        "e2e_s": percentiles([r.end - r.start for r in ok], 1.0),
        "output_tokens": sum(r.output_tokens for r in ok),
        "throughput_tok_s": sum(r.output_tokens for r in ok) / duration,
        "request_rate": len(ok) / duration,
        "goodput_req_s": len(good) / duration,
        "slo_attainment": len(good) / len(records) if records else None,
    }


# ---------------------------------------------------------------------- transports


async def ws_send(pool: asyncio.Queue[AsyncClient], p: Params, req: Request,
                  rec: Record) -> None:
    client = await pool.get()
    try:
        stream = client.chat(req.messages, max_output_tokens=p.max_tokens,
                             temperature=p.temperature, ignore_eos=p.ignore_eos,
                             priority=req.priority)
        async for delta in stream:
            if delta.num_tokens or delta.text:
                rec.mark()
        assert stream.done is not None and stream.done.usage is not None
        rec.output_tokens = stream.done.usage.output_tokens
    finally:
        pool.put_nowait(client)


async def http_send(http: httpx.AsyncClient, p: Params, req: Request, rec: Record) -> None:
    body = {"messages": req.messages, "max_tokens": p.max_tokens, "temperature": p.temperature,
            "ignore_eos": p.ignore_eos, "priority": req.priority, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                rec.error = str(chunk["error"])[:300]
                return
            if chunk.get("usage"):
                rec.output_tokens = chunk["usage"]["completion_tokens"]
            if any("content" in (c.get("delta") or {}) and "role" not in c["delta"]
                   for c in chunk.get("choices") or []):
                rec.mark()


async def inproc_send(llm: AsyncLLM, p: Params, req: Request, rec: Record) -> None:
    ids = await asyncio.to_thread(llm.engine.apply_chat_template, req.messages)
    params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                            ignore_eos=p.ignore_eos)
    async for out in llm.generate(prompt_token_ids=ids, sampling_params=params,
                                  priority=PRIORITY_CLASSES[req.priority]):
        if out.token_ids:
            rec.mark()
        if out.finished:
            if out.finish_reason == "error":
                rec.error = out.error or "engine error"
            rec.output_tokens = out.usage.completion_tokens if out.usage else 0


@contextlib.asynccontextmanager
async def transport(name: str, args: argparse.Namespace, url: str | None,
                    llm: AsyncLLM | None) -> Any:
    """The ``send`` function of a transport, with its connections open."""
    p = Params(args.max_tokens, args.temperature, args.ignore_eos)
    if name == "inproc":
        assert llm is not None
        yield lambda req, rec: inproc_send(llm, p, req, rec)
    elif name == "http":
        assert url is not None
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=args.max_concurrency)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(600.0), trust_env=False) as http:
            yield lambda req, rec: http_send(http, p, req, rec)
    else:
        assert url is not None
        pool: asyncio.Queue[AsyncClient] = asyncio.Queue()
        clients = [AsyncClient(ws_url(url), api_key=args.api_key, proxy=None,
                               backoff=Backoff(max_attempts=3)) for _ in
                   range(args.max_concurrency)]
        await asyncio.gather(*(c.connect() for c in clients))
        for c in clients:
            pool.put_nowait(c)
        try:
            yield lambda req, rec: ws_send(pool, p, req, rec)
        finally:
            await asyncio.gather(*(c.close() for c in clients))


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/ws"


async def sweep(name: str, args: argparse.Namespace, reqs: list[Request], url: str | None,
                llm: AsyncLLM | None) -> list[dict[str, Any]]:
    runs = []
    async with transport(name, args, url, llm) as send:
        warm, _ = await drive(reqs[:args.warmup], send, [0.0] * min(args.warmup, len(reqs)), 1)
        if any(not r.ok for r in warm):
            raise SystemExit(f"{name}: warm-up failed: {[r.error for r in warm]}")
        for i, rate in enumerate(args.rates):
            offsets = arrival_offsets(len(reqs), rate, args.burstiness,
                                      args.workload_seed + i)
            records, duration = await drive(reqs, send, offsets, args.max_concurrency)
            slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
            summary = {c: summarize([r for r in records if r.priority == c], duration, *slo)
                       for c in CLASSES}
            summary["all"] = summarize(records, duration, *slo)
            errors = sorted({r.error for r in records if r.error})[:5]
            runs.append({"transport": name, "rate": rate if math.isfinite(rate) else "inf",
                         "duration_s": duration, "summary": summary, "error_samples": errors})
            s = summary["all"]
            print(f"{name:6s} rate {rate:>5}: {s['requests']} requests, {s['errors']} errors, "
                  f"TTFT p50 {fmt(s['ttft_ms']['p50'])} ms, "
                  f"TPOT p50 {fmt(s['tpot_ms']['p50'])} ms", file=sys.stderr)
    return runs


# ---------------------------------------------------------------------- idle sockets


async def idle_sockets(args: argparse.Namespace, url: str, reqs: list[Request]) -> JSONDict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    errors: list[str] = []

    async def open_idle() -> Any:
        ws = await connect(ws_url(url), additional_headers=headers, proxy=None,
                           compression=None, open_timeout=60)
        assert orjson.loads(await ws.recv())["type"] == "session.created"
        return ws

    opened = await asyncio.gather(*(open_idle() for _ in range(args.idle_sockets)),
                                  return_exceptions=True)
    idle = [ws for ws in opened if not isinstance(ws, BaseException)]
    errors += [f"open: {e!r}" for e in opened if isinstance(e, BaseException)]
    p = Params(args.max_tokens, args.temperature, args.ignore_eos)
    streaming = reqs[:args.idle_streaming] * (1 + args.idle_streaming // max(len(reqs), 1))
    async with transport("ws", argparse.Namespace(**{**vars(args), "max_concurrency":
                                                     args.idle_streaming}), url, None) as send:
        records, duration = await drive(streaming[:args.idle_streaming], send,
                                        [0.0] * args.idle_streaming, args.idle_streaming)
    errors += [f"stream: {r.error}" for r in records if not r.ok]
    await asyncio.sleep(max(0.0, args.idle_hold - duration))
    for ws in idle:
        try:
            await ws.send(orjson.dumps({"type": "session.update", "session": {}}).decode())
            reply = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
            if reply["type"] != "session.updated":
                errors.append(f"idle: {reply}")
        except Exception as exc:
            errors.append(f"idle: {exc!r}")
    await asyncio.gather(*(ws.close() for ws in idle), return_exceptions=True)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    return {"idle_sockets": args.idle_sockets, "streaming": args.idle_streaming,
            "held_s": max(args.idle_hold, duration), "errors": len(errors),
            "error_samples": errors[:10], "streaming_summary": summarize(records, duration, *slo),
            "params": asdict(p)}


# ---------------------------------------------------------------------- server process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        deadline = time.monotonic() + args.server_timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start (exit code {proc.poll()})")
            time.sleep(0.25)
        yield url, cmd
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


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
