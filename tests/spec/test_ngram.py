"""Tests for spec.ngram: the vectorised proposer against a plain-loop reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quickdraft.spec.ngram import NgramProposer, propose_ngram, propose_ngram_reference


def propose(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    found = propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k)
    assert found.dtype == np.int64 and found.ndim == 1
    assert found.tolist() == propose_ngram_reference(tokens, min_n, max_n, k)
    return list(found.tolist())


@pytest.mark.parametrize("tokens", [[], [7], [7, 7], [1, 2], [1, 2, 3]])
def test_too_short_or_no_repeat(tokens: list[int]) -> None:
    expected = [7] if tokens == [7, 7] else []  # [7, 7]: suffix 7 occurs at 0, followed by 7
    assert propose(tokens) == expected


def test_no_match_returns_empty_of_same_dtype() -> None:
    tokens = np.arange(50, dtype=np.int32)
    found = propose_ngram(tokens, 1, 4, 5)
    assert found.size == 0 and found.dtype == np.int32


def test_longest_suffix_wins() -> None:
    # Suffix [2, 3] occurs at 5 (followed by 9); only [3] occurs later, at 8 (followed by 4).
    tokens = [0, 0, 0, 0, 0, 2, 3, 9, 3, 4, 2, 3]
    assert propose(tokens, 1, 3, 2) == [9, 3]
    assert propose(tokens, 1, 1, 2) == [4, 2]  # unigram only: latest 3 is at 8


def test_most_recent_occurrence_is_chosen() -> None:
    tokens = [5, 6, 1, 1, 5, 6, 2, 2, 5, 6, 3, 3, 8, 5, 6]
    assert propose(tokens, 2, 2, 3) == [3, 3, 8]


def test_match_near_the_end_gives_fewer_than_k() -> None:
    tokens = [4, 1, 2, 9, 1, 2]  # [1, 2] at 1, followed by 9, 1, 2 (3 < k = 5)
    assert propose(tokens, 2, 2, 5) == [9, 1, 2]
    assert propose([3, 3, 3, 3], 2, 2, 4) == [3]  # latest [3, 3] overlaps the suffix
    assert propose([1, 2, 1, 2], 1, 2, 4) == [1, 2]


def test_min_n_filters_short_matches() -> None:
    tokens = [1, 2, 3, 4, 5, 3]  # only a unigram match (3 at 2)
    assert propose(tokens, 1, 3, 2) == [4, 5]
    assert propose(tokens, 2, 3, 2) == []


def test_max_n_longer_than_context_and_k_zero() -> None:
    assert propose([1, 2, 1, 2], 1, 10, 2) == [1, 2]
    assert propose([1, 2, 1, 2], 1, 3, 0) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram(np.arange(5), 0, 2, 1)
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram(np.arange(5), 3, 2, 1)
    with pytest.raises(ValueError, match="k must"):
        propose_ngram(np.arange(5), 1, 2, -1)
    with pytest.raises(ValueError, match="1-D"):
        propose_ngram(np.zeros((2, 3), dtype=np.int64), 1, 2, 1)
    with pytest.raises(ValueError, match="max_context"):
        NgramProposer(max_n=4, max_context=4)


@st.composite
def repetitive_sequences(draw: st.DrawFn) -> list[int]:
    """Small-alphabet tokens with copied chunks, so that long matches are common."""
    vocab = draw(st.integers(2, 6))
    tokens = draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    for _ in range(draw(st.integers(0, 4))):
        if not tokens:
            break
        start = draw(st.integers(0, len(tokens) - 1))
        size = draw(st.integers(1, 8))
        tokens += tokens[start:start + size] + draw(st.lists(st.integers(0, vocab - 1),
                                                             max_size=3))
    return tokens


@settings(max_examples=300, deadline=None)
@given(tokens=repetitive_sequences(), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(0, 6))
def test_matches_reference(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    propose(tokens, min_n, min_n + extra, k)


def test_matches_reference_on_long_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for _ in range(30):
        base = rng.integers(0, 20, size=int(rng.integers(50, 400)))
        chunks = [base]
        for _ in range(5):  # paste copies of random chunks, like quoted text
            start = int(rng.integers(0, base.size))
            chunks.append(base[start:start + int(rng.integers(2, 12))])
        tokens = np.concatenate(chunks).tolist()
        propose(tokens, 2, 5, 6)


def test_proposer_caps_the_context() -> None:
    proposer = NgramProposer(min_n=2, max_n=3, k=2, max_context=8)
    tokens = [7, 8, 1, 2, *range(50, 60), 7, 8]
    assert proposer.propose(tokens) == []  # the first [7, 8] is outside the last 8 tokens
    wide = NgramProposer(min_n=2, max_n=3, k=2)
    assert wide.propose(tokens) == [1, 2]
    assert wide.propose(np.array(tokens, dtype=np.int32)) == [1, 2]
    assert wide.propose([]) == []


def test_proposer_defaults() -> None:
    proposer = NgramProposer()
    assert (proposer.min_n, proposer.max_n, proposer.k, proposer.max_context) == (2, 4, 4, 4096)
    tokens = list(range(100)) + list(range(10, 14))  # suffix 10..13 matches at 10
    assert proposer.propose(tokens) == [14, 15, 16, 17]
