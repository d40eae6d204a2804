"""What the public suffix corpus (spec/suffix_corpus.py) adds to suffix decoding: one engine,
spec_bench's prompts, each prompt (C=1) or category batch of C run with speculation off,
``suffix`` without the corpus and ``suffix`` with it, the order reversed every other time,
so the three share the machine's drift. The policy's observed step cost is frozen (its
start-up curve), so both suffix runs take their decisions from the same prices and only the
corpus differs. Speed-ups are of the decode phase (first token to the last), medians over
repeats; greedy output must be identical in all three runs of every prompt.

    python benchmarks/suffix_corpus_ab.py --concurrency 1 --repeats 2

Writes ``results/suffix_corpus_ab_c<C>.{json,png}`` and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    machine_info,
    markdown_table,
    median,
    new_figure,
    save_figure,
    write_json,
)
from spec_bench import build_engine, load_prompts, parse_args

from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import speculator as speculator_module
from quickdraft.spec.params import SpeculationParams

ARMS = (("off", False), ("suffix", False), ("suffix", True))  # (method, with the corpus)


def run_batch(engine: Any, batch: list[list[int]], method: str, params: SamplingParams,
              ) -> tuple[list[list[int]], float]:
    """The batch's tokens per request and its decode tok/s (tokens after each request's
    first, over the time from the step that produced the first one to the end)."""
    rids = [f"{method}-{i}-{time.perf_counter_ns()}" for i in range(len(batch))]
    for rid, ids in zip(rids, batch, strict=True):
        engine.add_request(rid, sampling_params=params, prompt_token_ids=ids,
                           speculation=SpeculationParams(method=method), cache_salt=rid)
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    start, first = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"{out.request_id}: {out.error}")
            if start is None and out.token_ids:
                start = time.perf_counter()
                first = sum(len(t) for t in tokens.values()) + len(out.token_ids)
            tokens[out.request_id].extend(out.token_ids)
    total = sum(len(t) for t in tokens.values())
    elapsed = time.perf_counter() - (start or time.perf_counter())
    return [tokens[r] for r in rids], (total - first) / elapsed if elapsed > 0 else 0.0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1,
                   help="1: one prompt at a time; C > 1: each category's prompts cycled "
                        "into a batch of C")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--corpus-max-requests", type=int, default=None,
                   help="ask the corpus in steps of at most this many requests (default: "
                        "the engine's CORPUS_MAX_REQUESTS)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--suffix-corpus", default="auto",
                   help="the corpus to compare: auto (shipped for this target) or a "
                        "directory holding one for it")
    p.add_argument("--tag", default=None, help="results file suffix")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.repeats < 1:
        p.error("--concurrency and --repeats must be >= 1")
    engine, _ = build_engine(parse_args(
        ["--methods", "off,suffix", "--concurrency", str(args.concurrency),
         "--suffix-corpus", args.suffix_corpus] + (["--model", args.model] if args.model else [])))
    if args.corpus_max_requests is not None:
        speculator_module.CORPUS_MAX_REQUESTS = args.corpus_max_requests
    suffix = engine.speculator.suffix
    if suffix is None or suffix.corpus is None:
        sys.exit("no suffix corpus for this model (or no gcc): nothing to compare")
    corpus = suffix.corpus
    if engine.step_cost is not None:
        engine.step_cost.observe = lambda *a, **k: None  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = load_prompts()
    batches = {cat: ([[engine.apply_chat_template(m)] for m in msgs]
                     if args.concurrency == 1 else
                     [[engine.apply_chat_template(msgs[i % len(msgs)])
                       for i in range(args.concurrency)]])
               for cat, msgs in prompts.items()}
    for cat_batches in batches.values():  # warm-up
        for batch in cat_batches:
            run_batch(engine, batch, "off", params)
    rates: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for cat, cat_batches in batches.items():
            for i, batch in enumerate(cat_batches):
                arms = ARMS if (rep + i) % 2 == 0 else ARMS[::-1]
                outputs = []
                for method, with_corpus in arms:
                    suffix.corpus = corpus if with_corpus else None
                    tokens, rate = run_batch(engine, batch, method, params)
                    outputs.append(tokens)
                    rates.setdefault((cat, ARMS.index((method, with_corpus))), []).append(rate)
                if any(o != outputs[0] for o in outputs):
                    raise AssertionError(f"{cat}: greedy output differs between the arms")
                print(f"repeat {rep + 1}/{args.repeats} {cat} {i + 1}/{len(cat_batches)}",
                      file=sys.stderr)
    suffix.corpus = corpus
    rows = []
    for cat in batches:
        off = median(rates[(cat, 0)])
        rows.append({"category": cat, "suffix": median(rates[(cat, 1)]) / off,
                     "suffix_corpus": median(rates[(cat, 2)]) / off, "off_tok_s": off})
    rows.append({"category": "geomean",
                 **{key: math.exp(sum(math.log(r[key]) for r in rows) / len(rows))
                    for key in ("suffix", "suffix_corpus")}})
    name = f"suffix_corpus_ab_c{args.concurrency}" + (f"_{args.tag}" if args.tag else "")
    write_json({"benchmark": "suffix_corpus_ab", "machine": machine_info(),
                "config": {"model": args.model or "default", "concurrency": args.concurrency,
                           "repeats": args.repeats, "suffix_corpus": args.suffix_corpus,
                           "corpus_max_requests": speculator_module.CORPUS_MAX_REQUESTS,
                           "max_tokens": args.max_tokens, "corpus_tokens": corpus.num_tokens,
                           "observed_cost": "frozen"},
                "rows": rows}, RESULTS_DIR / f"{name}.json")
    fig, ax = new_figure(9.0, 4.2)
    xs = range(len(rows))
    for j, (key, label) in enumerate((("suffix", "suffix"),
                                      ("suffix_corpus", "suffix + public corpus"))):
        ys = [r[key] for r in rows]
        bars = ax.bar([x + (j - 0.5) * 0.4 for x in xs], ys, 0.4, label=label, color=f"C{j}")
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6, padding=1)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["category"].replace("_", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("decode speed-up vs speculation off")
    ax.set_title(f"SmolLM2-135M, C={args.concurrency}: the public suffix corpus", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, RESULTS_DIR / f"{name}.png")
    print(markdown_table(["category", "suffix", "suffix + corpus"],
                         [[r["category"], f"{r['suffix']:.3f}", f"{r['suffix_corpus']:.3f}"]
                          for r in rows]))


if __name__ == "__main__":
    main()
