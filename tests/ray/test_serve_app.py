"""The Ray Serve app end to end: a local Ray (2 CPUs), the gateway and TWO engine replicas of
the tiny random model, real HTTP, SSE and WebSocket clients through Serve's proxy."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from quickdraft.engine.config import EngineConfig  # noqa: E402
from quickdraft.server.ray_app import (  # noqa: E402
    APP_NAME,
    CACHED_TOKENS_HEADER,
    ENGINE_DEPLOYMENT,
    REPLICA_HEADER,
    RayOptions,
    build_app,
)
from quickdraft.server.ray_stats import SCRAPE_TIMEOUT  # noqa: E402
from quickdraft.server.settings import ServerSettings  # noqa: E402
from tests.server.conftest import (  # noqa: E402
    ENGINE_KW,
    LONG,
    SHORT,
    collect,
    of_type,
    recv_until,
    respond,
    say,
    send,
    session,
    wait_healthy,
    ws_open,
)

START_TIMEOUT = 120.0  # seconds for Ray, Serve and three replicas on 2 busy cores
ENDLESS = 6000  # tokens: ~20 s of answer, so an abort is told from a natural finish
ABORT_WAIT = 5.0  # seconds for an abort to free a replica's blocks


@dataclass
class Cluster:
    base: str
    engine: Any  # DeploymentHandle of the engine deployment

    @property
    def ws_url(self) -> str:
        return self.base.replace("http://", "ws://") + "/v1/ws"

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each engine replica's stats, by replica id."""
        return {s["replica"]: s for s in self.engine.broadcast("stats").results(timeout_s=30)}

    def wait_idle(self, baseline: dict[str, int], timeout: float = 10.0) -> None:
        """Until every replica runs nothing and has ``baseline`` free KV blocks again."""
        deadline = time.monotonic() + timeout
        while True:
            now = {r: (s["num_running"] + s["num_waiting"], s["num_free_blocks"])
                   for r, s in self.stats().items()}
            if all(now.get(r) == (0, free) for r, free in baseline.items()):
                return
            assert time.monotonic() < deadline, f"not idle: {now}, baseline {baseline}"
            time.sleep(0.1)

    def free_blocks(self) -> dict[str, int]:
        return {r: s["num_free_blocks"] for r, s in self.stats().items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def long_context_copy(model_dir: Path, dest: Path) -> Path:
    """The tiny model with an 8192-token context (rotary positions need no weights)."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return dest


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = long_context_copy(tiny_model_dir, tmp_path_factory.mktemp("ray") / "tiny-8k")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = EngineConfig(model=str(model), **{**ENGINE_KW, "num_kv_blocks": 512})
        settings = ServerSettings(engine=engine, served_model_name="tiny", log_level="warning")
        opts = RayOptions(replicas=2, engine_cpus=0.25, gateway_cpus=0.25)
        serve.run(build_app(settings, opts), name=APP_NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, START_TIMEOUT)
        yield Cluster(base, serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME))
    finally:
        serve.shutdown()
        ray.shutdown()


def ws_answers(url: str, turns: int, **kw: Any) -> list[dict[str, Any]]:
    """``turns`` short answers on one connection; their response.done events."""
    done = []
    with ws_open(url, **kw) as ws:
        session(ws)
        for i in range(turns):
            say(ws, f"Turn {i}: tell me more.")
            _, event, _ = collect(ws, respond(ws, **SHORT))
            assert event["response"]["status"] == "completed", event
            done.append(event)
    return done


# ---------------------------------------------------------------------- routing


def test_two_replicas_share_keyless_traffic(cluster):
    replicas = set(cluster.stats())
    assert len(replicas) == 2
    seen = []
    for i in range(12):  # different first tokens: different prefix keys
        r = httpx.post(f"{cluster.base}/v1/completions", timeout=60,
                       json={"prompt": f"{i * 7919} apples", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        seen.append(r.headers[REPLICA_HEADER])
    assert set(seen) == replicas


def test_a_websocket_session_stays_on_one_replica(cluster):
    done = ws_answers(cluster.ws_url, 4)
    replicas = {e["response"]["replica"] for e in done}
    assert len(replicas) == 1 and None not in replicas
    # A named session keeps its replica across connections, by header or by query.
    by_query = ws_answers(cluster.ws_url + "?session=alice", 2)
    again = ws_answers(cluster.ws_url + "?session=alice", 2)
    by_header = ws_answers(cluster.ws_url, 2, additional_headers={"x-session-id": "alice"})
    assert len({e["response"]["replica"] for e in by_query + again + by_header}) == 1


def test_a_shared_prefix_meets_one_prefix_cache(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0)
    system = "You are a careful assistant. " + "Always answer in full sentences. " * 20
    replicas, cached = set(), []
    for question in ("What is a cat?", "Why is the sky blue?", "Name a prime.", "Hi!"):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}])
        assert raw.parse().usage.prompt_tokens > 100
        replicas.add(raw.headers[REPLICA_HEADER])
        cached.append(int(raw.headers[CACHED_TOKENS_HEADER]))
    assert len(replicas) == 1
    assert all(n >= 64 for n in cached[1:]), cached  # the system prompt's blocks


def test_engine_errors_come_back_as_from_one_engine(cluster):
    r = httpx.post(f"{cluster.base}/v1/completions", timeout=60,
                   json={"prompt": [10**9], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def scrape(base: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The gateway's /metrics: sample name -> {sorted labels (no model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base}/metrics", timeout=30)
    assert r.status_code == 200
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples.setdefault(s.name, {})[labels] = s.value
    return samples


def per_replica(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    return {dict(labels)["replica"]: value for labels, value in samples.items()}


def test_metrics_have_a_series_per_replica_that_add_up(cluster):
    replicas = set(cluster.stats())
    before = scrape(cluster.base)
    seen = set()
    for i in range(12):  # different first tokens: different prefix keys, both replicas
        r = httpx.post(f"{cluster.base}/v1/completions", timeout=60,
                       json={"prompt": f"{i * 104729} pears", "max_tokens": 3})
        assert r.status_code == 200, r.text
        seen.add(r.headers[REPLICA_HEADER])
    after = scrape(cluster.base)
    assert seen == replicas and len(replicas) == 2
    assert per_replica(after["quickdraft:replica_up"]) == {r: 1.0 for r in replicas}
    for name in ("quickdraft:num_requests_running", "quickdraft:kv_cache_usage_perc",
                 "quickdraft:num_preemptions_total", "quickdraft:prefix_cache_hits_total"):
        assert set(per_replica(after[name])) == replicas, name  # one series each, no sum
    # Each replica's prompt tokens (looked up in its prefix cache on admission) add up to the
    # prompt tokens the gateway counted for the same requests.
    queries = per_replica(after["quickdraft:prefix_cache_queries_total"])
    earlier = per_replica(before["quickdraft:prefix_cache_queries_total"])
    grown = {r: queries[r] - earlier.get(r, 0.0) for r in replicas}
    prompt = [sum(snap["quickdraft:prompt_tokens_total"].values()) for snap in (before, after)]
    assert all(n > 0 for n in grown.values()), grown
    assert sum(grown.values()) == prompt[1] - prompt[0] > 0
    stats = cluster.stats()
    assert queries == {r: float(s["prefix_cache_queries"]) for r, s in stats.items()}


# ---------------------------------------------------------------------- streaming


def test_streaming_over_websocket_and_sse(cluster):
    with ws_open(cluster.ws_url) as ws:
        session(ws)
        say(ws, "Count with me.")
        text, done, deltas = collect(ws, respond(ws, max_output_tokens=40, temperature=0,
                                                 ignore_eos=True))
    assert len(deltas) >= 1 and text == done["response"]["output"][0]["content"][0]["text"]
    assert done["response"]["usage"]["output_tokens"] == 40 and done["response"]["replica"]
    body = {"prompt": "Count", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER]
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_response_cancel_reaches_the_replica(cluster):
    baseline = cluster.free_blocks()
    with ws_open(cluster.ws_url) as ws:
        session(ws)
        say(ws, "Go on and on.")
        rid = respond(ws, **{**LONG, "max_output_tokens": ENDLESS})
        recv_until(ws, of_type("response.output_text.delta", response_id=rid))
        send(ws, {"type": "response.cancel", "response_id": rid})
        _, done, _ = collect(ws, rid)
    assert done["response"]["status"] == "cancelled" and done["response"]["replica"]
    cluster.wait_idle(baseline, ABORT_WAIT)


@pytest.mark.parametrize("how", ["websocket", "sse", "whole"])
def test_a_dropped_client_frees_the_remote_blocks(cluster, how):
    baseline = cluster.free_blocks()
    if how == "websocket":
        with ws_open(cluster.ws_url) as ws:
            session(ws)
            say(ws, "Go on and on.")
            rid = respond(ws, **{**LONG, "max_output_tokens": ENDLESS})
            recv_until(ws, of_type("response.output_text.delta", response_id=rid))
            ws.socket.shutdown(socket.SHUT_RDWR)  # vanish without a closing handshake
    elif how == "sse":
        body = {"prompt": "Go", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.base}/v1/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: ")
    else:  # a client that gives up on a whole (non-streamed) answer
        queries = sum(s["prefix_cache_queries"] for s in cluster.stats().values())
        body = {"prompt": "Go", "max_tokens": ENDLESS, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{cluster.base}/v1/completions", json=body, timeout=1.0)
        after = sum(s["prefix_cache_queries"] for s in cluster.stats().values())
        assert after > queries  # an engine replica had started it
    cluster.wait_idle(baseline, ABORT_WAIT)  # long before the answer could have finished


def engine_processes() -> list[Any]:
    """The engine replicas' worker processes of the Ray this test process started (its
    descendants; Ray titles a worker by its actor class)."""
    psutil = pytest.importorskip("psutil")
    title = f"ray::ServeReplica:{APP_NAME}:{ENGINE_DEPLOYMENT}"
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith(title):
                found.append(proc)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def test_a_replica_that_does_not_answer_is_left_out_and_reported_down(cluster):
    import signal

    replicas = set(cluster.stats())
    procs = engine_processes()
    assert len(procs) == 2, [p.cmdline()[0] for p in procs]
    procs[0].send_signal(signal.SIGSTOP)  # frozen: alive to Serve, silent to the poll
    try:
        start = time.monotonic()
        frozen = scrape(cluster.base)
        took = time.monotonic() - start
    finally:
        procs[0].send_signal(signal.SIGCONT)
    assert took < SCRAPE_TIMEOUT + 3.0  # the frozen replica did not hold the scrape
    up = per_replica(frozen["quickdraft:replica_up"])
    assert set(up) == replicas and sorted(up.values()) == [0.0, 1.0]
    (silent,) = [r for r, v in up.items() if v == 0]
    assert set(per_replica(frozen["quickdraft:num_requests_running"])) == replicas - {silent}
    thawed = scrape(cluster.base)
    assert per_replica(thawed["quickdraft:replica_up"]) == {r: 1.0 for r in replicas}


# ---------------------------------------------------------------------- failure (last: it
# leaves Serve restarting a replica)


def test_a_killed_replica_fails_its_answer_cleanly(cluster):
    stats = cluster.stats()
    with ws_open(cluster.ws_url) as ws:
        session(ws)
        say(ws, "Go on and on.")
        rid = respond(ws, **{**LONG, "max_output_tokens": ENDLESS})  # running when killed
        recv_until(ws, of_type("response.output_text.delta", response_id=rid))
        (victim,) = [r for r, s in cluster.stats().items() if s["num_running"]]
        ray.kill(ray.get_actor(stats[victim]["actor"], namespace="serve"), no_restart=True)
        error, _ = recv_until(ws, of_type("error", response_id=rid))
        _, done, _ = collect(ws, rid)
        assert done["response"]["status"] == "failed"
        assert error["error"]["code"] == "engine_error"
        _, after, _ = collect(ws, respond(ws, **SHORT))  # the next one: another replica
    assert after["response"]["status"] == "completed"
    assert after["response"]["replica"] not in (None, victim)
