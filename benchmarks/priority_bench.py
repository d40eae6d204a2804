"""Interactive latency while background work saturates the engine: priority vs FCFS vs idle.

Interactive load: Poisson arrivals at ``--rate`` requests/s for ``--duration`` seconds, chat
prompts from ``benchmarks/prompts/spec_bench.json``, at most ``--interactive-tokens`` tokens.
Background load: ``--background-inflight`` requests kept in flight at all times (each a
prompt of the same set, ``--background-tokens`` tokens), as a batch job would.

Three scenarios on one in-process engine (``AsyncLLM``, same weights, same settings):
- ``idle``: the interactive load alone;
- ``priority``: with the background load at background priority (10), interactive at 0;
- ``fcfs``: the same background load, everything at the same priority (first come, first
  served): what priority scheduling buys.

Per scenario: interactive TTFT and TPOT p50/p90/p99, background tokens/s (the batch job must
still make progress) and preemptions. Goals: priority p99 TTFT <= 1.5x idle and TPOT <= 1.3x
idle. Writes ``benchmarks/results/priority_bench.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    machine_info,
    machine_summary,
    markdown_table,
    new_figure,
    percentiles,
    save_figure,
    write_json,
)

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.config import DTYPES, EngineConfig
from quickdraft.engine.sampling_params import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "prompts" / "spec_bench.json"
SCENARIOS = ("idle", "priority", "fcfs")


async def one(llm: AsyncLLM, ids: list[int], max_tokens: int, priority: int,
              ) -> dict[str, float]:
    start = time.perf_counter()
    first: float | None = None
    n = 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for out in llm.generate(prompt_token_ids=ids, sampling_params=params,
                                  priority=priority):
        if out.token_ids and first is None:
            first = time.perf_counter()
        n += len(out.token_ids)
    end = time.perf_counter()
    ttft = (first or end) - start
    return {"ttft": ttft, "tpot": (end - (first or end)) / max(n - 1, 1), "tokens": n}


async def background(llm: AsyncLLM, prompts: list[list[int]], args: argparse.Namespace,
                     priority: int, stop: asyncio.Event, done: list[int]) -> None:
    async def worker(w: int) -> None:
        i = w
        while not stop.is_set():
            result = await one(llm, prompts[i % len(prompts)], args.background_tokens, priority)
            done.append(int(result["tokens"]))
            i += args.background_inflight

    await asyncio.gather(*(worker(w) for w in range(args.background_inflight)))


async def scenario(llm: AsyncLLM, prompts: list[list[int]], name: str,
                   args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    bg_tokens: list[int] = []
    bg_task = None
    if name != "idle":
        bg_task = asyncio.create_task(background(llm, prompts, args, 10 if name == "priority"
                                                 else 0, stop, bg_tokens))
        await asyncio.sleep(args.settle)  # the batch job saturates the engine first
    preempt0 = llm.stats()["num_preemptions"]
    rng = random.Random(args.seed)
    tasks = []
    start = time.perf_counter()
    t = 0.0
    while (t := t + rng.expovariate(args.rate)) < args.duration:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        tasks.append(asyncio.create_task(one(llm, prompts[len(tasks) % len(prompts)],
                                             args.interactive_tokens, 0)))
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    bg_rate = sum(bg_tokens) / elapsed if bg_task else 0.0
    stop.set()
    if bg_task:  # cancelling the streams aborts their requests (AsyncLLM.generate)
        bg_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bg_task
        await asyncio.sleep(0.5)
    return {"scenario": name, "ttft": percentiles([r["ttft"] for r in results]),
            "tpot": percentiles([r["tpot"] for r in results]),
            "background_tok_s": bg_rate, "background_finished": len(bg_tokens),
            "preemptions": llm.stats()["num_preemptions"] - preempt0}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = new_figure(9.0, 4.2)
    ax.remove()
    axes = [fig.add_subplot(1, 2, i + 1) for i in range(2)]
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for j, q in enumerate(("p50", "p99")):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(rows))]
            bars = ax.bar(xs, [1000 * r[metric][q] for r in rows], 0.38, label=q)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["scenario"] for r in rows])
        ax.set_ylabel(f"interactive {metric.upper()} (ms)")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    llm = AsyncLLM.from_config(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        # the interactive and background loads draw from one prompt set: no cache hits
        enable_prefix_caching=False), progress=False)
    data = json.loads(PROMPTS.read_text())["categories"]
    convs = [c["messages"] for items in data.values() for c in items]
    prompts = [llm.engine.apply_chat_template(m) for m in convs]
    await one(llm, prompts[0], 4, 0)  # warm-up
    rows = []
    for name in SCENARIOS:
        rows.append(await scenario(llm, prompts, name, args))
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    llm.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--rate", type=float, default=0.5, help="interactive requests/s")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--interactive-tokens", type=int, default=48)
    p.add_argument("--background-inflight", type=int, default=24)
    p.add_argument("--background-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=24)
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)
    rows = asyncio.run(run(args))
    idle = rows[0]
    for r in rows:
        r["p99_ttft_vs_idle"] = r["ttft"]["p99"] / idle["ttft"]["p99"]
        r["p50_tpot_vs_idle"] = r["tpot"]["p50"] / idle["tpot"]["p50"]
    data = {"benchmark": "priority_bench", "machine": info,
            "config": vars(args) | {"out_dir": str(args.out_dir)}, "results": rows}
    json_path = write_json(data, args.out_dir / "priority_bench.json")
    png_path = args.out_dir / "priority_bench.png"
    plot(rows, png_path, f"interactive latency under a background batch job "
         f"({args.background_inflight} in flight), {info['cpu_model']}")
    print(f"wrote {json_path} and {png_path}\n", file=sys.stderr)
    print(markdown_table(
        ["scenario", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
         "p99 TTFT / idle", "p50 TPOT / idle", "background tok/s", "preemptions"],
        [[r["scenario"], 1000 * r["ttft"]["p50"], 1000 * r["ttft"]["p99"],
          1000 * r["tpot"]["p50"], 1000 * r["tpot"]["p99"], r["p99_ttft_vs_idle"],
          r["p50_tpot_vs_idle"], r["background_tok_s"], r["preemptions"]] for r in rows]))


if __name__ == "__main__":
    main()
