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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

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
from quickdraft.server.cli import add_engine_args
from quickdraft.server.serve import serve_engine_config

REPLICA_HEADER = "x-quickdraft-replica"  # server/ray_app.py (imported lazily: it needs Ray)
CONFIGS: dict[str, tuple[int, bool | None]] = {  # name: (engine replicas, affinity)
    "plain": (1, None), "ray-1": (1, True), "ray-2": (2, True), "ray-2-noaff": (2, False)}
ENGINE_FLAGS = ("model", "dtype", "block_size", "kv_cache_memory", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "seed", "speculation",
                "num_speculative_tokens", "num_threads")
JSONDict = dict[str, Any]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- workload

PERSONAS = (
    "You are Atlas, the travel-planning assistant of a small agency that books trains, "
    "ferries and family-run hotels across Europe.",
    "You are Quill, the code-review assistant of a Python team that maintains a web service "
    "and its command-line tools.",
    "You are Sage, a cooking and nutrition assistant for people who cook at home on weekdays "
    "with little time and a small budget.",
    "You are Ledger, the bookkeeping assistant of a cooperative of independent craftspeople.",
)
RULES = (
    "Answer in plain language and keep every answer short unless asked for details.",
    "Ask one clarifying question when a request is ambiguous, then wait for the answer.",
    "Never invent prices, opening hours, versions or quantities you have not been given.",
    "When you list options, give at most three and say which one you would choose and why.",
    "Prefer concrete steps over general advice, and number the steps when there are several.",
    "If the user seems to be in a hurry, lead with the answer and put the reasons after it.",
    "Say so plainly when something is outside what you can help with.",
    "Use metric units and the twenty-four hour clock unless the user uses others.",
    "Do not repeat the question back to the user before answering it.",
    "Keep a friendly, calm tone, and never use more than one exclamation mark per answer.",
    "When the user corrects you, thank them briefly and use the correction from then on.",
    "Point out risks and trade-offs, but do not lecture the user about them.",
    "If earlier messages in the conversation settle a question, rely on them.",
    "Write dates as day, month name and year, for example 4 March 2026.",
    "When a request involves other people, respect their privacy and their choices.",
    "Summarise long answers in one sentence at the end, starting with 'In short'.",
    "Avoid jargon; when a technical term is needed, explain it the first time you use it.",
    "If you are unsure, say how sure you are instead of guessing silently.",
    "Do not recommend a product or a company by name unless the user asks for one.",
    "Keep code, commands and file names in backticks so that they stand out.",
)
QUESTIONS = (
    "What should I plan first?", "Can you give me a quick checklist?",
    "What is the most common mistake here?", "How long will this take, roughly?",
    "What would you do differently on a tight budget?", "Can you explain that last step again?",
    "Is there a simpler way?", "What should I check before I start?",
    "Which of your options is the safest?", "Can you summarise our plan so far?",
    "What could go wrong, and how would I notice?", "What is a good first small step today?",
)


def system_prompts(count: int, words: int, tag: str) -> list[str]:
    """``count`` distinct system prompts of about ``words`` words, each starting with ``tag``
    (a fresh tag per round: nothing of an earlier round is in any prefix cache)."""
    prompts = []
    for k in range(count):
        rules = list(RULES)
        random.Random(k).shuffle(rules)
        text = [f"Deployment {tag}, profile {k}.", PERSONAS[k % len(PERSONAS)], "Rules:"]
        i = 0
        while len(" ".join(text).split()) < words:
            text.append(f"{i + 1}. {rules[i % len(rules)]}")
            i += 1
        prompts.append(" ".join(text))
    return prompts


@dataclass(frozen=True)
class Workload:
    sessions: list[tuple[str, list[str]]]  # (system prompt, user turns)
    stateless: list[tuple[str, str]]  # (system prompt, question)


