"""benchmarks/spec_ceiling.py: its clairvoyant copier against brute-force references (every
occurrence of the match tried, in plain Python), and its step replay on outputs that copy
their prompt or copy nothing."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import spec_ceiling  # noqa: E402


def copy_reference(sources: list[list[int]], context: list[int], future: list[int],
                   max_draft: int, min_match: int) -> int:
    """Longest leading run of ``future`` that follows, inside one source, an occurrence of
    ``context``'s last ``min_match`` tokens (the continuation must exist in that source)."""
    tail, best = context[-min_match:], 0
    if len(context) < min_match:
        return 0
    for src in sources:
        for j in range(len(src) - min_match):
            if src[j:j + min_match] != tail:
                continue
            s, length = j + min_match, 0
            while (length < min(max_draft, len(future)) and s + length < len(src)
                   and src[s + length] == future[length]):
                length += 1
            best = max(best, length)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_longest_copy_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab, n = rng.choice([2, 3, 5]), rng.randint(0, 40)
    context = [rng.randrange(vocab) for _ in range(n)]
    future = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
    max_draft, min_match = rng.randint(0, 8), rng.randint(1, 3)
    # the context's own end is no occurrence: it has no continuation
    expected = copy_reference([context], context, future, max_draft, min_match)
    assert spec_ceiling.longest_copy(context, future, max_draft, min_match) == expected


@pytest.mark.parametrize("seed", range(20))
def test_corpus_index_matches_the_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    vocab, m = rng.choice([2, 3, 4]), rng.randint(1, 3)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
                 for _ in range(rng.randint(1, 5))]
    flat = np.array([t for s in sequences for t in [*s, -1]], dtype=np.int32)
    index = spec_ceiling.CorpusIndex(flat, m)
    for _ in range(10):
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        future = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        max_draft = rng.randint(0, 8)
        expected = copy_reference(sequences, context, future, max_draft, m)
        assert index.longest_copy(context, future, max_draft) == expected


def test_an_output_that_copies_its_prompt_takes_max_draft_plus_one_tokens_a_step() -> None:
    prompt = list(range(100, 160))
    output = prompt[10:50]  # a verbatim copy: after the first token, all of it is copyable
    steps = spec_ceiling.clairvoyant_steps(prompt, output, [], max_draft=4, min_match=1,
                                           corpus=None)
    # 39 tokens after the prefill's: 7 steps of 4 drafts + 1, then 4 tokens (3 drafts + 1)
    assert steps == [4] * 7 + [3]
    assert sum(a + 1 for a in steps) == len(output) - 1


def test_an_output_with_nothing_to_copy_takes_a_step_a_token() -> None:
    steps = spec_ceiling.clairvoyant_steps([1, 2, 3], list(range(10, 30)), [], max_draft=8,
                                           min_match=2, corpus=None)
    assert steps == [0] * 19


def test_history_and_corpus_are_copied_from() -> None:
    answer = list(range(50, 70))
    # an earlier answer of the tenant holds the output: copyable after a 2-token match
    steps = spec_ceiling.clairvoyant_steps([1, 2], answer, answer, 16, 2, None)
    assert steps[0] == 0 and sum(a + 1 for a in steps) == len(answer) - 1 and len(steps) < 5
    corpus = spec_ceiling.CorpusIndex(np.array([*answer, -1], dtype=np.int32), 2)
    assert spec_ceiling.clairvoyant_steps([1, 2], answer, [], 16, 2, corpus) == steps


def test_ceiling_prices_each_step_by_its_rows() -> None:
    per_step, seconds = spec_ceiling.ceiling([0, 3, 1], [1.0, 1.5, 2.0, 2.5], 0.5)
    assert per_step == pytest.approx(7 / 3)
    assert seconds == pytest.approx(1.5 + 3.0 + 2.0)


def test_the_wall_clock_ceiling_keeps_the_prefill() -> None:
    # 1.5 s in all, 1 s of it decoding: decoding twice as fast saves 0.5 s
    assert spec_ceiling.with_prefill(2.0, 1.0, 1.5) == pytest.approx(1.5)
    assert spec_ceiling.with_prefill(2.0, 1.0, 1.0) == pytest.approx(2.0)  # nothing else
    assert spec_ceiling.with_prefill(1.0, 1.0, 3.0) == pytest.approx(1.0)  # no gain
    assert spec_ceiling.with_prefill(3.0, 0.0, 2.0) == 1.0  # no decoding at all
    assert spec_ceiling.with_prefill(2.0, 2.0, 1.5) == pytest.approx(2.0)  # decode clamped
