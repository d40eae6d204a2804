"""One request's speculation state: everything the speculator knows about a request, in one
object that lives on the request (``Request.spec_state``).

Its only writer is :class:`spec.speculator.Speculator`; the scheduler reaches it through the
speculator's hooks (``plan``/``draft``/``record`` each step, ``on_preempt`` and ``on_finish``
at those events), never directly.

Invariants (:meth:`RequestSpecState.check_invariants`, which the scheduler's check runs every
step in tests):

* ``draft_cache_valid <= request.num_computed_tokens``: the draft model's K/V is trusted only
  where the target's is (verified tokens); a preemption resets it to 0;
* ``head_valid <= request.num_computed_tokens``: likewise for the draft head's K/V; its
  pending target features (``head_feature_chunks``, rows for positions from
  ``head_features_start``; ``num_head_features`` of them) are dropped on preemption with it;
* ``model_k > 0`` only between ``plan`` (which reserves the slots) and ``draft`` (which fills
  the drafts) of one step;
* ``verifying`` is set only while the request has drafts in flight (None between steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quickdraft.spec.policy import AcceptanceTracker

# Where a request's drafts come from: acceptance is tracked per source.
SOURCES = ("ngram", "suffix", "corpus", "recycling", "draft", "head")

# Recycling drafts were accepted 26–34 % of the time on spec_bench (SmolLM2, 2026-11-24);
# the tracker's optimistic 0.6 made every request pay for drafts that mostly fail before it
# learned that, and suffix-with-fallback came out a little slower than suffix alone.
RECYCLING_PRIOR = 0.3


# Lookup back-off: after IDLE_BEFORE_BACKOFF proposals in a row that drafted nothing, a
# request skips one lookup between two, then two, up to MAX_LOOKUP_SKIP (a match is found
# at most that many steps late); any drafted step looks every step again. Where drafts do
# not pay (a big batch, text that never repeats) the proposers' per-step cost (~0.08 ms a
# request for the suffix tries on a 2-core AVX512-BF16 EPYC, a tenth of a step on an H200)
# then mostly goes away.
IDLE_BEFORE_BACKOFF = 8
MAX_LOOKUP_SKIP = 3

# Corpus back-off: the public corpus is asked where the request's tries find nothing, and
# there its look-up can cost more than the rest of the plan (on Qwen2.5-Coder-1.5B, whose
# step streams 1.1 GB past the caches, ~0.5 ms after each ~50 ms step; spec_bench's
# translations found 2-token matches in it in 8 % of steps and none was accepted:
# 0.964x). After CORPUS_IDLE_BEFORE_BACKOFF corpus look-ups in a row without an accepted
# corpus draft, a request asks it at every 2nd chance, then every 4th, 8th, ... every
# (MAX_CORPUS_SKIP + 1)-th (four look-ups at each rate); an accepted corpus draft restarts
# the count.
CORPUS_IDLE_BEFORE_BACKOFF = 8
MAX_CORPUS_SKIP = 31


def lookups_to_skip(idle_lookups: int) -> int:
    """Lookups a request skips after ``idle_lookups`` undrafted proposals in a row."""
    return min(idle_lookups // IDLE_BEFORE_BACKOFF, MAX_LOOKUP_SKIP)


def corpus_lookups_to_skip(idle: int) -> int:
    """Chances to ask the corpus a request lets pass after ``idle`` corpus look-ups in a row
    without an accepted corpus draft."""
    if idle < CORPUS_IDLE_BEFORE_BACKOFF:
        return 0
    return min((2 << (idle - CORPUS_IDLE_BEFORE_BACKOFF) // 4) - 1, MAX_CORPUS_SKIP)


def prior(source: str) -> float:
    """A new acceptance estimate for ``source`` when nothing was measured yet."""
    return RECYCLING_PRIOR if source == "recycling" else AcceptanceTracker.alpha


@dataclass
class RequestSpecState:
    trackers: dict[str, AcceptanceTracker] = field(default_factory=dict)  # by source
    # the trackers of the drafts in flight: (first depth, tracker), from depth 1
    verifying: tuple[tuple[int, AcceptanceTracker], ...] | None = None
    model_k: int = 0  # drafts the draft model owes this step (slots already reserved)
    in_flight_depth: int = 0  # depth of the drafts in flight (a chain's length)
    in_flight_source: str = ""  # the source their acceptance is credited to
    draft_cache_valid: int = 0  # draft-model K/V valid for positions [0, this)
    num_planned_steps: int = 0  # steps in which drafts were planned for the request
    head_valid: int = 0  # draft-head K/V valid for positions [0, this)
    # target features of positions [head_features_start, +m) not yet fed to the head, as the
    # steps delivered them ([rows, 3h] each; joined only when the head drafts: joining every
    # step copied a whole prompt's features per request per step)
    head_feature_chunks: list[torch.Tensor] = field(default_factory=list)
    head_features_start: int = 0
    # lookup back-off (Speculator._plan): proposals in a row that were not drafted (nothing
    # found, or refused by the policy), and lookups still to skip before the next one
    idle_lookups: int = 0
    lookups_to_skip: int = 0
    # corpus back-off (Proposers._suffix_tree, Speculator.record): corpus look-ups since its
    # last accepted draft, and chances to ask it still to let pass
    corpus_idle: int = 0
    corpus_to_skip: int = 0
    # the request's last verification accepted every draft along the path it tested (a copy
    # run under way): its suffix drafts are tracked as their own kinds (proposals.match_kind)
    after_full: bool = False
    num_head_features: int = 0  # rows in head_feature_chunks, counted as they come: summed
    # on every add, a request's cost grew with its steps (chunks pile up while the head
    # does not draft, e.g. at C=8)

    def tracker(self, source: str, pooled: AcceptanceTracker | None = None
                ) -> AcceptanceTracker:
        """The request's acceptance estimate for drafts from ``source`` (a source, or a kind
        of its drafts such as ``suffix/8+``); a new one starts from ``pooled`` (the estimate
        over earlier requests) where given."""
        if source not in self.trackers:  # recycling starts at its measured mean, not 0.6
            self.trackers[source] = AcceptanceTracker.from_pool(pooled) if pooled \
                else AcceptanceTracker(alpha=prior(source))
        return self.trackers[source]

    def alpha(self, source: str, pooled: AcceptanceTracker | None = None) -> float:
        """``tracker(source, pooled).alpha`` without making the tracker (made now, it would
        freeze the pooled estimate of now into the request's own)."""
        tracker = self.trackers.get(source)
        if tracker is not None:
            return tracker.alpha
        return pooled.alpha if pooled is not None else prior(source)

    def drop_in_flight(self) -> None:
        """The planned drafts will not be verified."""
        self.verifying = None
        self.model_k = 0
        self.in_flight_depth = 0
        self.in_flight_source = ""

    def on_preempt(self) -> None:
        """The request lost its KV blocks: nothing in flight, the draft cache restarts."""
        self.drop_in_flight()
        self.draft_cache_valid = 0
        self.head_valid = 0
        self.drop_features(0)
        self.idle_lookups = self.lookups_to_skip = 0
        self.after_full = False

    def head_features(self) -> torch.Tensor | None:
        """The kept features ``[m, 3h]`` (positions from ``head_features_start``), or None."""
        chunks = self.head_feature_chunks
        if not chunks:
            return None
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        return chunks[0]

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """Target features ``rows [m, 3h]`` of positions ``[start, start + m)``; a gap or an
        overlap with what is kept restarts the kept rows at ``start``."""
        if self.head_feature_chunks and self.head_features_start + self.num_head_features \
                == start:
            self.head_feature_chunks.append(rows)
            self.num_head_features += len(rows)
        else:
            self.head_feature_chunks, self.head_features_start = [rows], start
            self.num_head_features = len(rows)

    def drop_features(self, start: int) -> None:
        """The head has seen every position before ``start``: nothing kept."""
        self.head_feature_chunks = []
        self.head_features_start = start
        self.num_head_features = 0

    def check_invariants(self, num_computed_tokens: int) -> None:
        """Between steps (after the scheduler applied a step's output)."""
        assert 0 <= self.draft_cache_valid <= num_computed_tokens, \
            (self.draft_cache_valid, num_computed_tokens)
        assert 0 <= self.head_valid <= num_computed_tokens, (self.head_valid,
                                                             num_computed_tokens)
        assert self.model_k == 0 and self.verifying is None, (self.model_k, self.verifying)
        assert self.num_head_features == sum(len(c) for c in self.head_feature_chunks)
        assert 0 <= self.lookups_to_skip <= MAX_LOOKUP_SKIP and self.idle_lookups >= 0
