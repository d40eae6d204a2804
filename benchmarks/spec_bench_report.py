"""The report side of ``benchmarks/spec_bench.py``: speculation counters and metrics from the
requests' usage, greedy agreement, a category's row and the overall row over the repeats' runs,
and the JSON, PNG and markdown table they are written to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common import (
    fmt,
    markdown_table,
    median,
    new_figure,
    save_figure,
    summarize,
    write_json,
)

from quickdraft.engine.llm_engine import LLMEngine

# ---------------------------------------------------------------------- rows


def spec_counters(usages: list[Any]) -> dict[str, int]:
    return {
        "requests": len(usages),
        "completion_tokens": sum(u.completion_tokens for u in usages),
        "spec_steps": sum(u.num_spec_steps for u in usages),
        "drafted": sum(u.num_drafted_tokens for u in usages),
        "accepted": sum(u.num_accepted_tokens for u in usages),
    }


def add_counters(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b[k] for k in b}


def spec_metrics(c: dict[str, int]) -> dict[str, Any]:
    steps, drafted, accepted = c["spec_steps"], c["drafted"], c["accepted"]
    request_steps = c["completion_tokens"] - accepted
    return {
        **c,
        "request_steps": request_steps,
        "tokens_per_verify_step": (accepted + steps) / steps if steps else None,
        # drafts verified per step: a chain's length, a tree's size
        "drafts_per_verify_step": drafted / steps if steps else None,
        "proposer_ms_per_step": 1e3 * c.get("proposer_us", 0) / 1e6 / request_steps
        if request_steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "speculated_step_fraction": steps / request_steps if request_steps else None,
        "tokens_per_request_step": c["completion_tokens"] / request_steps
        if request_steps else None,
    }


def agreement(off: list[list[int]], on: list[list[int]]) -> dict[str, Any]:
    identical, prefix = 0, []
    for a, b in zip(off, on, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        identical += a == b
        prefix.append(k)
    return {"identical": identical, "requests": len(off),
            "rate": identical / len(off), "mean_common_prefix": sum(prefix) / len(prefix)}


def method_row(cat: str, c: int, method: str, off: list[dict[str, Any]],
               on: list[dict[str, Any]]) -> dict[str, Any]:
    counters: dict[str, int] = {}
    for run in on:
        counters = add_counters(counters, {**spec_counters(run["usage"]),
                                           "proposer_us": round(1e6 * run["proposer_s"]),
                                           "guard_off_steps": run.get("guard_off_steps", 0)})
    paired = [b["tok_s"] / a["tok_s"] for a, b in zip(off, on, strict=True)]
    decode = [b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(off, on, strict=True)]
    latency = [sum(a["latency_s"]) / sum(b["latency_s"]) for a, b in zip(off, on, strict=True)]
    return {
        "category": cat, "concurrency": c, "method": method, "speedup": median(paired),
        "decode_speedup": median(decode), "latency_speedup": median(latency),
        "paired_speedup": summarize(paired),
        "ratio_of_medians": median([b["tok_s"] for b in on]) / median([a["tok_s"] for a in off]),
        **{side: {"tok_s": summarize([x["tok_s"] for x in runs]),
                  "decode_tok_s": summarize([x["decode_tok_s"] for x in runs]),
                  "decode_tokens": [x["decode_tokens"] for x in runs],
                  "decode_s": [x["decode_s"] for x in runs],
                  "wall_s": summarize([x["wall_s"] for x in runs]),
                  "latency_s": [sum(x["latency_s"]) for x in runs],  # summed over requests
                  "generated": [x["generated"] for x in runs]}
           for side, runs in (("off", off), ("on", on))},
        "spec": spec_metrics(counters), "counters": counters,
        "agreement": agreement(off[0]["tokens"], on[0]["tokens"]),
    }


def overall_row(rows: list[dict[str, Any]], c: int, method: str) -> dict[str, Any]:
    """Every category's batch of one repeat summed: total tokens / total wall time."""
    mine = [r for r in rows if r["concurrency"] == c and r["method"] == method]
    repeats = len(mine[0]["off"]["generated"])

    def rate(side: str, i: int) -> float:
        return (sum(r[side]["generated"][i] for r in mine)
                / sum(r[side]["wall_s"]["values"][i] for r in mine))

    paired = [rate("on", i) / rate("off", i) for i in range(repeats)]

    def decode_rate(side: str, i: int) -> float:
        return (sum(r[side]["decode_tokens"][i] for r in mine)
                / sum(r[side]["decode_s"][i] for r in mine))

    decode = [decode_rate("on", i) / decode_rate("off", i) for i in range(repeats)]
    latency = [sum(r["off"]["latency_s"][i] for r in mine)
               / sum(r["on"]["latency_s"][i] for r in mine) for i in range(repeats)]
    counters: dict[str, int] = {}
    for r in mine:
        counters = add_counters(counters, r["counters"])
    identical = sum(r["agreement"]["identical"] for r in mine)
    requests = sum(r["agreement"]["requests"] for r in mine)
    prefix = sum(r["agreement"]["mean_common_prefix"] * r["agreement"]["requests"] for r in mine)
    return {
        "category": "overall", "concurrency": c, "method": method, "speedup": median(paired),
        "decode_speedup": median(decode), "latency_speedup": median(latency),
        "paired_speedup": summarize(paired),
        **{side: {"tok_s": summarize([rate(side, i) for i in range(repeats)])}
           for side in ("off", "on")},
        "spec": spec_metrics(counters), "counters": counters,
        "agreement": {"identical": identical, "requests": requests,
                      "rate": identical / requests, "mean_common_prefix": prefix / requests},
    }


