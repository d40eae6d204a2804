"""How far copy drafting could take spec_bench: a clairvoyant ceiling per category.

Suffix decoding, n-gram lookup and the public corpus all draft by copying: after the
context's last tokens matched somewhere, they propose what followed there. This benchmark
bounds what any such drafter could gain on this model and machine, given the tokens the
target actually produces. It runs spec_bench's prompts once with speculation off (greedy),
then replays each request's output against a *clairvoyant* copier: before each decoding step
it knows the output to come, looks at every place its sources could copy from, and drafts
exactly the longest run of correct tokens any of them offers (at most ``--max-draft``), so
it never drafts a wrong token, never pays for a look-up, and is never too short or too long.
Sources:

- ``context``: the request's own prompt and output so far, after a match of at least
  ``--min-match`` tokens (SuffixDecoding's per-request tree, n-gram lookup); in the agentic
  category also the run's earlier answers (spec_bench runs it as one tenant);
- ``context+corpus``: also the shipped public corpus (``spec/heads/.../suffix_corpus``),
  after a match of at least ``--corpus-min-match`` tokens. Picking the best of thousands of
  occurrences of a short match is more than a real drafter could know, so this column is
  indicative, not a strict bound; ``context`` is one.

Each replayed step is priced with the engine's start-up row-cost curve (the model's forward
for 1 + accepted rows) plus the step's other work as measured in the off run (its decode
time a step, less the curve's 1-row forward): ``ceiling speed-up`` = off's decode time /
the clairvoyant's. ``wall x`` is the same ceiling on the wall clock: the off runs' own
prefill and first token (their wall time less their decode time), which no drafter shortens,
added to both sides (:func:`with_prefill`). ``tokens / step`` is the ceiling with free
verification rows. A ``--compare`` spec_bench JSON adds its measured C=1 speed-ups (decode
phase and wall clock) beside them.

    python benchmarks/spec_ceiling.py [--model M] [--max-tokens 128] [--max-draft 16]
        [--min-match 2] [--corpus-min-match 4] [--compare benchmarks/results/spec_bench_X.json]
        [--tag TAG]

writes ``benchmarks/results/spec_ceiling[_TAG].{json,png}`` and prints a markdown table. A
target without a corpus of its own answers (one drafting from the shipped text
re-tokenized, e.g. Qwen2.5-Coder-1.5B) gets the ``context`` column only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_bench
from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    new_figure,
    save_figure,
    speedup_bars,
    write_json,
)

from quickdraft.engine.sampling_params import SamplingParams

SOURCES = ("context", "context+corpus")
_CORPUS_CANDIDATES = 20_000  # occurrences of a corpus match replayed (the most common ones)


def longest_copy(context: Sequence[int], future: Sequence[int], max_draft: int,
                 min_match: int) -> int:
    """The most leading tokens of ``future`` (at most ``max_draft``) that a copier could
    draft: the longest run that follows, inside ``context``, an occurrence of the context's
    last ``min_match`` tokens (the context's own end excluded, as it has no continuation)."""
    n, want = len(context), min(max_draft, len(future))
    if n <= min_match or want == 0:
        return 0
    ctx = np.asarray(context, dtype=np.int64)  # [n]
    hit = np.ones(n - min_match, dtype=bool)  # hit[j]: ctx[j:j+m] == ctx[-m:]
    for i in range(min_match):
        hit &= ctx[i:n - min_match + i] == ctx[n - min_match + i]
    starts = np.nonzero(hit)[0] + min_match  # where each occurrence's continuation begins
    best = 0
    fut = np.asarray(future[:want], dtype=np.int64)
    for s in starts.tolist():
        run = min(want, n - s)
        if run <= best:
            continue
        eq = ctx[s:s + run] == fut[:run]
        length = run if eq.all() else int(np.argmin(eq))
        best = max(best, length)
    return best


class CorpusIndex:
    """Where each ``min_match``-gram of a token corpus occurs (a sorted array of their
    keys), to find the longest continuation of a context's last ``min_match`` tokens that
    matches a given future. ``tokens``: the corpus's sequences with -1 between them (never
    matched, so no match or continuation crosses from one sequence into the next)."""

    def __init__(self, tokens: np.ndarray, min_match: int) -> None:
        self.tokens = tokens.astype(np.int64) + 1  # [N]; the separator is 0, tokens >= 1
        self.min_match = min_match
        self._base = int(self.tokens.max()) + 1
        if self._base ** min_match >= 2 ** 63:
            raise ValueError(f"min_match {min_match} too long for one int64 key")
        keys = self._keys(self.tokens)  # [N - m + 1]
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]

    def _keys(self, t: np.ndarray) -> np.ndarray:
        m, key = self.min_match, np.zeros(t.size - self.min_match + 1, dtype=np.int64)
        for i in range(m):
            key = key * self._base + t[i:t.size - m + 1 + i]
        return key

    def longest_copy(self, context: Sequence[int], future: Sequence[int],
                     max_draft: int) -> int:
        m, want = self.min_match, min(max_draft, len(future))
        if len(context) < m or want == 0:
            return 0
        key = self._keys(np.asarray(context[-m:], dtype=np.int64) + 1)[0]
        lo = int(np.searchsorted(self._sorted, key))
        hi = int(np.searchsorted(self._sorted, key, side="right"))
        pos = self._order[lo:min(hi, lo + _CORPUS_CANDIDATES)] + m  # continuations' starts
        best = 0
        for j, token in enumerate(future[:want]):
            pos = pos[pos < self.tokens.size]
            pos = pos[self.tokens[pos] == token + 1]
            if pos.size == 0:
                break
            best, pos = j + 1, pos + 1
        return best