def build_workload(args: argparse.Namespace, tag: str) -> Workload:
    prompts = system_prompts(args.system_prompts, args.system_words, tag)
    q = len(QUESTIONS)
    sessions = [(prompts[i % len(prompts)],
                 [QUESTIONS[(i * args.turns + t) % q] for t in range(args.turns)])
                for i in range(args.sessions)]
    stateless = [(prompts[j % len(prompts)], QUESTIONS[(5 * j + 3) % q])
                 for j in range(args.stateless)]
    return Workload(sessions, stateless)


# ---------------------------------------------------------------------- measurements


@dataclass
class Rec:
    transport: str  # ws | http
    session: int = -1  # WebSocket session (-1: a stateless call)
    turn: int = 0
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # HTTP usage only (the WebSocket usage has none)
    replica: str | None = None
    error: str | None = None

    def mark(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    @property
    def ok(self) -> bool:
        return self.error is None and self.first is not None

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)


@dataclass(frozen=True)
class Params:
    max_tokens: int
    stagger: float = 0.0  # seconds between two sessions' starts


@dataclass
class Target:
    """One configuration as the load generator sees it."""

    name: str
    replicas: int
    affinity: bool | None  # None: the plain server
    url: str  # http://host:port[/app]
    counters: Callable[[], Awaitable[dict[str, tuple[int, int]]]]  # replica -> (queries, hits)
    rounds: list[JSONDict] = field(default_factory=list)

    @property
    def ws(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/ws"


async def ws_turns(url: str, system: str, turns: list[str], p: Params, session: int,
                   out: list[Rec], delay: float = 0.0) -> None:
    """One chat session on its own socket, opened after ``delay`` seconds: ``turns`` user
    messages, one answer each."""
    await asyncio.sleep(delay)
    client = AsyncClient(url, proxy=None, backoff=Backoff(max_attempts=3))
    chat = client.session(system)
    try:
        await chat.start()
        for turn, text in enumerate(turns):
            rec = Rec("ws", session, turn, start=time.perf_counter())
            out.append(rec)
            try:
                stream = chat.chat(text, max_output_tokens=p.max_tokens, temperature=0.0,
                                   ignore_eos=True)
                async for delta in stream:
                    if delta.num_tokens or delta.text:
                        rec.mark()
                rec.end = time.perf_counter()
                done = stream.done
                assert done is not None
                if done.status != "completed" or done.usage is None:
                    rec.error = f"{done.status}: {done.status_details}"[:300]
                    return
                rec.tokens, rec.prompt_tokens = done.usage.output_tokens, done.usage.input_tokens
                rec.replica = done.raw["response"].get("replica") or "local"
            except Exception as exc:
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
                return
    finally:
        with contextlib.suppress(Exception):
            await chat.close()
        await client.close()


async def http_call(http: httpx.AsyncClient, messages: list[dict[str, str]], p: Params,
                    rec: Rec) -> None:
    """One streamed OpenAI chat completion (no session id)."""
    body = {"messages": messages, "max_tokens": p.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rec.start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            rec.replica = r.headers.get(REPLICA_HEADER, "local")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    return
                if usage := chunk.get("usage"):
                    rec.tokens, rec.prompt_tokens = (usage["completion_tokens"],
                                                     usage["prompt_tokens"])
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens")
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    rec.mark()
    except Exception as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end = time.perf_counter()


def http_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), trust_env=False)


async def run_round(target: Target, wl: Workload, p: Params) -> JSONDict:
    """The workload once against ``target``: its records, hit rate and replicas."""
    before = await target.counters()
    recs: list[Rec] = []

    async def stateless(http: httpx.AsyncClient) -> None:
        for system, question in wl.stateless:
            rec = Rec("http")
            recs.append(rec)
            await http_call(http, [{"role": "system", "content": system},
                                   {"role": "user", "content": question}], p, rec)

    t0 = time.perf_counter()
    async with http_client(target.url) as http:
        await asyncio.gather(stateless(http), *(
            ws_turns(target.ws, system, turns, p, i, recs, i * p.stagger)
            for i, (system, turns) in enumerate(wl.sessions)))
    duration = time.perf_counter() - t0
    after = await target.counters()
    per_replica = {r: {"queries": q - before.get(r, (0, 0))[0],
                       "hits": h - before.get(r, (0, 0))[1]} for r, (q, h) in after.items()}
    queries = sum(v["queries"] for v in per_replica.values())
    hits = sum(v["hits"] for v in per_replica.values())
    return {"duration_s": duration, "prefix_queries": queries, "prefix_hits": hits,
            "hit_rate": hits / queries if queries else None, "per_replica": per_replica,
            "records": [asdict(r) | {"ttft": r.ttft if r.ok else None, "tpot": r.tpot}
                        for r in recs]}


