"""GatewayMetrics: a registry per app (two apps never share series), zeros while the engine
loads, engine stats read at scrape time, histograms and counters fed from Usage."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from quickdraft.engine.outputs import Usage
from quickdraft.server.metrics import GatewayMetrics


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_loading_then_stats_and_observations():
    stats: dict | None = None
    m = GatewayMetrics("tiny", lambda: stats)
    loading = samples(m)
    assert loading[("quickdraft:num_requests_running", (("model_name", "tiny"),))] == 0
    assert loading[("quickdraft:prefix_cache_hits_total", (("model_name", "tiny"),))] == 0
    stats = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "num_preemptions": 3,
             "spec_num_steps": 4, "spec_num_drafted": 9, "spec_num_accepted": 5,
             "spec_accepted_per_position": [3, 2], "prefix_cache_queries": 7,
             "spec_proposer_seconds": 0.5, "suffix_tenants": 2, "suffix_cached_tokens": 300,
             "spec_drafted_per_position": [4, 3], "spec_num_tree_steps": 2,
             "spec_num_tree_nodes": 14, "spec_by_source": {"recycling": [3, 12, 4]},
             "spec_step_cost_ratio": 1.25, "spec_num_skipped_lookups": 6,
             "spec_num_unpayable_lookups": 11, "spec_step_overhead_seconds": 0.0005}
    m.observe(Usage(10, 5, queue_time=0.01, ttft=0.1, decode_time=0.4), "stop", 0.6)
    m.observe(None, "abort", 0.2)
    got = samples(m)
    label = (("model_name", "tiny"),)
    assert got[("quickdraft:num_requests_running", label)] == 2
    assert got[("quickdraft:kv_cache_usage_perc", label)] == 0.25
    assert got[("quickdraft:spec_decode_num_draft_tokens_total", label)] == 9
    assert got[("quickdraft:prefix_cache_queries_total", label)] == 7
    assert got[("quickdraft:spec_decode_proposer_seconds_total", label)] == 0.5
    assert got[("quickdraft:spec_decode_suffix_tenants", label)] == 2
    assert got[("quickdraft:spec_decode_suffix_cached_tokens", label)] == 300
    assert got[("quickdraft:spec_decode_step_cost_ratio", label)] == 1.25
    assert got[("quickdraft:spec_decode_step_overhead_seconds", label)] == 0.0005
    assert got[("quickdraft:spec_decode_num_accepted_tokens_per_pos_total",
                (("model_name", "tiny"), ("position", "1")))] == 2
    assert got[("quickdraft:spec_decode_num_drafts_per_pos_total",
                (("model_name", "tiny"), ("position", "0")))] == 4
    assert got[("quickdraft:spec_decode_num_tree_nodes_total", label)] == 14
    assert got[("quickdraft:spec_decode_num_tree_drafts_total", label)] == 2
    assert got[("quickdraft:spec_decode_num_skipped_lookups_total", label)] == 6
    assert got[("quickdraft:spec_decode_num_unpayable_lookups_total", label)] == 11
    assert got[("quickdraft:spec_decode_num_accepted_tokens_by_source_total",
                (("model_name", "tiny"), ("source", "recycling")))] == 4
    interactive = (*label, ("priority", "interactive"))  # observe's default class
    assert got[("quickdraft:prompt_tokens_total", interactive)] == 10
    assert got[("quickdraft:generation_tokens_total", interactive)] == 5
    assert got[("quickdraft:e2e_request_latency_seconds_count", interactive)] == 2
    assert got[("quickdraft:time_per_output_token_seconds_sum", interactive)] == 0.1
    assert got[("quickdraft:request_success_total",
                (("finished_reason", "abort"), ("model_name", "tiny"),
                 ("priority", "interactive")))] == 1
    other = GatewayMetrics("tiny", lambda: None)  # its own registry: no clash, no sharing
    assert samples(other)[("quickdraft:prompt_tokens_total", interactive)] == 0