def clairvoyant_steps(prompt: Sequence[int], output: Sequence[int], history: Sequence[int],
                      max_draft: int, min_match: int, corpus: CorpusIndex | None) -> list[int]:
    """Accepted drafts of each decoding step a clairvoyant copier takes to produce
    ``output[1:]`` (``output[0]`` comes from the prefill): ``history`` (earlier answers
    the request may copy from) and the prompt and output so far as its context, and
    ``corpus`` when given."""
    accepted: list[int] = []
    base = list(history) + list(prompt)
    i = 1
    while i < len(output):
        context, future = base + list(output[:i]), output[i:]
        # the step emits the accepted drafts and one token of its own
        limit = min(max_draft, len(future) - 1)
        best = longest_copy(context, future, limit, min_match)
        if corpus is not None and best < limit:
            best = max(best, corpus.longest_copy(context, future, limit))
        accepted.append(best)
        i += best + 1
    return accepted


def ceiling(steps: Sequence[int], forward_s: Sequence[float], other_s: float
            ) -> tuple[float, float]:
    """(tokens a step, clairvoyant seconds): ``forward_s[r]`` the forward for r + 1 rows."""
    tokens = sum(a + 1 for a in steps)
    seconds = sum(forward_s[a] + other_s for a in steps)
    return tokens / max(len(steps), 1), seconds


def with_prefill(decode_speedup: float, decode_s: float, wall_s: float) -> float:
    """The wall-clock speed-up of runs that took ``wall_s`` in all, ``decode_s`` of it
    decoding (first token to last), when their decoding runs ``decode_speedup`` times faster
    and the rest (the prefill and the first token, which speculation cannot shorten) does
    not: ``wall / (wall - decode + decode / decode_speedup)``."""
    if wall_s <= 0.0 or decode_s <= 0.0 or decode_speedup <= 0.0:
        return 1.0
    decode_s = min(decode_s, wall_s)
    return wall_s / (wall_s - decode_s + decode_s / decode_speedup)


# ---------------------------------------------------------------------- the run

def add_run_args(p: argparse.ArgumentParser, compare_help: str) -> None:
    """The arguments this script shares with ``spec_replay.py``."""
    p.add_argument("--model", default=None, help="as spec_bench's (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--compare", type=Path, default=None, help=compare_help)
    p.add_argument("--compare-method", default="suffix")
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)


def c1_engine(model: str | None) -> tuple[Any, argparse.Namespace]:
    """spec_bench's engine for ``model`` (None: its default) and its arguments, C=1, off and
    suffix."""
    bench = spec_bench.parse_args(["--methods", "off,suffix", "--concurrency", "1"]
                                  + (["--model", model] if model else []))
    engine, _ = spec_bench.build_engine(bench)
    return engine, bench


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, "a spec_bench JSON whose C=1 decode speed-ups go beside the ceilings")
    p.add_argument("--max-draft", type=int, default=16)
    p.add_argument("--min-match", type=int, default=2)
    p.add_argument("--corpus-min-match", type=int, default=4)
    return p.parse_args(argv)


