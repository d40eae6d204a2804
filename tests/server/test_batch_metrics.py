"""Batch lines in the request-level metrics: a batch run on a real server (uvicorn, tiny model)
moves request_success, the token counters and the latency histograms of
``priority="background"`` by exactly its lines and usage; an interactive chat completion
moves ``priority="interactive"``; the label only takes the priority classes' names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from quickdraft.engine.outputs import Usage
from quickdraft.server.metrics import GatewayMetrics, priority_class
from tests.server.conftest import TIMEOUT, Served, make_settings, serve, tiny_factory
from tests.server.test_batch_api import chat_line, jsonl, submit, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
N_LINES = 5
HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds",
              "time_per_output_token_seconds", "request_queue_time_seconds")


@pytest.fixture(scope="module")
def mserved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    db = tmp_path_factory.mktemp("batch-metrics") / "batches.sqlite3"
    with serve(make_settings(batch_db_path=str(db), batch_max_in_flight=4),
               tiny_factory(tiny_model_dir, num_kv_blocks=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def http(mserved: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mserved.http, timeout=TIMEOUT) as client:
        yield client


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(http: httpx.Client) -> Samples:
    return parse(http.get("/metrics").text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def test_batch_lines_count_as_background_requests(http):
    lines = [chat_line(f"m{i}", f"Count to {i}.", max_tokens=3 + i) for i in range(N_LINES)]
    bad = chat_line("bad", "hi", temperature=5000)  # answered 400 before the engine: not counted
    before = scrape(http)
    batch = wait_for(http, submit(http, jsonl(*lines, bad))["id"])
    after = scrape(http)
    assert batch["request_counts"] == {"total": N_LINES + 1, "completed": N_LINES, "failed": 1}

    bg = {"priority": "background"}
    assert moved(before, after, "quickdraft:request_success_total", **bg) == N_LINES
    assert moved(before, after, "quickdraft:request_success_total", finished_reason="length",
                 **bg) == N_LINES
    usage = batch["usage"]
    assert moved(before, after, "quickdraft:prompt_tokens_total", **bg) == usage["input_tokens"]
    assert moved(before, after, "quickdraft:generation_tokens_total", **bg) \
        == usage["output_tokens"] == sum(3 + i for i in range(N_LINES))
    for name in HISTOGRAMS:
        assert moved(before, after, f"quickdraft:{name}_count", **bg) == N_LINES, name
    # nothing of it landed in the interactive series
    for name in ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
                 "e2e_request_latency_seconds_count"):
        assert moved(before, after, f"quickdraft:{name}", priority="interactive") == 0, name


def test_chat_completion_counts_as_interactive(http):
    before = scrape(http)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = scrape(http)
    it = {"priority": "interactive"}
    assert moved(before, after, "quickdraft:request_success_total", finished_reason="length",
                 **it) == 1
    assert moved(before, after, "quickdraft:generation_tokens_total", **it) == 6
    assert moved(before, after, "quickdraft:prompt_tokens_total", **it) \
        == r.json()["usage"]["prompt_tokens"]
    assert moved(before, after, "quickdraft:time_to_first_token_seconds_count", **it) == 1
    assert moved(before, after, "quickdraft:request_success_total",
                 priority="background") == 0


def test_background_priority_over_http_and_websocket_counts_as_background(http, mserved):
    before = scrape(http)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4,
        "temperature": 0, "ignore_eos": True, "priority": "background"})
    assert r.status_code == 200, r.text

    async def over_ws() -> None:
        async with websockets.connect(mserved.ws_url) as ws:
            await ws.send(json.dumps({"type": "conversation.item.create",
                                      "item": {"role": "user", "content": "Hi"}}))
            await ws.send(json.dumps({"type": "response.create", "response": {
                "max_output_tokens": 4, "temperature": 0, "priority": "background"}}))
            while True:
                event = orjson.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                assert event["type"] != "error", event
                if event["type"] == "response.done":
                    assert event["response"]["status"] == "completed", event
                    break

    asyncio.run(over_ws())
    after = scrape(http)
    assert moved(before, after, "quickdraft:request_success_total", priority="background") == 2
    assert moved(before, after, "quickdraft:request_success_total", priority="interactive") == 0


def test_priority_label_takes_only_class_names():
    assert [priority_class(n) for n in (-5, 0, 3, 10, 99)] == \
        ["interactive", "interactive", "interactive", "background", "background"]
    m = GatewayMetrics("tiny", lambda: None)
    fresh = parse(m.render().decode())
    for cls in ("interactive", "background"):  # both series exist before any request
        assert total(fresh, "quickdraft:prompt_tokens_total", priority=cls) == 0
        assert ("quickdraft:prompt_tokens_total",
                frozenset({("model_name", "tiny"), ("priority", cls)})) in fresh
    m.observe(Usage(4, 3, ttft=0.1, decode_time=0.2), "stop", 0.3, priority=10)
    after = parse(m.render().decode())
    assert after[("quickdraft:request_success_total", frozenset(
        {("model_name", "tiny"), ("finished_reason", "stop"), ("priority", "background")}))] == 1
    assert total(after, "quickdraft:generation_tokens_total", priority="interactive") == 0
