"""Replay spec_bench's C=1 suffix speculation against known outputs, without the model.

Greedy speculation emits exactly the tokens plain decoding does, so once the target's
greedy answers to spec_bench's prompts are known, every step of a speculative run can be
replayed without the model: the real :class:`spec.speculator.Speculator` (suffix tries,
public corpus, acceptance trackers, the policy) plans each step's drafts, an oracle accepts
the longest drafted path that the known output continues, and the step is priced with the
engine's start-up cost curve for its rows plus the off run's other per-step time (as
:mod:`spec_ceiling` does). The proposer's own time is measured as it runs and added.

What this is for: a proposer or policy change can be scored on every category in seconds,
free of this VM's drift, and beside two ceilings on the same outputs: the clairvoyant
copier's (:func:`spec_ceiling.clairvoyant_steps`: any copy from the context or the corpus,
the best length) and ``oracle length``'s (this proposer's own candidate trees, each step
drafting exactly the path verification would accept: what knowing the right draft length
would give). What the replay leaves out (how a served step's cost drifts and the served
curve's corrections, cache effects of a model step on the look-ups, the speed guard's off
epochs) still needs a live spec_bench A/B.

    python benchmarks/spec_replay.py [--model M] [--max-tokens 128] [--outputs FILE]
        [--variant NAME:key=value,...]... [--measure-curve] [--compare SPEC_BENCH_JSON]
        [--tag TAG]

The off runs' outputs and timings, and the step cost by rows (:func:`median_curve`), are
written to ``--outputs`` (default ``benchmarks/results/spec_replay_outputs[_TAG].json``)
and read back from it on later runs. A variant's keys are ``SuffixConfig`` or
``SpeculationPolicy`` fields, ``max_k``, or ``oracle=1``; the default variants are the
shipped configuration and its oracle length. ``--compare`` puts a spec_bench JSON's
measured C=1 figures beside them (decode and wall-clock speed-ups, tokens a
request-step). Writes
``benchmarks/results/spec_replay[_TAG].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_bench
import spec_ceiling
from common import (
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    new_figure,
    save_figure,
    speedup_bars,
    write_json,
)

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import Speculator
from quickdraft.spec.step_cost import StepCost
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_corpus import SuffixCorpus
from quickdraft.spec.token_tree import TokenTree

WARM_TOKENS = 32  # spec_bench's warm-up: the first category's prompts, this many tokens
CURVE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17)  # rows a C=1 step verifies (max_k <= 16)
CURVE_ROUNDS = 9


def median_curve(time_forward: Callable[[int, int], float], context: int = 256,
                 rounds: int = CURVE_ROUNDS) -> StepCost:
    """Each size's median forward time after ``context`` positions over ``rounds``
    interleaved rounds (alternately in increasing and decreasing order), made
    non-decreasing. The engine's start-up curve keeps each size's *best* of a few rounds
    instead, which on this 2-core VM priced a second row at +1.7 % in one start-up against
    +15-20 % in steps as served (docs/benchmarks.md, session 70): fine for a server that
    corrects it from its steps (``ObservedStepCost``), not for a replay that has no steps."""
    times: dict[int, list[float]] = {n: [] for n in CURVE_SIZES}
    for r in range(rounds):
        for n in (CURVE_SIZES if r % 2 == 0 else CURVE_SIZES[::-1]):
            times[n].append(time_forward(n, context))
    medians = [statistics.median(times[n]) for n in CURVE_SIZES]
    return StepCost(CURVE_SIZES, tuple(itertools.accumulate(medians, max)))


def accepted_path(tree: TokenTree, future: list[int]) -> int:
    """How many drafts of ``tree`` greedy verification accepts when the target's next
    tokens are ``future``: the longest path from the root whose tokens lead ``future``."""
    node, depth = -1, 0
    while depth < len(future):
        nxt = [c for c in tree.children(node) if tree.token_ids[c] == future[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


@dataclasses.dataclass
class Replayed:
    """One replayed run: steps, rows verified and drafts accepted in all."""

    steps: int = 0
    draft_rows: int = 0
    accepted: int = 0
    seconds: float = 0.0  # priced steps plus the proposer's measured time
    proposer_s: float = 0.0


def replay_request(spec: Speculator, request: Request, output: list[int], max_k: int,
                   price: Callable[[int], float], out: Replayed, oracle: bool = False) -> None:
    """Decode ``output[1:]`` after ``output[0]`` (the prefill's) with ``spec``'s drafts.
    ``oracle``: the policy is bypassed; each step drafts exactly the path of the proposer's
    whole candidate tree that verification would accept (nothing where it would accept
    none): how fast this proposer would be if the right draft length were known."""
    request.append_output(output[0])
    while request.num_output_tokens < len(output):
        request.num_computed_tokens = request.num_tokens - 1
        future = output[request.num_output_tokens:]
        room = max(min(max_k, len(future) - 1), 0)
        start = time.perf_counter()
        if oracle:
            found = spec.proposers.candidate(request, room) if room else None
            whole = found.tree if found is not None and found.tree is not None else TokenTree()
            request.spec_token_ids = future[:min(accepted_path(whole, future), room)]
            if found is not None and request.spec_token_ids:
                # what Speculator._grant notes for the verification's record (the trackers
                # and the corpus's back-off learn from it as they would)
                state = request.spec_state
                state.verifying, state.in_flight_source = found.trackers_by_depth, found.source
                state.in_flight_depth = len(request.spec_token_ids)
        else:
            spec.plan([request], [room], 1, 2048)
        out.proposer_s += time.perf_counter() - start
        drafts = list(request.spec_token_ids)
        tree = request.spec_tree or TokenTree.from_chain(drafts)
        accepted = accepted_path(tree, future) if drafts else 0
        request.clear_drafts()
        if drafts:
            spec.record(request, len(drafts), accepted)
        for token in future[:accepted + 1]:
            request.append_output(token)
        out.steps += 1
        out.draft_rows += len(drafts)
        out.accepted += accepted
        out.seconds += price(len(drafts))
    request.num_computed_tokens = request.num_tokens


def make_speculator(policy_cost: StepCost, corpus: SuffixCorpus | None,
                    variant: dict[str, str]) -> tuple[Speculator, int, bool]:
    """A suffix speculator as the engine builds one, with ``variant``'s fields changed; its
    ``max_k``; and whether the variant drafts by oracle (``oracle=1``)."""
    suffix_fields = {f.name for f in dataclasses.fields(SuffixConfig)}
    policy_fields = {f.name for f in dataclasses.fields(SpeculationPolicy)}
    suffix_kw: dict[str, Any] = {}
    policy_kw: dict[str, Any] = {}
    max_k, oracle = 8, False
    for key, raw in variant.items():
        value: Any = float(raw) if "." in raw else int(raw)
        if key == "max_k":
            max_k = int(value)
        elif key == "oracle":
            oracle = bool(value)
        elif key in suffix_fields:
            suffix_kw[key] = value
        elif key in policy_fields:
            policy_kw[key] = value
        else:
            raise SystemExit(f"unknown variant key {key!r}")
    policy = SpeculationPolicy(policy_cost, max_k, **policy_kw)
    # (the engine's defaults: n-gram 2-4 for a request whose tries are not compiled; no
    # speed guard, whose off epochs a replay of one configuration has no use for)
    spec = Speculator("suffix", max_k, 2, 4, policy, suffix_corpus=corpus)
    if spec.proposers.suffix is not None:  # (None without the compiled tries)
        spec.proposers.suffix = SuffixProposer(SuffixConfig(**suffix_kw), corpus)
    return spec, max_k, oracle


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    pairs = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, pairs


def off_outputs(args: argparse.Namespace, engine: Any, bench: argparse.Namespace,
                curve: StepCost) -> dict[str, Any]:
    """Each category's prompts, greedy outputs and the off runs' timings, and ``curve``
    measured then (run once, then read back: every replay of one file prices its steps
    alike)."""
    if args.outputs.exists():
        return json.loads(args.outputs.read_text())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    data: dict[str, Any] = {"max_tokens": args.max_tokens, "categories": {},
                            "curve": {"num_tokens": list(curve.num_tokens),
                                      "seconds": list(curve.seconds)}}
    for cat, conversations in bench.all_prompts.items():
        runs = []
        for i, messages in enumerate(conversations):
            prompt = engine.apply_chat_template(messages)
            run = spec_bench.run_batch(engine, [prompt], params, f"replay-{cat}-{i}", "off")
            usage = run["usage"][0]
            runs.append({"prompt": prompt, "output": run["tokens"][0], "wall_s": run["wall_s"],
                         "decode_s": usage.decode_time})
        data["categories"][cat] = runs
        print(f"off: {cat}", file=sys.stderr)
    write_json(data, args.outputs)
    return data


@dataclasses.dataclass(frozen=True)
class OffRuns:
    """A category's off runs: their decoding steps and time, their wall time (prefill
    included), and a step's work besides the 1-row forward (``other_s``)."""

    decode_steps: int
    decode_s: float
    wall_s: float
    forward_1: float
    other_s: float

    @classmethod
    def of(cls, runs: list[dict[str, Any]], forward_1: float) -> OffRuns:
        decode_s = sum(r["decode_s"] for r in runs)
        steps = sum(max(len(r["output"]) - 1, 0) for r in runs)
        return cls(steps, decode_s, sum(r["wall_s"] for r in runs), forward_1,
                   max(decode_s / max(steps, 1) - forward_1, 0.0))

    def speedups(self, decode_s: float) -> dict[str, float]:
        """Decode-phase and wall-clock speed-ups of a replay that decoded in ``decode_s``."""
        speedup = self.decode_steps * (self.forward_1 + self.other_s) / decode_s \
            if decode_s > 0 else 1.0  # (no decoding step: nothing to gain)
        return {"speedup": speedup,
                "wall_speedup": spec_ceiling.with_prefill(speedup, self.decode_s, self.wall_s)}


