"""Prompt-lookup (n-gram) drafting: guess the next tokens by copying from the context.

Chat turns, code edits and summaries repeat spans of their context. If the last ``n`` tokens
of a request also occur earlier in its context (earlier turns + prompt + output so far), the
tokens that followed that earlier occurrence are a cheap, model-free draft. Such drafts are
deterministic: the verifier treats them as one-hot draft distributions.

Rules of :func:`propose_ngram`:

* try suffix lengths ``n`` from ``max_n`` down to ``min_n``; the first (longest) ``n`` whose
  suffix also occurs earlier wins (a longer match is better evidence);
* among the earlier occurrences take the MOST RECENT one (vLLM takes the first): the recent
  context tracks the current topic, e.g. the latest version of a function being edited or
  the turn being quoted, while the first occurrence may come from a stale earlier turn. The
  cost: an occurrence close to the end (a periodic run) may be followed by fewer than ``k``
  tokens, and a shorter draft is returned;
* an occurrence may overlap the suffix itself, but must start before it;
* return the (up to) ``k`` tokens after the occurrence, or an empty array if none matched.

Vectorised: for each ``n`` (a loop of at most ``max_n - min_n + 1`` steps) all earlier
windows are compared with the suffix at once through ``sliding_window_view``; there is no
Python loop over context positions. :class:`NgramProposer` caps the context to its last
``max_context`` tokens, bounding the per-step cost at ``O(max_context * max_n)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def _check_args(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def _last_occurrence(tokens: np.ndarray, n: int) -> int:
    """Start of the most recent occurrence of the length-``n`` suffix before it, or -1."""
    length = tokens.shape[0]
    windows = sliding_window_view(tokens[:length - 1], n)  # [length - n, n], starts < L - n
    matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))  # [M] starts
    return int(matches[-1]) if matches.size else -1


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens copied from after the latest earlier match of the suffix.

    ``tokens`` is the request's context, a 1-D integer array. Returns a 1-D array of the same
    dtype, empty when no suffix of length ``min_n .. max_n`` occurs earlier (or ``k == 0``).
    """
    tokens = np.asarray(tokens)
    _check_args(tokens, min_n, max_n, k)
    length = tokens.shape[0]
    if k > 0:
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            start = _last_occurrence(tokens, n)
            if start >= 0:
                return tokens[start + n:start + n + k].copy()
    return tokens[:0].copy()


def propose_ngram_reference(tokens: Sequence[int], min_n: int, max_n: int,
                            k: int) -> list[int]:
    """Plain-loop reference of :func:`propose_ngram`, for tests only."""
    tokens = list(tokens)
    length = len(tokens)
    if k == 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first, starting before the suffix
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup drafter with fixed settings; stateless, shareable across requests.

    ``min_n`` defaults to 2: single-token matches are frequent and weakly predictive, so
    their drafts would mostly be rejected and cost verification compute.
    """

    min_n: int = 2
    max_n: int = 4
    k: int = 4
    max_context: int = 4096  # only the last this-many tokens are searched

    def __post_init__(self) -> None:
        _check_args(np.zeros(0, dtype=np.int64), self.min_n, self.max_n, self.k)
        if self.max_context <= self.max_n:
            raise ValueError(f"max_context must exceed max_n, got {self.max_context}")

    def propose(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """Draft tokens for a request whose context is ``tokens`` (may be empty)."""
        window = np.asarray(tokens[-self.max_context:], dtype=np.int64)  # [<= max_context]
        found = propose_ngram(window, self.min_n, self.max_n, self.k)
        return list(found.tolist())
