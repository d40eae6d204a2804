"""The load ``benchmarks/serve_bench.py`` sends and measures: the workload and its arrival
times, each request's record and their summary, the three transports (WebSocket through the
client SDK, HTTP/SSE, ``AsyncLLM`` in-process), the sweep of one transport over the rates, and
the idle-sockets check."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from common import fmt, percentiles
from local_server import sse_chunks
from websockets.asyncio.client import connect

from quickdraft.client import AsyncClient, Backoff
from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.server.params import PRIORITY_CLASSES

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
        async for chunk in sse_chunks(r):
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