def step_price(curve: StepCost, other_s: float) -> Callable[[int], float]:
    """A step's seconds by its drafts: the forward for them and the pending token, plus
    the step's other work."""
    return lambda drafts: curve(drafts + 1) + other_s


def replay_variant(data: dict[str, Any], policy_cost: StepCost, corpus: SuffixCorpus | None,
                   variant: dict[str, str], forward_1: float) -> dict[str, dict[str, Any]]:
    """Every category replayed at C=1 in spec_bench's order with one speculator (its pooled
    estimates carry over, as in one engine), after spec_bench's warm-up."""
    spec, max_k, oracle = make_speculator(policy_cost, corpus, variant)
    cats = data["categories"]

    def run(cat: str, limit: int | None, tag: str, price: Callable[[int], float]) -> Replayed:
        out = Replayed()
        for i, r in enumerate(cats[cat]):
            salt = f"{tag}-{cat}" if cat in spec_bench.SHARED_TENANT_CATEGORIES \
                else f"{tag}-{cat}-{i}"
            request = Request(f"{tag}-{cat}-{i}", list(r["prompt"]),
                              SamplingParams(max_tokens=len(r["output"]), temperature=0.0),
                              frozenset(), cache_salt=salt)
            output = r["output"][:limit] if limit else r["output"]
            replay_request(spec, request, output, max_k, price, out, oracle)
            spec.on_finish(request, request.status)
        return out

    first = next(iter(cats))
    run(first, WARM_TOKENS, "warm", lambda rows: 0.0)
    results: dict[str, dict[str, Any]] = {}
    for cat, runs in cats.items():
        off = OffRuns.of(runs, forward_1)
        out = run(cat, None, "run", step_price(policy_cost, off.other_s))
        results[cat] = {
            "tokens_per_step": (out.steps + out.accepted) / max(out.steps, 1),
            "draft_rows_per_step": out.draft_rows / max(out.steps, 1),
            "accepted_per_row": out.accepted / max(out.draft_rows, 1),
            "proposer_ms_per_step": 1e3 * out.proposer_s / max(out.steps, 1),
            **off.speedups(out.seconds + out.proposer_s)}
    return results