async def probe(plain: Target, ray1: Target, n: int, p: Params, tag: str) -> dict[str, list[Rec]]:
    """``n`` rounds of one request at a time per (configuration, transport), alternating."""
    out: dict[str, list[Rec]] = {f"{t.name}/{tr}": [] for t in (plain, ray1)
                                 for tr in ("ws", "http")}
    clients = {t.name: AsyncClient(t.ws, proxy=None, backoff=Backoff(max_attempts=3))
               for t in (plain, ray1)}
    https = {t.name: http_client(t.url) for t in (plain, ray1)}
    try:
        for i in range(n):
            text = f"Probe {tag}-{i}. {QUESTIONS[i % len(QUESTIONS)]}"
            for t in ((plain, ray1) if i % 2 == 0 else (ray1, plain)):
                rec = Rec("ws", start=time.perf_counter())
                try:
                    stream = clients[t.name].chat(text, max_output_tokens=p.max_tokens,
                                                  temperature=0.0, ignore_eos=True)
                    async for delta in stream:
                        if delta.num_tokens or delta.text:
                            rec.mark()
                    rec.end = time.perf_counter()
                    assert stream.done is not None and stream.done.usage is not None
                    rec.tokens = stream.done.usage.output_tokens
                    rec.replica = stream.done.raw["response"].get("replica") or "local"
                except Exception as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"[:300]
                out[f"{t.name}/ws"].append(rec)
                rec = Rec("http")
                await http_call(https[t.name], [{"role": "user", "content": text}], p, rec)
                out[f"{t.name}/http"].append(rec)
    finally:
        for c in clients.values():
            await c.close()
        for h in https.values():
            await h.aclose()
    return out


# ---------------------------------------------------------------------- servers


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not become healthy (exit code "
                             f"{proc.poll() if proc else None})")
        time.sleep(0.25)


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
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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


# ---------------------------------------------------------------------- report


def summarize(recs: list[JSONDict]) -> JSONDict:
    ok = [r for r in recs if r["error"] is None and r["ttft"] is not None]
    return {"n": len(recs), "errors": len(recs) - len(ok),
            "ttft_ms": percentiles([r["ttft"] for r in ok], 1e3),
            "tpot_ms": percentiles([r["tpot"] for r in ok if r["tpot"] is not None], 1e3),
            "output_tokens": sum(r["tokens"] for r in ok)}


def summarize_config(rounds: list[JSONDict]) -> JSONDict:
    recs = [r for rnd in rounds for r in rnd["records"]]
    ws = [r for r in recs if r["transport"] == "ws"]
    replicas: Counter[str] = Counter(r["replica"] for r in recs if r["replica"])
    sessions: dict[tuple[int, int], set[str]] = {}
    for i, rnd in enumerate(rounds):
        for r in rnd["records"]:
            if r["transport"] == "ws" and r["replica"]:
                sessions.setdefault((i, r["session"]), set()).add(r["replica"])
    queries = sum(rnd["prefix_queries"] for rnd in rounds)
    hits = sum(rnd["prefix_hits"] for rnd in rounds)
    per_replica: dict[str, JSONDict] = {}
    for rnd in rounds:
        for name, v in rnd["per_replica"].items():
            mine = per_replica.setdefault(name, {"queries": 0, "hits": 0})
            mine["queries"] += v["queries"]
            mine["hits"] += v["hits"]
    for name, mine in per_replica.items():
        mine["requests"] = replicas.get(name, 0)
        mine["hit_rate"] = mine["hits"] / mine["queries"] if mine["queries"] else None
    return {
        "all": summarize(recs), "ws": summarize(ws),
        "ws_first_turn": summarize([r for r in ws if r["turn"] == 0]),
        "ws_later_turns": summarize([r for r in ws if r["turn"] > 0]),
        "http": summarize([r for r in recs if r["transport"] == "http"]),
        "hit_rate": hits / queries if queries else None,
        "hit_rate_rounds": [rnd["hit_rate"] for rnd in rounds],
        "prefix_queries": queries, "prefix_hits": hits,
        "http_cached_tokens": sum(r["cached_tokens"] or 0 for r in recs
                                  if r["transport"] == "http"),
        "per_replica": per_replica,
        "requests_per_replica": sorted(replicas.values(), reverse=True),
        "sticky_sessions": (sum(len(s) == 1 for s in sessions.values()) / len(sessions)
                            if sessions else None),
        "tok_s_rounds": [sum(r["tokens"] for r in rnd["records"]) / rnd["duration_s"]
                         for rnd in rounds],
    }


