"""Prometheus metrics with vLLM-style names, in a registry owned by one app (no globals).

Request histograms, token counters and ``request_success`` are observed when a request ends
(by the HTTP and WebSocket endpoints and the batch worker), labelled by priority class
(``priority="interactive"`` / ``"background"``); the engine's gauges and speculation counters
are read from ``AsyncLLM.stats()`` at scrape time by a custom collector (zeros while the model
loads): on Ray Serve, one series per engine replica (label ``replica``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quickdraft.engine.outputs import Usage
from quickdraft.server.params import DEFAULT_PRIORITY, PRIORITY_CLASSES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
StatsSource = Callable[[], dict[str, Any] | None]


GAUGES = {  # name: (help, key of AsyncLLM.stats())
    "num_requests_running": ("Requests in the running batch.", "num_running"),
    "num_requests_waiting": ("Requests waiting to be scheduled.", "num_waiting"),
    "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0-1).", "kv_usage"),
    "spec_decode_suffix_tenants": ("Tenants whose earlier answers the suffix proposer keeps.",
                                   "suffix_tenants"),
    "spec_decode_suffix_cached_tokens": ("Tokens of earlier answers in the suffix proposer's "
                                         "tries.", "suffix_cached_tokens"),
    "spec_decode_step_cost_ratio": ("Recent model steps' time over what the start-up "
                                    "measurement predicts for their size (median of the last "
                                    "64; above 1: the machine got slower, and the speculation "
                                    "policy prices drafts accordingly; 0: not measured).",
                                    "spec_step_cost_ratio"),
    "spec_decode_step_overhead_seconds": ("What an engine step costs besides the model's "
                                          "forward: scheduling, proposals, outputs (median "
                                          "of the last 32 steps; the speculation policy adds "
                                          "it to every step size's price; 0: not measured).",
                                          "spec_step_overhead_seconds"),
}
COUNTERS = {
    "num_preemptions": ("Preemptions (recompute) so far.", "num_preemptions"),
    "spec_decode_num_drafts": ("Verification steps that carried drafts.", "spec_num_steps"),
    "spec_decode_num_draft_tokens": ("Draft tokens proposed.", "spec_num_drafted"),
    "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", "spec_num_accepted"),
    "spec_decode_proposer_seconds": ("Seconds spent choosing drafts.", "spec_proposer_seconds"),
    "spec_decode_num_tree_drafts": ("Verification steps whose drafts were a tree (not a "
                                    "chain).", "spec_num_tree_steps"),
    "spec_decode_num_tree_nodes": ("Draft tokens of those trees (tree size = this / "
                                   "num_tree_drafts).", "spec_num_tree_nodes"),
    "spec_decode_num_skipped_lookups": ("Proposals not made: requests whose proposals kept "
                                        "drafting nothing look up less often.",
                                        "spec_num_skipped_lookups"),
    "spec_decode_num_unpayable_lookups": ("Suffix look-ups not made because no draft they "
                                          "could find would pay in that step (bounded "
                                          "match length, acceptance by kind).",
                                          "spec_num_unpayable_lookups"),
    "spec_decode_num_guard_off_steps": ("Steps in which a method's speed guard held "
                                        "speculation off (its off epochs and suspensions).",
                                        "spec_num_guard_off_steps"),
    "spec_decode_num_guard_suspensions": ("Times a speed guard found a method's speculation "
                                          "slower than the plain path and suspended it.",
                                          "spec_num_guard_suspensions"),
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                             "prefix_cache_queries"),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
}
REPLICA_UP_HELP = (
    "1 if the engine replica answered this scrape's stats poll in time, else 0 (its engine "
    "series are then left out). Ray Serve's own per-replica metrics (ray_serve_*, the same "
    "replica label) are in Ray's metrics export on each node: see docs/scale-out.md.")


class _EngineCollector(Collector):
    """Gauges and counters the engine keeps itself, read at scrape time.

    Stats of several engine replicas (Ray Serve: ``{"replicas": {id: stats}, "replicas_up":
    {id: 0|1}}``) give one series per replica, labelled ``replica`` as vLLM labels ``engine``
    (sum them in PromQL), and ``quickdraft:replica_up``; a local engine's give one series."""

    def __init__(self, model_name: str, stats: StatsSource) -> None:
        self._model = model_name
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # registering must not call collect(): the engine may still be loading

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or {}
        replicas = stats.get("replicas")
        labels = ["model_name"]
        sources: list[tuple[list[str], dict[str, Any]]] = [([self._model], stats)]
        if isinstance(replicas, dict):
            labels = ["model_name", "replica"]
            sources = [([self._model, str(r)], s) for r, s in replicas.items()]
        for name, (doc, key) in GAUGES.items():
            gauge = GaugeMetricFamily(f"quickdraft:{name}", doc, labels=labels)
            for values, source in sources:
                gauge.add_metric(values, source.get(key, 0))
            yield gauge
        for name, (doc, key) in COUNTERS.items():
            counter = CounterMetricFamily(f"quickdraft:{name}", doc, labels=labels)
            for values, source in sources:
                counter.add_metric(values, source.get(key, 0))
            yield counter
        per_pos = CounterMetricFamily(
            "quickdraft:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.", labels=[*labels, "position"])
        for values, source in sources:
            for pos, n in enumerate(source.get("spec_accepted_per_position", [])):
                per_pos.add_metric([*values, str(pos)], n)
        yield per_pos
        drafted_pos = CounterMetricFamily(
            "quickdraft:spec_decode_num_drafts_per_pos",
            "Verification steps that reached a draft at this position (depth, in a tree).",
            labels=[*labels, "position"])
        for values, source in sources:
            for pos, n in enumerate(source.get("spec_drafted_per_position", [])):
                drafted_pos.add_metric([*values, str(pos)], n)
        yield drafted_pos
        for kind, column in (("drafts", 0), ("draft_tokens", 1), ("accepted_tokens", 2)):
            by_source = CounterMetricFamily(
                f"quickdraft:spec_decode_num_{kind}_by_source",
                f"spec_decode_num_{kind}, by the proposer that drafted them.",
                labels=[*labels, "source"])
            for values, source in sources:
                for name, counts in source.get("spec_by_source", {}).items():
                    by_source.add_metric([*values, name], counts[column])
            yield by_source
        up = stats.get("replicas_up")
        if isinstance(up, dict):
            gauge = GaugeMetricFamily("quickdraft:replica_up", REPLICA_UP_HELP,
                                      labels=["model_name", "replica"])
            for replica, value in up.items():
                gauge.add_metric([self._model, str(replica)], value)
            yield gauge