def clairvoyant(data: dict[str, Any], corpus_index: Any, policy_cost: StepCost, forward_1: float,
                max_draft: int) -> dict[str, dict[str, float]]:
    """The clairvoyant copier's ceiling on the same outputs: from the context, and from
    the target's own corpus when it has one (``corpus_index``)."""
    out = {}
    forward = [policy_cost(r + 1) for r in range(max_draft + 1)]
    for cat, runs in data["categories"].items():
        history: list[int] = []
        steps: list[int] = []
        for r in runs:
            steps += spec_ceiling.clairvoyant_steps(r["prompt"], r["output"], history,
                                                    max_draft, 2, corpus_index)
            if cat in spec_bench.SHARED_TENANT_CATEGORIES:
                history += r["output"]
        off = OffRuns.of(runs, forward_1)
        per_step, seconds = spec_ceiling.ceiling(steps, forward, off.other_s)
        out[cat] = {"tokens_per_step": per_step, **off.speedups(seconds)}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    spec_ceiling.add_run_args(
        p, "a spec_bench JSON whose measured C=1 figures go beside the replay")
    p.add_argument("--outputs", type=Path, default=None)
    p.add_argument("--variant", action="append", default=None,
                   help="NAME:key=value,... (repeatable; default: the shipped defaults)")
    p.add_argument("--measure-curve", action="store_true",
                   help="price steps with a curve measured now, not the outputs file's")
    args = p.parse_args(argv)
    suffix = f"_{args.tag}" if args.tag else ""
    args.outputs = args.outputs or args.out_dir / f"spec_replay_outputs{suffix}.json"
    args.variant = args.variant or ["shipped:", "oracle length:oracle=1"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)
    engine, bench = spec_ceiling.c1_engine(args.model)
    fresh = not args.outputs.exists()
    data = off_outputs(args, engine, bench, median_curve(engine.runner.time_forward))
    cost = StepCost(tuple(data["curve"]["num_tokens"]), tuple(data["curve"]["seconds"]))
    if args.measure_curve and not fresh:
        cost = median_curve(engine.runner.time_forward)
    print("curve (ms by rows): " + ", ".join(
        f"{n}: {1e3 * t:.2f}" for n, t in zip(cost.num_tokens, cost.seconds, strict=True)),
        file=sys.stderr)
    corpus = engine.speculator.suffix.corpus if engine.speculator.suffix else None
    forward_1 = cost(1)
    ceilings = clairvoyant(data, spec_ceiling.load_corpus(engine, 4), cost, forward_1, 16)
    variants: dict[str, dict[str, Any]] = {}
    for text in args.variant:
        name, pairs = parse_variant(text)
        start = time.perf_counter()
        variants[name] = replay_variant(data, cost, corpus, pairs, forward_1)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    measured = spec_ceiling.compare(args.compare, args.compare_method) if args.compare \
        else {}
    report(args, info, data, variants, ceilings, cost, measured)