def load_corpus(engine: Any, min_match: int) -> CorpusIndex | None:
    """The shipped corpus of this target's own answers (None: it has none; a corpus derived
    from another target's text is not replayed)."""
    from quickdraft.spec.draft_head import SHIPPED_HEADS, model_fingerprint
    from quickdraft.spec.suffix_corpus import own_corpus_dir, read_tokens, tokens_file

    own = own_corpus_dir(model_fingerprint(Path(engine.info.model_dir)), SHIPPED_HEADS)
    return CorpusIndex(read_tokens(tokens_file(own)), min_match) if own is not None else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)
    engine, bench = c1_engine(args.model)
    corpus = load_corpus(engine, args.corpus_min_match)
    cost = engine.speculator.policy.cost
    cost = getattr(cost, "base", cost)  # the start-up curve (StepCost): seconds for n rows
    forward_s = [cost(r + 1) for r in range(args.max_draft + 1)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for cat, conversations in bench.all_prompts.items():
        shared = cat in spec_bench.SHARED_TENANT_CATEGORIES
        history: list[int] = []
        runs = []
        wall_s = 0.0  # the off runs' wall time (prefill included)
        for i, messages in enumerate(conversations):
            prompt = engine.apply_chat_template(messages)
            run = spec_bench.run_batch(engine, [prompt], params, f"ceiling-{cat}-{i}", "off")
            output, usage = run["tokens"][0], run["usage"][0]
            wall_s += run["wall_s"]
            runs.append((prompt, output, list(history), usage))
            if shared:
                history += output
        decode_s = sum(u.decode_time for *_, u in runs)
        decode_steps = sum(max(len(o) - 1, 0) for _, o, _, _ in runs)
        other_s = max(decode_s / max(decode_steps, 1) - forward_s[0], 0.0)
        row: dict[str, Any] = {"category": cat, "decode_tokens": decode_steps,
                               "off_decode_ms_per_token": 1e3 * decode_s / max(decode_steps, 1),
                               "other_ms_per_step": 1e3 * other_s,
                               "off_wall_s": wall_s, "off_decode_s": decode_s}
        for source in SOURCES:
            if source != "context" and corpus is None:
                continue
            steps = [a for p, o, h, _ in runs for a in clairvoyant_steps(
                p, o, h, args.max_draft, args.min_match,
                corpus if source != "context" else None)]
            per_step, seconds = ceiling(steps, forward_s, other_s)
            speedup = decode_steps * (forward_s[0] + other_s) / seconds \
                if seconds > 0 else 1.0  # (no decoding step: nothing to gain)
            row[source] = {"tokens_per_step": per_step, "speedup": speedup,
                           "wall_speedup": with_prefill(speedup, decode_s, wall_s),
                           "accepted_histogram": np.bincount(
                               steps, minlength=args.max_draft + 1).tolist()}
        rows.append(row)
        print(f"{cat}: " + ", ".join(f"{s} {row[s]['tokens_per_step']:.2f} tokens/step, "
                                     f"{row[s]['speedup']:.2f}x" for s in SOURCES if s in row)
              + f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    measured = compare(args.compare, args.compare_method) if args.compare else {}
    for row in rows:
        row["measured"] = measured.get(row["category"])
    report(args, info, rows, forward_s)


def compare(path: Path, method: str) -> dict[str, dict[str, float]]:
    """Category -> the spec_bench JSON's C=1 speed-ups (decode phase, wall clock) and tokens a
    request-step."""
    data = json.loads(Path(path).read_text())
    out = {}
    for r in data["results"]:
        if r["concurrency"] == 1 and r["method"] == method and r["category"] != "overall":
            out[r["category"]] = {"decode_speedup": r["decode_speedup"],
                                  "wall_speedup": r["speedup"],
                                  "tokens_per_request_step":
                                  r["spec"].get("tokens_per_request_step")}
    return out


def report(args: argparse.Namespace, info: dict[str, Any], rows: list[dict[str, Any]],
           forward_s: list[float]) -> None:
    sources = [s for s in SOURCES if all(s in r for r in rows)]
    overall: dict[str, Any] = {"category": "geomean"}
    for s in sources:
        overall[s] = {k: statistics.geometric_mean([r[s][k] for r in rows])
                      for k in ("tokens_per_step", "speedup", "wall_speedup")}
    if all(r["measured"] for r in rows):
        overall["measured"] = {k: statistics.geometric_mean([r["measured"][k] for r in rows])
                               for k in ("decode_speedup", "wall_speedup",
                                         "tokens_per_request_step")}
    else:
        overall["measured"] = None
    table_rows = [*rows, overall]
    headers = ["category"] + [f"{s} {k}" for s in sources
                              for k in ("tokens/step", "x", "wall x")]
    headers += ["measured tokens/request-step", "measured decode x", "measured wall x"]
    lines = []
    for r in table_rows:
        cells = [r["category"]]
        for s in sources:
            cells += [fmt(r[s]["tokens_per_step"], 3), fmt(r[s]["speedup"], 3),
                      fmt(r[s]["wall_speedup"], 3)]
        m = r.get("measured")
        cells += [fmt(m[k], 3) if m else "–"
                  for k in ("tokens_per_request_step", "decode_speedup", "wall_speedup")]
        lines.append(cells)
    print(markdown_table(headers, lines))
    name = f"spec_ceiling{'_' + args.tag if args.tag else ''}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json({"benchmark": "spec_ceiling", "machine": info,
                "config": {k: str(v) if isinstance(v, Path) else v
                           for k, v in vars(args).items()},
                "forward_ms_by_rows": [1e3 * s for s in forward_s],
                "results": table_rows}, args.out_dir / f"{name}.json")
    fig, ax = new_figure(9.0, 4.5)
    series = [(f"ceiling, {s}", [r[s]["speedup"] for r in table_rows]) for s in sources]
    if overall["measured"] is not None:
        series.append((f"measured ({args.compare_method}, decode)",
                       [r["measured"]["decode_speedup"] for r in table_rows]))
    speedup_bars(ax, [r["category"] for r in table_rows], series)
    ax.set_ylabel("speed-up over speculation off (C=1)")
    ax.set_title(f"Copy drafting's clairvoyant ceiling: {machine_summary(info)}", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, args.out_dir / f"{name}.png")


if __name__ == "__main__":
    main()
