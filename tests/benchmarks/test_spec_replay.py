"""benchmarks/spec_replay.py: greedy verification's accepted path against a brute-force
reference, and the replay of the real speculator on an output that copies its prompt: it
emits exactly that output, drafts and gets drafts accepted, and the oracle length never
takes more steps than the policy."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import spec_replay  # noqa: E402

from quickdraft.engine.request import Request  # noqa: E402
from quickdraft.engine.sampling_params import SamplingParams  # noqa: E402
from quickdraft.spec.step_cost import StepCost  # noqa: E402
from quickdraft.spec.suffix_tree import available as suffix_tree_available  # noqa: E402
from quickdraft.spec.token_tree import TokenTree  # noqa: E402


def accepted_reference(tokens: list[int], parents: list[int], future: list[int]) -> int:
    """The deepest node whose path from the root spells ``future``'s first tokens."""
    best = 0
    for node in range(len(tokens)):
        path = []
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        path.reverse()
        if path == future[:len(path)]:
            best = max(best, len(path))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_accepted_path_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(rng.randint(0, 12)):
        parent = rng.randint(-1, i - 1)
        siblings = {tokens[j] for j in range(i) if parents[j] == parent}
        choices = [t for t in range(4) if t not in siblings]  # siblings differ
        if not choices:
            break
        tokens.append(rng.choice(choices))
        parents.append(parent)
    future = [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
    tree = TokenTree(tuple(tokens), tuple(parents))
    assert spec_replay.accepted_path(tree, future) == accepted_reference(tokens, parents, future)


def test_median_curve_is_each_size_median_made_non_decreasing() -> None:
    calls: list[tuple[int, int]] = []

    def time_forward(n: int, context: int) -> float:
        calls.append((n, context))
        bump = 0.5 if n == 2 and len(calls) % 3 == 0 else 0.0  # an outlier, now and then
        return 1.0 + 0.1 * n + bump - (0.3 if n == 3 else 0.0)  # 3 rows cheaper than 2

    curve = spec_replay.median_curve(time_forward, context=64, rounds=5)
    assert {c for _, c in calls} == {64}
    assert len(calls) == 5 * len(spec_replay.CURVE_SIZES)
    assert curve.num_tokens == spec_replay.CURVE_SIZES
    assert curve(1) == pytest.approx(1.1) and curve(2) == pytest.approx(1.2)
    assert curve(3) == pytest.approx(1.2)  # (made non-decreasing)
    assert list(curve.seconds) == sorted(curve.seconds)


@pytest.mark.skipif(not suffix_tree_available(), reason="needs the compiled suffix tries")
def test_a_copied_prompt_is_replayed_with_accepted_drafts() -> None:
    phrase = list(range(100, 140))
    prompt = [1, 2, 3, *phrase, 4, 5]
    output = [7, *phrase[:30], 8, 9]  # copies the prompt's phrase, then leaves it
    curve = StepCost((1, 2, 9, 17), (1.0, 1.05, 1.4, 1.8))
    results = {}
    for name, variant in (("policy", {}), ("oracle", {"oracle": "1"})):
        spec, max_k, oracle = spec_replay.make_speculator(curve, None, variant)
        request = Request(name, list(prompt), SamplingParams(max_tokens=len(output),
                                                             temperature=0.0), frozenset())
        out = spec_replay.Replayed()
        spec_replay.replay_request(spec, request, output, max_k,
                                   lambda rows: curve(rows + 1), out, oracle)
        assert request.output_token_ids == output  # the tokens plain decoding emits
        assert out.steps + out.accepted == len(output) - 1
        assert out.accepted <= out.draft_rows
        results[name] = out
    policy, oracle_run = results["policy"], results["oracle"]
    assert policy.accepted >= 20  # the copy is drafted
    assert oracle_run.accepted == oracle_run.draft_rows  # never drafts a rejected token
    assert oracle_run.steps <= policy.steps


def test_a_variant_names_known_fields_only() -> None:
    curve = StepCost((1,), (1.0,))
    spec, max_k, oracle = spec_replay.make_speculator(
        curve, None, {"max_k": "12", "min_token_prob": "0.3", "probe_interval": "8"})
    assert (max_k, oracle) == (12, False)
    assert spec.policy.probe_interval == 8
    if spec.suffix is not None:
        assert spec.suffix.config.min_token_prob == 0.3
    with pytest.raises(SystemExit, match="unknown variant key"):
        spec_replay.make_speculator(curve, None, {"no_such_field": "1"})
    assert spec_replay.parse_variant("k16:max_k=16,oracle=1") == (
        "k16", {"max_k": "16", "oracle": "1"})


def test_the_report_puts_a_measured_run_beside_the_replay(tmp_path: Path) -> None:
    import argparse
    import json

    from common import machine_info
    cats = ["chat", "code"]
    bench = {"results": [{"concurrency": 1, "method": "suffix", "category": c,
                          "decode_speedup": 1.3, "speedup": 1.2,
                          "spec": {"tokens_per_request_step": 1.9}} for c in cats]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    import spec_ceiling
    measured = spec_ceiling.compare(tmp_path / "bench.json", "suffix")
    figures = {"tokens_per_step": 2.0, "speedup": 1.5, "wall_speedup": 1.3,
               "draft_rows_per_step": 1.0, "accepted_per_row": 0.5, "proposer_ms_per_step": 0.1}
    args = argparse.Namespace(tag="t", out_dir=tmp_path, compare_method="suffix")
    spec_replay.report(args, machine_info(), {"categories": {c: [] for c in cats}},
                       {"shipped": {c: dict(figures) for c in cats}},
                       {c: {"tokens_per_step": 2.2, "speedup": 1.6, "wall_speedup": 1.4}
                        for c in cats}, StepCost((1, 2), (1.0, 1.1)), measured)
    written = json.loads((tmp_path / "spec_replay_t.json").read_text())
    assert written["measured"]["code"]["wall_speedup"] == 1.2
    assert written["variants"]["shipped"]["chat"]["speedup"] == 1.5
    assert (tmp_path / "spec_replay_t.png").stat().st_size > 0
