"""Speculation under a busy neighbour: static vs observed step-cost curve.

The engine measures its step-cost curve while the machine is quiet (start-up), then a
neighbour process starts spinning on one core (``python -c 'while True: pass'``), as on a
shared host. Each category's prompts run at ``--concurrency`` (default 1) with speculation
off, with the policy on the start-up curve (static) and on the curve corrected by observed
step times (observed, the default), alternating, ``--repeats`` times; speed-ups are ratios
of medians against ``off`` in the same run.

    python benchmarks/busy_neighbour.py [--categories ...] [--repeats 3] [--method suffix]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spec_bench import load_prompts, run_category  # type: ignore[import-not-found]

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.step_cost import ObservedStepCost

RESULTS = Path(__file__).with_name("results")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--categories", default="multi_turn_chat,code_editing,open_writing,math")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--no-neighbour", action="store_true", help="the quiet control run")
    ap.add_argument("--tag", default="busy_neighbour")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(speculation=args.method,
                                    max_num_seqs=max(args.concurrency, 8)))
    base = engine.step_cost.base if engine.step_cost is not None else None
    assert base is not None, "the engine measured no step-cost curve"
    policy = engine.speculator.policy
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts_by_cat = load_prompts()
    neighbour = None if args.no_neighbour else subprocess.Popen(
        [sys.executable, "-c", "while True: pass"])
    results: dict[str, dict[str, list[float]]] = {}
    try:
        time.sleep(1.0)
        for cat in args.categories.split(","):
            prompts = [engine.apply_chat_template(m) for m in prompts_by_cat[cat]]
            walls: dict[str, list[float]] = {"off": [], "static": [], "observed": []}
            for rep in range(args.repeats):
                for mode in ("off", "static", "observed"):
                    if mode == "static":
                        policy.cost, engine.step_cost = base, None
                    elif mode == "observed":  # learns afresh each run
                        engine.step_cost = policy.cost = ObservedStepCost(base)
                    method = "off" if mode == "off" else args.method
                    run = run_category(engine, prompts, args.concurrency, params,
                                       f"{cat}-{mode}-{rep}", method)
                    walls[mode].append(run["wall_s"])
                print(cat, rep, {m: round(w[-1], 3) for m, w in walls.items()}, flush=True)
            results[cat] = walls
    finally:
        if neighbour is not None:
            neighbour.kill()
    rows = []
    for cat, walls in results.items():
        off = statistics.median(walls["off"])
        rows.append((cat, off / statistics.median(walls["static"]),
                     off / statistics.median(walls["observed"])))
    print("\n| category | static curve | observed curve |\n|---|---:|---:|")
    for cat, s, o in rows:
        print(f"| {cat} | {s:.2f}x | {o:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.tag}.json"
    out.write_text(json.dumps({"method": args.method, "neighbour": not args.no_neighbour,
                               "concurrency": args.concurrency,
                               "repeats": args.repeats, "walls": results,
                               "speedup": {c: {"static": s, "observed": o}
                                           for c, s, o in rows}}, indent=1))
    _plot(rows, RESULTS / f"{args.tag}.png", args.method, not args.no_neighbour,
          args.concurrency)
    print("wrote", out)


def _plot(rows: list[tuple[str, float, float]], path: Path, method: str,
          neighbour: bool, concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="start-up curve")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="observed curve")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=15)
    ax.set_ylabel(f"{method} speed-up vs off")
    ax.set_title(f"C={concurrency}, "
                 + ("a busy neighbour process" if neighbour else "no neighbour process"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