def report(args: argparse.Namespace, info: dict[str, Any], data: dict[str, Any],
           variants: dict[str, dict[str, Any]], ceilings: dict[str, dict[str, float]],
           curve: StepCost, measured: dict[str, dict[str, float]] | None = None) -> None:
    """The table (printed), the JSON and the plot; ``measured``: a spec_bench run's figures
    by category (:func:`spec_ceiling.compare`), shown where it has every category."""
    cats = list(data["categories"])
    measured = measured if measured and all(c in measured for c in cats) else None
    headers = ["variant", *cats, "geomean"]
    lines = []
    for key in ("speedup", "wall_speedup", "tokens_per_step"):
        lines.append([f"ceiling ({key})"] + [fmt(ceilings[c][key], 3) for c in cats]
                     + [fmt(statistics.geometric_mean([ceilings[c][key] for c in cats]), 3)])
        for name, res in variants.items():
            lines.append([f"{name} ({key})"] + [fmt(res[c][key], 3) for c in cats]
                         + [fmt(statistics.geometric_mean([res[c][key] for c in cats]), 3)])
    if measured is not None:
        for key, label in (("decode_speedup", "speedup"), ("wall_speedup", "wall_speedup"),
                           ("tokens_per_request_step", "tokens_per_step")):
            values = [measured[c][key] for c in cats]
            if any(v is None for v in values):  # (an older JSON without the figure)
                continue
            lines.append([f"measured ({label})"] + [fmt(v, 3) for v in values]
                         + [fmt(statistics.geometric_mean(values), 3)])
    for name, res in variants.items():
        for key in ("draft_rows_per_step", "accepted_per_row", "proposer_ms_per_step"):
            lines.append([f"{name} ({key})"] + [fmt(res[c][key], 3) for c in cats] + ["–"])
    print(markdown_table(headers, lines))
    name = f"spec_replay{'_' + args.tag if args.tag else ''}"
    write_json({"benchmark": "spec_replay", "machine": info,
                "config": {k: str(v) if isinstance(v, Path) else v
                           for k, v in vars(args).items()},
                "curve_ms": {n: 1e3 * t for n, t in zip(curve.num_tokens, curve.seconds,
                                                         strict=True)},
                "ceiling": ceilings, "variants": variants, "measured": measured},
               args.out_dir / f"{name}.json")
    fig, ax = new_figure(11.0, 4.5)
    series = [("clairvoyant copier", [ceilings[c]["wall_speedup"] for c in cats])]
    series += [(n, [res[c]["wall_speedup"] for c in cats]) for n, res in variants.items()]
    if measured is not None:
        series.append((f"measured ({args.compare_method})",
                       [measured[c]["wall_speedup"] for c in cats]))
    speedup_bars(ax, cats, series)
    ax.set_ylabel("wall-clock speed-up over off (C=1)")
    ax.set_title(f"Suffix speculation replayed: {machine_summary(info)}", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, args.out_dir / f"{name}.png")


if __name__ == "__main__":
    main()
