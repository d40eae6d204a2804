"""The load generator of ``benchmarks/serve_bench_ray.py``: the chat workload (personas, rules,
questions, tagged system prompts, the sessions and stateless calls of a round), the records and
targets it measures, and the clients that drive it (WebSocket chat sessions, streamed OpenAI
calls, one round against a configuration, the one-at-a-time hop probe)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from local_server import sse_chunks

from quickdraft.client import AsyncClient, Backoff

REPLICA_HEADER = "x-quickdraft-replica"  # server/ray_app.py (imported lazily: it needs Ray)
JSONDict = dict[str, Any]


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
            async for chunk in sse_chunks(r):
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

