"""Per-replica engine metrics and drain options without a cluster: the stats poll over fake
broadcast results (a late, a failing and a departed replica), the collector's series per
replica, and the deployments' graceful shutdown following ``drain_timeout``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("ray")

from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import RayError

from quickdraft.engine.config import EngineConfig
from quickdraft.server.metrics import GatewayMetrics
from quickdraft.server.ray_app import (
    ENGINE_DEPLOYMENT,
    GATEWAY_DEPLOYMENT,
    build_app,
    drain_options,
)
from quickdraft.server.ray_stats import ReplicaStatsPoller
from quickdraft.server.settings import ServerSettings


class FakeResult:
    """One replica's answer to a broadcast, ``delay`` seconds late (an exception: raised)."""

    def __init__(self, value: Any, delay: float = 0.0) -> None:
        self.value, self.delay = value, delay

    async def get_async(self) -> Any:
        await asyncio.sleep(self.delay)
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class FakeResponse:
    def __init__(self, results: list[FakeResult]) -> None:
        self.results = results

    async def _fetch_replica_results_async(self) -> list[FakeResult]:
        return self.results


class FakeHandle:
    """The engine deployment's handle, as the poller uses it."""

    deployment_name = "QuickdraftEngine"
    app_name = "quickdraft"

    def __init__(self, results: list[FakeResult]) -> None:
        self.results = results
        self.calls: list[str] = []

    def broadcast(self, method: str) -> FakeResponse:
        self.calls.append(method)
        return FakeResponse(self.results)


def stats(replica: str, **values: Any) -> dict[str, Any]:
    return {"replica": replica, "actor": f"SERVE_REPLICA::{replica}", **values}


def test_a_late_or_failing_replica_is_skipped_and_reported_down():
    handle = FakeHandle([FakeResult(stats("a", num_running=2)),
                         FakeResult(stats("b", num_running=1), delay=30.0),
                         FakeResult(RayError("replica c died"))])
    live = {"a", "b", "c"}
    poller = ReplicaStatsPoller(handle, timeout=0.3, live=lambda: live)

    async def scrape_twice() -> tuple[dict[str, Any], dict[str, Any]]:
        return await asyncio.gather(poller.refresh(), poller.refresh())

    start = time.monotonic()
    one, two = asyncio.run(scrape_twice())
    assert time.monotonic() - start < 2.0  # the late replica did not hold the scrape
    assert handle.calls == ["stats"]  # concurrent scrapes share one poll
    assert one is two and set(one["replicas"]) == {"a"}
    assert one["replicas"]["a"]["num_running"] == 2
    assert one["replicas_up"] == {"a": 1, "b": 0, "c": 0}
    # b and c left Serve's live set (scaled down, replaced): no longer reported at all
    live.clear()
    live.add("a")
    assert asyncio.run(poller.refresh())["replicas_up"] == {"a": 1}


def test_without_per_replica_results_the_poll_is_all_or_nothing():
    class PublicOnly:
        async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[Any]:
            return [stats("a", num_running=1), RayError("gone")]

    handle = FakeHandle([])
    handle.broadcast = lambda method: PublicOnly()  # type: ignore[method-assign]
    poller = ReplicaStatsPoller(handle, timeout=0.3, live=lambda: None)
    snapshot = asyncio.run(poller.refresh())
    assert snapshot["replicas_up"] == {"a": 1} and set(snapshot["replicas"]) == {"a"}


def families(metrics: GatewayMetrics) -> dict[str, Any]:
    text = metrics.render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def by_replica(family: Any, sample_name: str | None = None) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in family.samples
            if sample_name is None or s.name == sample_name}


def test_engine_series_per_replica():
    snapshot = {
        "replicas": {
            "r1": stats("r1", num_running=2, kv_usage=0.5, prefix_cache_queries=100,
                        spec_accepted_per_position=[4, 2]),
            "r2": stats("r2", num_running=1, kv_usage=0.1, prefix_cache_queries=40),
        },
        "replicas_up": {"r1": 1, "r2": 1, "r3": 0},
    }
    fams = families(GatewayMetrics("tiny", lambda: snapshot))
    assert by_replica(fams["quickdraft:num_requests_running"]) == {"r1": 2, "r2": 1}
    assert by_replica(fams["quickdraft:kv_cache_usage_perc"]) == {"r1": 0.5, "r2": 0.1}
    queries = by_replica(fams["quickdraft:prefix_cache_queries"],
                         "quickdraft:prefix_cache_queries_total")
    assert queries == {"r1": 100, "r2": 40}  # r3 did not answer: no series
    per_pos = fams["quickdraft:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {(s.labels["replica"], s.labels["position"], s.value) for s in per_pos
            if s.name.endswith("_total")} == {("r1", "0", 4), ("r1", "1", 2)}
    up = fams["quickdraft:replica_up"]
    assert by_replica(up) == {"r1": 1, "r2": 1, "r3": 0}
    assert "metrics export" in up.documentation  # where Serve's own replica metrics are
    assert all(s.labels["model_name"] == "tiny" for s in up.samples)


def test_a_local_engine_keeps_one_series():
    fams = families(GatewayMetrics("tiny", lambda: {"num_running": 3}))
    (sample,) = fams["quickdraft:num_requests_running"].samples
    assert sample.labels == {"model_name": "tiny"} and sample.value == 3
    assert "quickdraft:replica_up" not in fams
    loading = families(GatewayMetrics("tiny", lambda: None))  # zeros while loading
    assert [s.value for s in loading["quickdraft:kv_cache_usage_perc"].samples] == [0.0]


@pytest.mark.parametrize(("drain", "wait_loop"), [(0.0, 0.1), (7.0, 0.7), (30.0, 1.0)])
def test_the_deployments_drain_for_drain_timeout(tmp_path, drain, wait_loop):
    from ray.serve._private.build_app import build_app as build_serve_app

    assert drain_options(drain) == {"graceful_shutdown_timeout_s": drain,
                                    "graceful_shutdown_wait_loop_s": wait_loop}
    settings = ServerSettings(engine=EngineConfig(model=str(tmp_path)), drain_timeout=drain)
    built = build_serve_app(build_app(settings), name="quickdraft")  # as serve.run does
    configs = {d.name: d._deployment_config for d in built.deployments}
    assert set(configs) == {ENGINE_DEPLOYMENT, GATEWAY_DEPLOYMENT}
    for config in configs.values():
        assert config.graceful_shutdown_timeout_s == drain
        assert config.graceful_shutdown_wait_loop_s == wait_loop
