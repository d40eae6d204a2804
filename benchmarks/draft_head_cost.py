"""What the draft head costs beside a target step (issue goal: one head forward <= 8 % of a
SmolLM2 decode step on the CPU).

For each context length: the target's decode step (1 token, one request), one head forward
(a 1-node proposal: the catch-up row and its distribution) and a whole tree proposal of
``2k`` nodes (catch-up + rounds), medians of ``--repeats`` timings, as ratios to the step;
each proposal timed twice: back to back (its code and data warm) and right after a target
step, as in serving, where the step has streamed the model's weights through the caches;
then what each further position to catch up on adds to a proposal.

Run: ``python benchmarks/draft_head_cost.py`` (the shipped head of the default model) writes
``benchmarks/results/draft_head_cost[_TAG].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    median,
    new_figure,
    save_figure,
    write_json,
)

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft-head", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--k", type=int, default=4, help="drafts granted (the tree has 2k nodes)")
    p.add_argument("--tag", default="", help="suffix of the results files' names")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, draft_head=args.draft_head,
                                    num_threads=args.threads, measure_step_cost=False))
    head = engine.head
    if head is None:
        p.error("no draft head for this model (train one: quickdraft draft-head train)")
    rows, data = [], []
    for context in (64, 256, 1024):
        for _ in range(3):  # warm up
            engine.runner.time_decode(1, context)
            head.time_propose(1, 1, context)
        step = median([engine.runner.time_decode(1, context) for _ in range(args.repeats)])
        one = median([head.time_propose(1, 1, context) for _ in range(args.repeats)])
        tree = median([head.time_propose(1, 2 * args.k, context)
                       for _ in range(args.repeats)])

        def after_step(nodes: int, context: int = context) -> float:
            engine.runner.time_decode(1, context)  # a proposal right after a target step
            return head.time_propose(1, nodes, context)

        one_cold = median([after_step(1) for _ in range(args.repeats)])
        tree_cold = median([after_step(2 * args.k) for _ in range(args.repeats)])
        data.append({"context": context, "target_step_ms": step * 1e3,
                     "head_forward_ms": one * 1e3, "head_tree_ms": tree * 1e3,
                     "forward_ratio": one / step, "tree_ratio": tree / step,
                     "head_forward_after_step_ms": one_cold * 1e3,
                     "head_tree_after_step_ms": tree_cold * 1e3,
                     "forward_after_step_ratio": one_cold / step,
                     "tree_after_step_ratio": tree_cold / step})
        rows.append([context, fmt(step * 1e3, 2), fmt(one * 1e3, 3), fmt(one / step, 3),
                     fmt(tree * 1e3, 3), fmt(tree / step, 3), fmt(one_cold * 1e3, 3),
                     fmt(one_cold / step, 3), fmt(tree_cold * 1e3, 3),
                     fmt(tree_cold / step, 3)])
    # a proposal first catches up on every position verified since the head last drafted
    catch_up = {m: median([head.time_propose(1, 2, 256, max_depth=1, catch_up=m)
                           for _ in range(args.repeats)]) for m in (1, 9)}
    per_position = max(catch_up[9] - catch_up[1], 0.0) / 8
    info = machine_info()
    out = {"machine": info, "threads": args.threads, "k": args.k,
           "head": str(args.draft_head), "rows": data,
           "catch_up_ms_per_position": per_position * 1e3}
    name = "draft_head_cost" + (f"_{args.tag}" if args.tag else "")
    write_json(out, RESULTS_DIR / f"{name}.json")
    fig, ax = new_figure()
    xs = range(len(data))
    for offset, key, label in ((-0.3, "forward_ratio", "one head forward"),
                               (-0.1, "forward_after_step_ratio", "… after a target step"),
                               (0.1, "tree_ratio", f"tree proposal ({2 * args.k} nodes)"),
                               (0.3, "tree_after_step_ratio", "… after a target step")):
        ax.bar([x + offset for x in xs], [d[key] for d in data], 0.2, label=label)
    ax.axhline(0.08, color="k", linestyle="--", linewidth=1, label="goal 8 %")
    ax.set_xticks(list(xs), [f"context {d['context']}" for d in data])
    ax.set_ylabel("time / target decode step")
    ax.set_title(f"Draft head cost ({args.threads} thread{'s' if args.threads > 1 else ''}; "
                 f"{machine_summary(info)})",
                 fontsize=8)
    ax.legend()
    save_figure(fig, RESULTS_DIR / f"{name}.png")
    print(markdown_table(["context", "target step ms", "head forward ms", "ratio",
                          f"tree ({2 * args.k} nodes) ms", "ratio", "forward after a step ms",
                          "ratio", "tree after a step ms", "ratio"], rows))
    print(f"\ncatch-up before a proposal (context 256): {per_position * 1e3:.3f} ms a position")
    return 0


if __name__ == "__main__":
    sys.exit(main())
