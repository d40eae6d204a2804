"""The report of ``benchmarks/serve_bench_ray.py``: summaries per configuration and transport,
the Ray hop's overhead against the plain server, the markdown tables and the plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from common import fmt, markdown_table, new_figure, percentiles, save_figure
from serve_bench_ray_load import JSONDict
from serve_bench_ray_servers import CONFIGS


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