def hop(base: JSONDict, ray: JSONDict) -> JSONDict:
    """Ray against plain: TTFT p50 (ms added, ratio), TPOT p50 (ratio)."""
    bt, rt = base["ttft_ms"]["p50"], ray["ttft_ms"]["p50"]
    bp, rp = base["tpot_ms"]["p50"], ray["tpot_ms"]["p50"]
    return {"ttft_p50_plain_ms": bt, "ttft_p50_ray_ms": rt,
            "ttft_p50_added_ms": rt - bt if None not in (bt, rt) else None,
            "ttft_p50_ratio": rt / bt if bt and rt is not None else None,
            "tpot_p50_plain_ms": bp, "tpot_p50_ray_ms": rp,
            "tpot_p50_ratio": rp / bp if bp and rp is not None else None}


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _of(rounds: JSONDict | list[JSONDict], transport: str) -> JSONDict:
    """The summary of one round's (or several rounds') requests over ``transport``."""
    rounds = rounds if isinstance(rounds, list) else [rounds]
    return summarize([r for rnd in rounds for r in rnd["records"] if r["transport"] == transport])


def overheads(rounds: dict[str, list[JSONDict]], probes: dict[str, list[JSONDict]]
              ) -> list[JSONDict]:
    """The Ray hop (ray-1 against plain) per transport: one request at a time (the probe;
    ``paired``: medians over adjacent pairs of the same prompt) and under the chat workload
    (``paired``: medians of the per-round p50 differences and ratios: both ran each round)."""
    rows = []
    for tr in ("ws", "http"):
        base, ray = probes.get(f"plain/{tr}"), probes.get(f"ray-1/{tr}")
        if base is None or ray is None:
            continue
        pairs = [(b, r) for b, r in zip(base, ray, strict=True)
                 if b["ttft"] is not None and r["ttft"] is not None]
        rows.append({"where": "probe (one at a time)", "transport": tr,
                     **hop(summarize(base), summarize(ray)),
                     "paired_ttft_added_ms": _median([1e3 * (r["ttft"] - b["ttft"])
                                                      for b, r in pairs]),
                     "paired_tpot_ratio": _median([r["tpot"] / b["tpot"] for b, r in pairs
                                                   if b["tpot"] and r["tpot"]])})
    if "plain" in rounds and "ray-1" in rounds:
        for tr in ("ws", "http"):
            per_round = [hop(_of(b, tr), _of(r, tr))
                         for b, r in zip(rounds["plain"], rounds["ray-1"], strict=True)]
            rows.append({"where": "chat workload", "transport": tr,
                         **hop(_of(rounds["plain"], tr), _of(rounds["ray-1"], tr)),
                         "paired_ttft_added_ms": _median([h["ttft_p50_added_ms"]
                                                          for h in per_round
                                                          if h["ttft_p50_added_ms"] is not None]),
                         "paired_tpot_ratio": _median([h["tpot_p50_ratio"] for h in per_round
                                                       if h["tpot_p50_ratio"] is not None])})
    return rows