@dataclass(frozen=True)
class _RequestSeries:
    """The request-level series of one priority class (children of the labelled families)."""

    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter


def priority_class(priority: int) -> str:
    """The name of the priority class an engine priority number falls in: the class with the
    largest number not above it (lower numbers run first), so the ``priority`` label only ever
    takes the classes' names."""
    ordered = sorted(PRIORITY_CLASSES.items(), key=lambda item: item[1])
    name = ordered[0][0]
    for candidate, value in ordered:
        if value <= priority:
            name = candidate
    return name


class GatewayMetrics:
    """The app's registry; ``observe`` is called once per finished engine request (HTTP,
    WebSocket and batch lines alike), labelled with the request's priority class."""

    def __init__(self, model_name: str, stats: StatsSource) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg = self.registry
        labels = ["model_name", "priority"]
        self._ttft = Histogram("quickdraft:time_to_first_token_seconds",
                               "Time to first token.", labels, buckets=LATENCY_BUCKETS,
                               registry=reg)
        self._tpot = Histogram("quickdraft:time_per_output_token_seconds",
                               "Mean time per output token after the first.", labels,
                               buckets=TPOT_BUCKETS, registry=reg)
        self._e2e = Histogram("quickdraft:e2e_request_latency_seconds",
                              "End-to-end request latency.", labels, buckets=LATENCY_BUCKETS,
                              registry=reg)
        self._queue = Histogram("quickdraft:request_queue_time_seconds",
                                "Time from arrival to first scheduled.", labels,
                                buckets=LATENCY_BUCKETS, registry=reg)
        self._prompt_tokens = Counter("quickdraft:prompt_tokens", "Prompt tokens processed.",
                                      labels, registry=reg)
        self._generation_tokens = Counter("quickdraft:generation_tokens", "Tokens generated.",
                                          labels, registry=reg)
        self.finished = Counter("quickdraft:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason", "priority"], registry=reg)
        self.ws_connections = Gauge("quickdraft:websocket_connections",
                                    "Open WebSocket sessions.", ["model_name"], registry=reg
                                    ).labels(model_name)
        # every class's series exist from the start (at zero), so rates need no first sample
        self._series = {name: self._bind(name) for name in PRIORITY_CLASSES}
        reg.register(_EngineCollector(model_name, stats))

    def _bind(self, priority: str) -> _RequestSeries:
        model = self.model_name
        return _RequestSeries(
            self._ttft.labels(model, priority), self._tpot.labels(model, priority),
            self._e2e.labels(model, priority), self._queue.labels(model, priority),
            self._prompt_tokens.labels(model, priority),
            self._generation_tokens.labels(model, priority))

    def observe(self, usage: Usage | None, finish_reason: str | None, e2e: float,
                priority: int = PRIORITY_CLASSES[DEFAULT_PRIORITY]) -> None:
        """Count one finished request; ``priority`` is the engine priority it ran at."""
        name = priority_class(priority)
        series = self._series[name]
        self.finished.labels(self.model_name, finish_reason or "unknown", name).inc()
        series.e2e.observe(e2e)
        if usage is None:
            return
        series.prompt_tokens.inc(usage.prompt_tokens)
        series.generation_tokens.inc(usage.completion_tokens)
        series.queue.observe(usage.queue_time)
        if usage.ttft is not None:
            series.ttft.observe(usage.ttft)
        if usage.completion_tokens > 1:
            series.tpot.observe(usage.decode_time / (usage.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
