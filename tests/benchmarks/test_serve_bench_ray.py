"""benchmarks/serve_bench_ray.py (``serve_bench.py --ray``): its report from a made-up result,
and a tiny end-to-end run (the tiny random model, one short round of each configuration: a
plain server and three Ray Serve apps on a local Ray; ~50 s on 2 busy cores, skipped without
Ray)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import serve_bench_ray as sbr  # noqa: E402
import serve_bench_ray_load as sbr_load  # noqa: E402
import serve_bench_ray_report as sbr_report  # noqa: E402


def _rec(transport: str, replica: str, ttft: float, session: int = -1, turn: int = 0,
         ) -> dict[str, Any]:
    return {"transport": transport, "session": session, "turn": turn, "tokens": 8,
            "cached_tokens": 16 if transport == "http" else None, "replica": replica,
            "error": None, "ttft": ttft, "tpot": ttft / 10}


def _round(replicas: list[str], ttft: float, hit_rate: float) -> dict[str, Any]:
    recs = [_rec("ws", replicas[(s + t) % len(replicas)], ttft, s, t)
            for s in range(2) for t in range(2)]
    recs += [_rec("http", replicas[0], ttft / 2)]
    return {"duration_s": 2.0, "prefix_queries": 1000, "prefix_hits": int(1000 * hit_rate),
            "hit_rate": hit_rate, "records": recs,
            "per_replica": {r: {"queries": 1000 // len(replicas),
                                "hits": int(1000 * hit_rate) // len(replicas)}
                            for r in replicas}}


def test_report_from_a_result(tmp_path):
    rounds = {"plain": [_round(["local"], 0.1, 0.8)] * 2,
              "ray-1": [_round(["a"], 0.12, 0.8)] * 2,
              "ray-2": [_round(["b", "c"], 0.11, 0.7)] * 2}
    probes = {f"{n}/{tr}": [_rec(tr, "x", ttft) for _ in range(3)]
              for n, ttft in (("plain", 0.05), ("ray-1", 0.07)) for tr in ("ws", "http")}
    summary = {n: sbr_report.summarize_config(r) for n, r in rounds.items()}
    assert summary["plain"]["hit_rate"] == pytest.approx(0.8)
    assert summary["ray-2"]["requests_per_replica"] == [6, 4]  # the HTTP calls on b
    assert summary["ray-2"]["sticky_sessions"] == 0.0  # every session moved between turns
    assert summary["ray-1"]["sticky_sessions"] == 1.0
    over = sbr_report.overheads(rounds, probes)
    assert [(o["where"][:5], o["transport"]) for o in over] == [
        ("probe", "ws"), ("probe", "http"), ("chat ", "ws"), ("chat ", "http")]
    assert over[0]["paired_ttft_added_ms"] == pytest.approx(20.0)
    assert over[2]["paired_tpot_ratio"] == pytest.approx(1.2)
    result = {"summary": summary, "overhead": over}
    text = sbr_report.tables(result)
    assert "| ray-2 | 2 | on | 10 | 0 |" in text and "70.0%" in text and "6/4" in text
    sbr_report.plot(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_system_prompts_are_long_distinct_and_tagged():
    prompts = sbr_load.system_prompts(3, 120, "t1")
    assert len(set(prompts)) == 3 and all(len(p.split()) >= 120 for p in prompts)
    assert all(p.startswith("Deployment t1,") for p in prompts)
    assert sbr_load.system_prompts(3, 120, "t2")[0] != prompts[0]  # a fresh tag: a cold prefix


def test_a_tiny_run(tiny_model_dir, tmp_path):
    pytest.importorskip("ray.serve")
    result = sbr.main(["--model", str(tiny_model_dir), "--dtype", "float32", "--rounds", "1",
                       "--sessions", "2", "--turns", "2", "--stateless", "2",
                       "--system-prompts", "1", "--system-words", "60", "--max-tokens", "4",
                       "--probe", "1", "--stagger", "0", "--results-dir", str(tmp_path)])
    assert set(result["summary"]) == {"plain", "ray-1", "ray-2", "ray-2-noaff"}
    for name, s in result["summary"].items():
        assert s["all"]["n"] == 6 and s["all"]["errors"] == 0, (name, s)
        assert s["hit_rate"] is not None and s["hit_rate"] > 0, name  # a shared system prompt
    assert result["summary"]["ray-2"]["sticky_sessions"] == 1.0  # affinity: one replica each
    assert len(result["summary"]["ray-2"]["per_replica"]) == 2
    assert len(result["overhead"]) == 4
    saved = json.loads((tmp_path / "serve_bench_ray.json").read_text())
    assert saved["summary"]["plain"]["hit_rate"] == result["summary"]["plain"]["hit_rate"]
    assert (tmp_path / "serve_bench_ray.png").stat().st_size > 10_000