def tables(result: JSONDict) -> str:
    rows = []
    for name, s in result["summary"].items():
        replicas, affinity = CONFIGS[name]
        rows.append([name, replicas, "-" if affinity is None else "on" if affinity else "off",
                     s["all"]["n"], s["all"]["errors"], s["all"]["ttft_ms"]["p50"],
                     s["all"]["ttft_ms"]["p90"], s["ws_later_turns"]["ttft_ms"]["p50"],
                     s["all"]["tpot_ms"]["p50"], s["all"]["tpot_ms"]["p90"],
                     _pct(s["hit_rate"]),
                     " ".join(_pct(h) for h in s["hit_rate_rounds"]),
                     "/".join(map(str, s["requests_per_replica"])),
                     _pct(s["sticky_sessions"]), float(np.median(s["tok_s_rounds"]))])
    text = markdown_table(
        ["config", "replicas", "affinity", "n", "err", "TTFT p50 ms", "TTFT p90 ms",
         "TTFT p50 later turns ms", "TPOT p50 ms", "TPOT p90 ms", "prefix hit rate",
         "per round", "requests/replica", "sticky sessions", "tok/s"], rows)
    if result["overhead"]:
        text += "\n\nRay hop (ray-1 against plain, p50):\n\n" + markdown_table(
            ["where", "transport", "TTFT plain ms", "TTFT ray ms", "TTFT +ms", "TTFT ratio",
             "paired TTFT +ms", "TPOT plain ms", "TPOT ray ms", "TPOT ratio",
             "paired TPOT ratio"],
            [[o["where"], o["transport"], o["ttft_p50_plain_ms"], o["ttft_p50_ray_ms"],
              o["ttft_p50_added_ms"], o["ttft_p50_ratio"], o["paired_ttft_added_ms"],
              o["tpot_p50_plain_ms"], o["tpot_p50_ray_ms"], o["tpot_p50_ratio"],
              o["paired_tpot_ratio"]] for o in result["overhead"]])
        text += ("\n\npaired: probe = median over adjacent same-prompt pairs; chat workload = "
                 "median over rounds of the per-round p50s")
    return text


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def plot(result: JSONDict, path: Path) -> None:
    fig, axes = new_figure(13, 4.2, ncols=3)
    names = list(result["summary"])
    xs = np.arange(len(names))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms), chat workload"),
                           (axes[1], "tpot_ms", "TPOT (ms), chat workload")):
        for k, (q, alpha) in enumerate((("p50", 0.9), ("p90", 0.45))):
            vals = [result["summary"][n]["all"][key][q] or np.nan for n in names]
            ax.bar(xs + (k - 0.5) * 0.38, vals, 0.38, alpha=alpha, color="C0", label=q)
        ax.set_title(title)
    ax = axes[2]
    rates = [100 * (result["summary"][n]["hit_rate"] or 0) for n in names]
    ax.bar(xs, rates, 0.6, color="C2", alpha=0.8, label="all rounds")
    for i, n in enumerate(names):
        per = [100 * h for h in result["summary"][n]["hit_rate_rounds"] if h is not None]
        ax.plot([i] * len(per), per, "k.", label="per round" if i == 0 else None)
    ax.set_ylim(0, 100)
    ax.set_title("prefix-cache hit rate (% of prompt tokens)")
    for ax in axes:
        ax.set_xticks(xs, names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    over = {(o["where"], o["transport"]): o for o in result["overhead"]}
    probe_ws = over.get(("probe (one at a time)", "ws"))
    if probe_ws and probe_ws["paired_ttft_added_ms"] is not None:
        fig.suptitle(f"Ray hop (ray-1 vs plain), one request at a time over WebSocket: TTFT "
                     f"{probe_ws['paired_ttft_added_ms']:+.1f} ms, TPOT x"
                     f"{fmt(probe_ws['paired_tpot_ratio'])} (paired medians)", fontsize=10)
    save_figure(fig, path)


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
