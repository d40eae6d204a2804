"""Each request's proposal for a step, scored for the policy (:mod:`spec.speculator` asks).

A request's speculation method picks its proposer: ``suffix`` (the default) the suffix
tries' frequency-scored tree, ``recycling`` a token-recycling tree, ``ngram`` a chain,
``draft`` and ``head`` the draft model's or draft head's drafts (made later, into the slots
the scheduler reserves for them), ``combined`` the best of the suffix tree and the head's
(or model's) chain. A :class:`Candidate` carries the drafts and each node's score, the
estimated probability that its whole path is accepted, from the request's acceptance
tracker for that kind of proposal, which starts from the kind's estimate pooled over
requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.engine.request import Request
from quickdraft.spec.draft_head_runner import DraftHeadRunner
from quickdraft.spec.draft_model import DraftModelRunner
from quickdraft.spec.ngram import NgramProposer
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import AcceptanceTracker, expected_accepted
from quickdraft.spec.recycling import RecyclingProposer
from quickdraft.spec.state import corpus_lookups_to_skip, prior
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_corpus import SuffixCorpus
from quickdraft.spec.suffix_tree import available as suffix_tree_available
from quickdraft.spec.token_tree import TokenTree

# A sibling of rank r (its column in the recycling table) is accepted about this much less
# often than the top-1 successor, per rank.
RANK_DECAY = 0.5
# Most nodes of a drafted tree (the policy keeps the best ones its cost curve pays for).
MAX_TREE_NODES = 16

# Pooled acceptance estimates follow many requests' verifications: slower than a request's.
POOLED_DECAY = 0.95


# The kinds match_kind names, each with the shortest match it takes; and the names the
# suffix tries' and the corpus's drafts of each kind are tracked as.
_KIND_SHORTEST = ((1, "1-3"), (4, "4-7"), (8, "8+"))
_SUFFIX_KINDS = tuple((shortest, f"suffix/{kind}") for shortest, kind in _KIND_SHORTEST)
_CORPUS_KINDS = tuple(f"corpus/{kind}" for _, kind in _KIND_SHORTEST)
RUN = "+run"  # a kind's variant after a fully accepted verification (match_kind)


def match_kind(match_len: int, public: bool = False, after_full: bool = False) -> str:
    """What a suffix draft's acceptance is tracked as: by how long a context suffix it
    continues, whether it came from the public corpus ("corpus/…"; its drafts after a
    short match are accepted less often than the request's own), and whether the request's
    last verification accepted all its drafts ("…+run": a copy run under way). On SmolLM2
    spec_bench (C=1, 2026-11-25, 2-core AVX512-BF16 EPYC) drafts after a 2-token match
    gained 0.6-1.3 tokens a verification, after 8 or more 2.1-4.4. After a fully accepted
    verification the next drafts were accepted 0.72 / 0.75 / 0.84 at depths 1 / 2 / 3,
    otherwise 0.52 / 0.55 / 0.77 (2026-11-30, 2-core AMX Xeon, every C=1 drafting step of
    two passes; partly the longer matches such steps have, which the length kinds see too:
    tracked apart, C=1 came out 1.263x -> 1.280x and 1.233x -> 1.243x over off)."""
    kind = _KIND_SHORTEST[0][1]
    for shortest, name in _KIND_SHORTEST:
        if match_len >= shortest:
            kind = name
    return f"{'corpus' if public else 'suffix'}/{kind}{RUN if after_full else ''}"


@dataclass
class Candidate:
    """One request's proposal: ``tree`` None = ask the draft model for ``available``
    drafts; else the drafts with each node's ``scores`` (the estimated probability that its
    whole path is accepted, non-increasing along paths)."""

    request: Request
    source: str  # what the acceptance is credited to
    tree: TokenTree | None
    scores: list[float]
    available: int
    tracker: AcceptanceTracker
    room: int = 0  # most drafts the request may take this step (the scheduler's room)
    # combined: the free proposal (suffix tree) to use instead when drafting with the head
    # or draft model does not pay this step (the policy's rates decide)
    fallback: Candidate | None = None
    # (first depth, tracker) of the drafts deeper down that another tracker scores and
    # learns from (suffix drafts: by the match they extend, see match_kind); ``tracker``
    # has those above the first of them
    deeper: tuple[tuple[int, AcceptanceTracker], ...] = ()

    @property
    def trackers_by_depth(self) -> tuple[tuple[int, AcceptanceTracker], ...]:
        """(first depth, tracker) of each run of depths one tracker scores, from depth 1
        (what :func:`spec.policy.update_by_depth` takes)."""
        return ((1, self.tracker), *self.deeper)

    @property
    def gains(self) -> list[float] | None:
        """The nodes' scores in best-first order (what the policy grants by), or None."""
        return sorted(self.scores, reverse=True) if self.tree is not None else None