# ---------------------------------------------------------------------- output


def plot(rows: list[dict[str, Any]], path: Path, title: str, metric: str = "speedup") -> None:
    fig, ax = new_figure(10.0, 4.8)
    names = list(dict.fromkeys(r["category"] for r in rows))
    series = list(dict.fromkeys((r["method"], r["concurrency"]) for r in rows))
    width = 0.8 / len(series)
    for j, (method, c) in enumerate(series):
        by_name = {r["category"]: r for r in rows
                   if r["concurrency"] == c and r["method"] == method}
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        ys = [by_name[n][metric] for n in names]
        bars = ax.bar(xs, ys, width, label=f"{method}, concurrency {c}", color=f"C{j}")
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, padding=1)
    ax.axhline(1.0, color="black", lw=1)
    ax.axhline(0.95, color="grey", ls=":", lw=1, label="0.95x (slowest allowed)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("_", "\n") for n in names], fontsize=8)
    ax.set_ylabel("speed-up vs speculation off ("
                  + {"speedup": "wall clock", "decode_speedup": "decode phase",
                     "latency_speedup": "mean request latency"}[metric] + ")")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def table(rows: list[dict[str, Any]]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    def spread(r: dict[str, Any]) -> str:
        # the repeats' paired ratios: on this 2-core VM a C=8 batch's range is often ±15 %
        p = r["paired_speedup"]
        return f"{p['min']:.2f}–{p['max']:.2f}"

    return markdown_table(
        ["category", "conc", "method", "off tok/s", "method tok/s", "speed-up",
         "repeats' range", "decode speed-up", "mean latency speed-up", "tok/verify step",
         "drafts/verify step", "proposer ms/step", "accept rate", "steps speculated",
         "greedy identical"],
        [[r["category"], r["concurrency"], r["method"], r["off"]["tok_s"]["median"],
          r["on"]["tok_s"]["median"], r["speedup"], spread(r), r["decode_speedup"],
          r["latency_speedup"],
          fmt(r["spec"]["tokens_per_verify_step"]), fmt(r["spec"]["drafts_per_verify_step"]),
          fmt(r["spec"]["proposer_ms_per_step"]), pct(r["spec"]["acceptance_rate"]),
          pct(r["spec"]["speculated_step_fraction"]),
          f"{r['agreement']['identical']}/{r['agreement']['requests']}"] for r in rows])


def _corpus_info(engine: LLMEngine) -> dict[str, int] | None:
    """The public suffix corpus the run drafted from (None: none)."""
    suffix = engine.speculator.suffix
    corpus = suffix.corpus if suffix is not None else None
    return {"tokens": corpus.num_tokens} if corpus is not None else None


def report(args: argparse.Namespace, info: dict[str, Any], engine: LLMEngine,
           prompts: dict[str, list[list[int]]],
           runs: dict[tuple[str, int], dict[str, list[dict[str, Any]]]], repeats: int,
           load_s: float, final: bool) -> None:
    """Aggregate the first ``repeats`` repeats; write JSON and PNG; print the table if final."""
    cats, concs, n = args.categories, args.concurrency, args.max_tokens
    rows: list[dict[str, Any]] = []
    for c in concs:
        for method in args.methods[1:]:
            mine = [method_row(cat, c, method, runs[(cat, c)]["off"][:repeats],
                               runs[(cat, c)][method][:repeats]) for cat in cats]
            rows += [*mine, overall_row(mine, c, method)]
    decode = engine.tokenizer.decode
    samples = {cat: {"prompt": args.all_prompts[cat][0][-1]["content"][:200],
                     **{m: decode(runs[(cat, concs[0])][m][0]["tokens"][0])
                        for m in args.methods}}
               for cat in cats}
    cfg = engine.config
    data = {
        "benchmark": "spec_bench",
        "machine": info,
        "config": {
            "model": args.model, "model_dir": engine.info.model_dir,
            "draft_model": cfg.draft_model, "methods": args.methods,
            "draft_head": cfg.draft_head,
            "suffix_corpus": _corpus_info(engine),
            "dtype": args.dtype, "concurrency": concs,
            "closed_loop": getattr(args, "closed_loop", 0), "max_tokens": n,
            "repeats": repeats, "repeats_requested": args.repeats, "categories": cats,
            "greedy": True, "ignore_eos": False,
            "prompts_file": str(args.prompts),
            "prompt_tokens": {cat: [len(p) for p in prompts[cat]] for cat in cats},
            "engine": {"max_num_seqs": cfg.max_num_seqs,
                       "max_num_batched_tokens": cfg.max_num_batched_tokens,
                       "num_speculative_tokens": cfg.num_speculative_tokens,
                       "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max,
                       "measure_step_cost": cfg.measure_step_cost,
                       "speed_guard": cfg.speed_guard,
                       "num_threads": cfg.num_threads, "device": cfg.device,
                       "kernel_backend": cfg.kernel_backend,
                       "backend": engine.runner.backend.describe(),
                       "weights": engine.runner.weights.describe()},
            "load_s": load_s,
        },
        "metrics": {
            "tok_s": "generated tokens of the category's batch / its wall time "
                     "(C=1: prompts one at a time, times summed; with closed_loop N > 0 at "
                     "C > 1: N requests, C in flight, a finished one replaced at once)",
            "speedup": f"median over {repeats} repeats of method tok/s / off tok/s, "
                       "run back to back, order alternating",
            "paired_speedup": "those paired ratios: median, min, max (the table's repeats' "
                              "range) and values",
            "decode_speedup": "the same ratio for the decode phase only: sum of "
                              "(completion_tokens - 1) / sum of decode_time (first token to "
                              "finish) over the category's requests",
            "latency_speedup": "median over repeats of the requests' summed time from "
                               "submission to their last token, off / method (at C > 1 the "
                               "wall time is the slowest request's; this is their mean's)",
            "tokens_per_verify_step": "(accepted + spec_steps) / spec_steps",
            "acceptance_rate": "accepted / drafted",
            "speculated_step_fraction": "spec_steps / (completion_tokens - accepted)",
            "agreement": "requests whose greedy tokens are identical on vs off (repeat 1)",
        },
        "results": rows,
        "samples": samples,
    }
    stem = f"spec_bench_{args.tag}" if args.tag else "spec_bench"
    out_dir = Path(args.out_dir)
    json_path = write_json(data, out_dir / f"{stem}.json")
    png_path = out_dir / f"{stem}.png"
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    loop = getattr(args, "closed_loop", 0)
    mode = f", closed loop of {loop} requests at C > 1" if loop else ""
    plot(rows, png_path, f"speculation speed-up, {name} {args.dtype}, greedy, max {n} tokens"
         f"{mode}\n{info['cpu_model']}, {info['usable_cores']} cores", args.plot)
    if final:
        print(f"wrote {json_path} and {png_path}\n", file=sys.stderr)
        print(table(rows))