class Proposers:
    """The proposers (each the only writer of its tries or tables) and the pooled
    acceptance estimates (written only here); builds each request's :class:`Candidate`."""

    def __init__(self, method: str, max_k: int, ngram_min: int, ngram_max: int,
                 draft: DraftModelRunner | None = None, vocab_size: int = 0,
                 head: DraftHeadRunner | None = None,
                 suffix_corpus: SuffixCorpus | None = None) -> None:
        self.method = method
        self.ngram = NgramProposer(min_n=ngram_min, max_n=ngram_max, k=max_k)
        # suffix tries (per request, per tenant); None without gcc: "suffix" drafts n-grams
        self.suffix = SuffixProposer(_suffix_config(), suffix_corpus) \
            if suffix_tree_available() else None
        # target-prediction tables (per tenant): "recycling"
        self.recycling = RecyclingProposer(vocab_size) if vocab_size else None
        self.draft_model = draft
        self.head = head
        # acceptance by source (suffix drafts by match length) over all requests: a new
        # request's prior (acceptance rates only: nothing of any request's content)
        self.pools: dict[str, AcceptanceTracker] = {}
        self.num_unpayable_lookups = 0  # suffix look-ups skipped: nothing found could pay

    def method_of(self, request: Request) -> str:
        params: SpeculationParams | None = request.spec_params
        return params.method if params and params.method else self.method

    def candidate(self, request: Request, k: int, public: bool = True,
                  min_gain: float = 0.0) -> Candidate | None:
        """The request's proposal under its method: ``suffix`` drafts the suffix tries'
        frequency-scored tree; ``recycling`` a token-recycling tree; ``ngram`` a chain;
        ``combined`` the best of the suffix tree and the draft head's (or draft model's)
        chain (:meth:`_best_of`); ``draft`` the draft model. A free proposal (tree or chain)
        whose best node scores ``min_gain`` or less is None: no draft of it can pay (its
        nodes' scores are at most its tracker's ``alpha``).

        (``suffix`` used to fall back to a recycling tree when nothing matched. On SmolLM2
        on a 2-core AVX512-BF16 EPYC that lost: keeping the tables costs ~0.4 ms on every
        step and the fallback trees were rarely accepted; measured without it, suffix went
        from 0.97x to 1.08x on summaries and from 1.53x to 1.76x on code edits. See
        docs/benchmarks.md.)"""
        method = self.method_of(request)
        if method == "combined":
            return self._best_of(request, k, public)
        if method == "draft":
            return self._model_candidate(request, k)
        if method == "head":
            return self._head_candidate(request, k)
        found: Candidate | None = None
        if method == "suffix" and self.suffix is not None:
            found = self._suffix_tree(request, public, min_gain)
        elif method in ("ngram", "suffix"):
            found = self._chain(request, "ngram", self._ngram(request, k), min_gain)
        if method == "recycling":
            found = self._recycling_tree(request, min_gain)
        return found

    def _chain(self, request: Request, source: str, drafts: list[int],
               min_gain: float = 0.0) -> Candidate | None:
        if not drafts:
            return None
        tracker = self.tracker(request, source)
        if tracker.alpha <= min_gain:
            return None
        return Candidate(request, source, TokenTree.from_chain(drafts),
                          [tracker.alpha ** d for d in range(1, len(drafts) + 1)],
                          len(drafts), tracker)

    def _suffix_tree(self, request: Request, public: bool = True, min_gain: float = 0.0
                     ) -> Candidate | None:
        """The suffix tries' frequency-scored tree. ``reach[d]`` is the chance that the tree
        gets through depth d: each depth at the ``alpha`` of the kind of match it extends
        (the first draft's match plus the drafts before it: a 2-token match's third draft
        extends a 4-token one), which is what the depth-wise trackers measure (a tree's
        path, tested depth by depth; ``Candidate.deeper``). The nodes at depth d share
        ``reach[d]`` by their path probabilities (a chain scores ``reach[d]``; where the
        context continued three times one way and once another, the two branches get 3/4
        and 1/4 of it), capped by the parent's score: so the scores of the nodes granted
        add up to the drafts the policy expects accepted.

        Scored relative to the likeliest node at their depth instead (the likeliest path as
        a chain, a branch a third as often at a third), a depth's scores added up to more
        than ``reach[d]``: on SmolLM2 at C=8 (closed loop, 2-core AVX2-only Zen 3 EPYC,
        2026-12-01) trees with siblings were accepted 0.41-0.64x as often as their scores
        said (rag 1.48 tokens a verification for 3.21 expected). Shared by depth, one engine,
        arms alternating, against off, two runs each: C=1 (9 categories) 1.315x -> 1.340x
        and 1.304x -> 1.329x, C=8 1.016x -> 1.030x (5 categories) and 1.007x -> 1.020x (9).

        Scored by the first draft's kind alone (``alpha^d``), a short match's deeper drafts
        were priced too low: on SmolLM2 spec_bench (C=1, 2-core AVX512-BF16 Zen 4 EPYC,
        2026-11-30) drafts were accepted 0.56 / 0.75 / 0.88 of the time where they extended
        a 1-3 / 4-7 / 8-15 token match, whatever their depth. Scored by depth, one engine,
        arms alternating, against off: SmolLM2 C=1 1.285x -> 1.295x (4 rounds), C=8 1.038x
        both (3 rounds); Qwen2.5-Coder-1.5B C=1, five copy and chat categories 1.574x ->
        1.595x (2 rounds)."""
        assert self.suffix is not None
        state = request.spec_state
        public = public and self.suffix.corpus is not None
        if public and state.corpus_to_skip > 0:  # backing off the corpus (spec/state.py)
            state.corpus_to_skip -= 1
            public = False
        if min_gain > 0.0 and not self._may_pay(request, public, min_gain):
            self.num_unpayable_lookups += 1
            return None
        draft = self.suffix.propose_tree(request, MAX_TREE_NODES, public)
        if public and (draft.public or not draft.tokens):  # the corpus was asked
            state.corpus_idle += 1
            state.corpus_to_skip = corpus_lookups_to_skip(state.corpus_idle)
        if not draft.tokens:
            return None
        # acceptance is tracked per match length: a draft continuing a long matched suffix
        # is accepted far more often than one after a 2-token match, and a draft at depth d
        # continues a match d - 1 tokens longer than the first did (see match_kind)
        tracker = self.tracker(request, match_kind(draft.match_len, draft.public,
                                                   state.after_full))
        if tracker.alpha <= min_gain:  # (every node's score is at most alpha)
            return None
        tree = TokenTree(tuple(draft.tokens), tuple(draft.parents))
        depths = tree.depths
        total: dict[int, float] = {}  # path probability of the nodes at each depth
        for d, p in zip(depths, draft.probs, strict=True):
            total[d] = total.get(d, 0.0) + p
        # the depths from which a deeper draft extends a match of a longer kind, and the
        # chance reach[d] that the tree gets through depths 1..d, each at its own depth's
        # kind's alpha
        max_depth = max(depths)
        deeper = [(d, self.tracker(request, match_kind(shortest, draft.public,
                                                        state.after_full)))
                  for shortest, _ in _KIND_SHORTEST
                  if 1 < (d := shortest - draft.match_len + 1) <= max_depth]
        reach, alpha, next_kind = [1.0], tracker.alpha, 0
        for d in range(1, max_depth + 1):
            if next_kind < len(deeper) and deeper[next_kind][0] == d:
                alpha = deeper[next_kind][1].alpha
                next_kind += 1
            reach.append(reach[-1] * alpha)
        scores: list[float] = []
        for d, p, parent in zip(depths, draft.probs, draft.parents, strict=True):
            score = reach[d] * (p / total[d] if total[d] > 0 else 0.0)
            scores.append(min(score, scores[parent]) if parent >= 0 else score)
        return Candidate(request, "corpus" if draft.public else "suffix", tree, scores,
                          len(tree), tracker, deeper=tuple(deeper))

    def _may_pay(self, request: Request, public: bool, min_gain: float) -> bool:
        """Whether the suffix tries (or the corpus) could find ``request`` a draft scoring
        above ``min_gain``, before looking: a node scores at most its kind's ``alpha``, and
        a kind of draft after a match longer than the tries' bound
        (:meth:`spec.suffix.SuffixProposer.match_bound`) cannot be found. The same answer
        as looking and finding the draft's kind at or below ``min_gain``, without the
        look-up's cost (~0.1–0.3 ms a request after a model step has evicted the tries and
        the interpreter's state; at C=8 most look-ups are such); only the new tokens wait in
        the request's trie until its next look-up."""
        assert self.suffix is not None
        bound = self.suffix.match_bound(request)
        min_match = self.suffix.config.min_match_len
        run = RUN if request.spec_state.after_full else ""
        if any(self._alpha(request, kind + run) > min_gain for shortest, kind in _SUFFIX_KINDS
               if bound is None or max(shortest, min_match) <= bound):
            return True
        return public and self.suffix.corpus is not None and any(
            self._alpha(request, kind + run) > min_gain for kind in _CORPUS_KINDS)

    def _alpha(self, request: Request, kind: str) -> float:
        """:meth:`tracker`'s ``alpha`` for ``kind``, without making a tracker or a pool."""
        seeded = request.sampling_params.seeded_sampling
        return request.spec_state.alpha(kind, None if seeded else self.pools.get(kind))

    def _ngram(self, request: Request, k: int) -> list[int]:
        return self.ngram.propose(_context(request, self.ngram.max_context))[:k]

    def _recycling_tree(self, request: Request, min_gain: float = 0.0) -> Candidate | None:
        if self.recycling is None:
            return None
        tokens, parents, ranks = self.recycling.propose_tree(request, MAX_TREE_NODES)
        if not tokens:
            return None
        tracker = self.tracker(request, "recycling")
        if tracker.alpha <= min_gain:
            return None
        scores: list[float] = []
        for parent, rank in zip(parents, ranks, strict=True):
            above = scores[parent] if parent >= 0 else 1.0
            scores.append(above * tracker.alpha * RANK_DECAY ** rank)
        return Candidate(request, "recycling", TokenTree(tuple(tokens), tuple(parents)),
                          scores, len(tokens), tracker)

    def _model_candidate(self, request: Request, k: int) -> Candidate | None:
        if self.draft_model is None:
            return None
        return Candidate(request, "draft", None, [], k, self.tracker(request, "draft"))

    def _head_candidate(self, request: Request, k: int) -> Candidate | None:
        if self.head is None:
            return None
        return Candidate(request, "head", None, [], k, self.tracker(request, "head"))

    def _best_of(self, request: Request, k: int, public: bool = True
                 ) -> Candidate | None:
        """``combined``: the proposal expected to accept the most drafts this step. The
        suffix tries' tree costs nothing to draft, so the draft head's (or draft model's)
        chain, priced at its pooled-then-per-request acceptance, is taken when the tries
        match nothing or when it expects more than the tree's best ``k`` nodes; then the
        tree rides along as its ``fallback``, which the speculator's plan takes instead when the
        policy finds the step's rate higher with it (a head proposal costs a fraction of a
        step; a matched suffix tree costs nothing).

        (This used to merge every model-free proposal, n-gram and suffix chains and a
        token-recycling tree, into one tree. On SmolLM2, C=1, four spec_bench categories on
        the 2-core AVX512-BF16 EPYC (2026-11-25) that came out 1.18x against suffix trees'
        1.36x: its proposers took 1.0 ms a step against suffix's 0.17 ms (the recycling
        tables' upkeep alone ~0.4 ms), and the suffix trie finds what n-gram chains do.)"""
        free = (self._suffix_tree(request, public) if self.suffix is not None
                else self._chain(request, "ngram", self._ngram(request, k)))
        model = self._head_candidate(request, k) or self._model_candidate(request, k)
        if free is None or model is None:
            return free or model
        model_gain = expected_accepted(model.tracker.alpha, k)
        if model_gain <= sum(sorted(free.scores)[-k:]):
            return free
        model.fallback = free
        return model

    def pool(self, kind: str) -> AcceptanceTracker:
        """The pooled acceptance estimate of ``kind`` over all requests so far."""
        pooled = self.pools.get(kind)
        if pooled is None:
            pooled = self.pools[kind] = AcceptanceTracker(alpha=prior(kind),
                                                           decay=POOLED_DECAY)
        return pooled

    def tracker(self, request: Request, source: str) -> AcceptanceTracker:
        """The request's acceptance estimate for ``source`` (or a kind of suffix draft); a
        request's first starts from the pooled one (rates only: nothing of any request's
        content), which it keeps updating. A seeded sampled request's starts from the fixed
        prior instead: the random draws its verification consumes depend on how many
        drafts it gets, and its output must depend on its seed and prompt alone."""
        seeded = request.sampling_params.seeded_sampling
        return request.spec_state.tracker(source, None if seeded else self.pool(source))


def _context(request: Request, limit: int) -> list[int]:
    """The last ``limit`` tokens of prompt + output (earlier chat turns are in the prompt)."""
    out = request.output_token_ids
    if len(out) >= limit:
        return out[-limit:]
    return request.prompt_token_ids[-(limit - len(out)):] + out


def _suffix_config() -> SuffixConfig:
    """Defaults, or (benchmark tuning only) ``QUICKDRAFT_SUFFIX=factor,min_prob,min_match``."""
    import os

    raw = os.environ.get("QUICKDRAFT_SUFFIX")
    if not raw:
        return SuffixConfig()
    factor, min_prob, min_match = raw.split(",")
    return SuffixConfig(max_spec_factor=float(factor), min_token_prob=float(min_prob),
                        min_match_len=int(min_match))
