"""Engine-side speculation: the scheduler's :class:`engine.scheduler.Speculation`.

The scheduler decides; the speculator follows. Each step ``schedule()`` first chooses the
batch without drafts, then calls :meth:`Speculator.plan` with the chosen requests that decode
(all but their newest token computed), how many drafts each may take and the batch's real
size (prefill chunks included). For each, the request's proposer (or, for ``combined``, the
best of them) drafts; the adaptive policy decides how many drafts pay at this batch size;
model-free drafts go to ``request.spec_token_ids``, the draft model's count to
``spec_state.model_k``. The scheduler then reserves every draft's slot in the request's one
allocation and calls :meth:`Speculator.draft`, where the draft model fills what it owes into
those slots. After verification the scheduler reports each request through
:meth:`Speculator.record`; preemption and the end of a request reach
:meth:`Speculator.on_preempt` and :meth:`Speculator.on_finish`.

Per-request state lives in ``request.spec_state`` (:class:`spec.state.RequestSpecState`),
written only here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.step_plan import StepPlan
from quickdraft.spec.draft_head_runner import DraftHeadRunner, HeadInput
from quickdraft.spec.draft_model import DraftInput, DraftModelRunner
from quickdraft.spec.ngram import NgramProposer
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import AcceptanceTracker, SpeculationPolicy, expected_accepted
from quickdraft.spec.recycling import RecyclingProposer
from quickdraft.spec.state import lookups_to_skip, prior
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_corpus import SuffixCorpus
from quickdraft.spec.suffix_tree import available as suffix_tree_available
from quickdraft.spec.token_tree import TokenTree
from quickdraft.spec.verification import supports_speculation


@dataclass
class SpeculationStats:
    """Global counters (for the metrics endpoint)."""

    num_steps: int = 0  # verification steps (request-steps with >= 1 draft)
    num_drafted: int = 0
    num_accepted: int = 0
    # by depth in the draft (a chain's position): verifications that reached a draft at
    # that depth, and those that accepted one there
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    drafted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    proposer_seconds: float = 0.0  # wall time spent choosing drafts (all proposers)
    num_tree_steps: int = 0  # verifications of a tree (not a chain)
    num_tree_nodes: int = 0  # their drafts (tree size = num_tree_nodes / num_tree_steps)
    # per source (ngram / suffix / recycling / draft; combined counts its best source):
    # [verification steps, drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    num_skipped_lookups: int = 0  # proposals not made by the lookup back-off (spec.state)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the one sampled token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


MAX_DEPTH = 16  # deepest draft: a chain of the most drafts a request may take

# A sibling of rank r (its column in the recycling table) is accepted about this much less
# often than the top-1 successor, per rank.
RANK_DECAY = 0.5
# Most nodes of a drafted tree (the policy keeps the best ones its cost curve pays for).
MAX_TREE_NODES = 16
# The draft head drafts a tree of this many nodes per draft the policy grants it (the
# policy prices the head like a chain; a tree of twice the nodes costs a few more rows).
HEAD_NODES_PER_DRAFT = 2


# The public suffix corpus is asked only in steps of at most this many decoding requests: its
# drafts are accepted less often than a request's own (~40-55 %), which pays where extra rows
# cost little but not in a batch whose rows are already compute-bound. Same-process A/Bs
# (benchmarks/suffix_corpus_ab.py, 2026-11-27, 2-core AVX512-BF16 EPYC), decode speed-up
# over off without -> with it: C=1 1.371x -> 1.457x, C=2 1.345x -> 1.460x, C=4 1.254x ->
# 1.284x and 1.225x -> 1.270x; C=8 asked at any size 1.089x -> 1.075x and 1.046x -> 1.061x,
# asked at <= 4 requests 1.091x -> 1.095x.
CORPUS_MAX_REQUESTS = 4

# Pooled acceptance estimates follow many requests' verifications: slower than a request's.
POOLED_DECAY = 0.95


def _match_kind(match_len: int, public: bool = False) -> str:
    """What a suffix draft's acceptance is tracked as: by how long a context suffix it
    continues, and whether it came from the public corpus ("corpus/…"; its drafts after a
    short match are accepted less often than the request's own). On SmolLM2 spec_bench (C=1,
    2026-11-25, 2-core AVX512-BF16 EPYC) drafts after a 2-token match gained 0.6-1.3 tokens
    a verification, after 8 or more 2.1-4.4."""
    source = "corpus" if public else "suffix"
    if match_len >= 8:
        return f"{source}/8+"
    return f"{source}/4-7" if match_len >= 4 else f"{source}/1-3"


@dataclass
class _Candidate:
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
    fallback: _Candidate | None = None

    @property
    def gains(self) -> list[float] | None:
        """The nodes' scores in best-first order (what the policy grants by), or None."""
        return sorted(self.scores, reverse=True) if self.tree is not None else None


class Speculator:
    """Chooses each running request's drafts. ``kv`` is asked (never edited) for draft slots;
    ``draft`` is the draft-model runner (None: n-gram only); ``vocab_size`` sizes the token
    recycling tables (0: no recycling)."""

    def __init__(self, method: str, max_k: int, ngram_min: int, ngram_max: int,
                 policy: SpeculationPolicy, kv: KVCacheManager | None = None,
                 draft: DraftModelRunner | None = None, max_model_len: int = 1 << 30,
                 vocab_size: int = 0, head: DraftHeadRunner | None = None,
                 verify_trees: bool = True, suffix_corpus: SuffixCorpus | None = None) -> None:
        """``verify_trees`` False: every step verifies chains (each tree's best path), for a
        kernel backend where only a chain's rows get plain decoding's bits;
        ``suffix_corpus``: the public corpus the suffix tries draft from too."""
        self.method = method
        self.verify_trees = verify_trees
        self.max_k = max_k
        self.proposer = NgramProposer(min_n=ngram_min, max_n=ngram_max, k=max_k)
        # suffix tries (per request, per tenant); None without gcc: "suffix" drafts n-grams
        self.suffix = SuffixProposer(_suffix_config(), suffix_corpus) \
            if suffix_tree_available() else None
        # target-prediction tables (per tenant): "recycling"
        self.recycling = RecyclingProposer(vocab_size) if vocab_size else None
        self.policy = policy
        self.kv = kv
        self.draft_model = draft
        self.head = head
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        # acceptance by source (suffix drafts by match length) over all requests: a new
        # request's prior (acceptance rates only: nothing of any request's content)
        self._pools: dict[str, AcceptanceTracker] = {}
        self._chains_only = False  # this step verifies chains only (see _plan)

    def method_of(self, request: Request) -> str:
        params: SpeculationParams | None = request.spec_params
        return params.method if params and params.method else self.method

    def _wants(self, request: Request, room: int) -> int:
        """Most drafts this request may take (0 = no speculation for it); ``room``: what the
        scheduler leaves it this step."""
        params: SpeculationParams | None = request.spec_params
        if self.method_of(request) == "off" or not supports_speculation(request.sampling_params):
            return 0
        k = params.k if params and params.k is not None else self.max_k
        return max(min(k, self.max_k, room), 0)

    def _candidate(self, request: Request, k: int, public: bool = True
                   ) -> _Candidate | None:
        """The request's proposal under its method: ``suffix`` drafts the suffix tries'
        frequency-scored tree; ``recycling`` a token-recycling tree; ``ngram`` a chain;
        ``combined`` the best of the suffix tree and the draft head's (or draft model's)
        chain (:meth:`_best_of`); ``draft`` the draft model.

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
        found: _Candidate | None = None
        if method == "suffix" and self.suffix is not None:
            found = self._suffix_tree(request, public)
        elif method in ("ngram", "suffix"):
            found = self._chain(request, "ngram", self._ngram(request, k))
        if method == "recycling":
            found = self._recycling_tree(request)
        return found

    def _chain(self, request: Request, source: str, drafts: list[int]) -> _Candidate | None:
        if not drafts:
            return None
        tracker = self._tracker(request, source)
        return _Candidate(request, source, TokenTree.from_chain(drafts),
                          [tracker.alpha ** d for d in range(1, len(drafts) + 1)],
                          len(drafts), tracker)

    def _suffix_tree(self, request: Request, public: bool = True) -> _Candidate | None:
        """The suffix tries' frequency-scored tree. A node at depth d scores like a chain's
        d-th draft (``alpha^d``) times its path probability relative to the likeliest node
        at its depth (so the likeliest path is exactly a chain's scores, and a branch the
        context took a third as often scores a third), capped by its parent's score."""
        assert self.suffix is not None
        draft = self.suffix.propose_tree(request, MAX_TREE_NODES, public)
        if not draft.tokens:
            return None
        # acceptance is tracked per match length: a draft continuing a long matched suffix
        # is accepted far more often than one after a 2-token match (see _match_kind)
        kind = _match_kind(draft.match_len, draft.public)
        tracker = self._tracker(request, kind)
        tree = TokenTree(tuple(draft.tokens), tuple(draft.parents))
        depths = tree.depths
        top: dict[int, float] = {}
        for d, p in zip(depths, draft.probs, strict=True):
            top[d] = max(top.get(d, 0.0), p)
        scores: list[float] = []
        for d, p, parent in zip(depths, draft.probs, draft.parents, strict=True):
            score = tracker.alpha ** d * (p / top[d] if top[d] > 0 else 0.0)
            scores.append(min(score, scores[parent]) if parent >= 0 else score)
        return _Candidate(request, "corpus" if draft.public else "suffix", tree, scores,
                          len(tree), tracker)

    def _ngram(self, request: Request, k: int) -> list[int]:
        return self.proposer.propose(_context(request, self.proposer.max_context))[:k]

    def _recycling_tree(self, request: Request) -> _Candidate | None:
        if self.recycling is None:
            return None
        tokens, parents, ranks = self.recycling.propose_tree(request, MAX_TREE_NODES)
        if not tokens:
            return None
        tracker = self._tracker(request, "recycling")
        scores: list[float] = []
        for parent, rank in zip(parents, ranks, strict=True):
            above = scores[parent] if parent >= 0 else 1.0
            scores.append(above * tracker.alpha * RANK_DECAY ** rank)
        return _Candidate(request, "recycling", TokenTree(tuple(tokens), tuple(parents)),
                          scores, len(tokens), tracker)

    def _model_candidate(self, request: Request, k: int) -> _Candidate | None:
        if self.draft_model is None:
            return None
        return _Candidate(request, "draft", None, [], k, self._tracker(request, "draft"))

    def _head_candidate(self, request: Request, k: int) -> _Candidate | None:
        if self.head is None:
            return None
        return _Candidate(request, "head", None, [], k, self._tracker(request, "head"))

    def _best_of(self, request: Request, k: int, public: bool = True
                 ) -> _Candidate | None:
        """``combined``: the proposal expected to accept the most drafts this step. The
        suffix tries' tree costs nothing to draft, so the draft head's (or draft model's)
        chain, priced at its pooled-then-per-request acceptance, is taken when the tries
        match nothing or when it expects more than the tree's best ``k`` nodes; then the
        tree rides along as its ``fallback``, which :meth:`_plan` takes instead when the
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

    def _pool(self, kind: str) -> AcceptanceTracker:
        """The pooled acceptance estimate of ``kind`` over all requests so far."""
        pooled = self._pools.get(kind)
        if pooled is None:
            pooled = self._pools[kind] = AcceptanceTracker(alpha=prior(kind),
                                                           decay=POOLED_DECAY)
        return pooled

    def _tracker(self, request: Request, source: str) -> AcceptanceTracker:
        """The request's acceptance estimate for ``source`` (or a kind of suffix draft); a
        request's first starts from the pooled one (rates only: nothing of any request's
        content), which it keeps updating. A seeded sampled request's starts from the fixed
        prior instead: the random draws its verification consumes depend on how many
        drafts it gets, and its output must depend on its seed and prompt alone."""
        seeded = request.sampling_params.seeded_sampling
        return request.spec_state.tracker(source, None if seeded else self._pool(source))

    def recycler(self, requests: list[Request]
                 ) -> Callable[[torch.Tensor, StepPlan], None] | None:
        """What the runner calls with a step's logits ``[num_sample_rows, vocab]`` and plan to
        feed the recycling tables, for the step's ``requests`` (in the scheduler output's
        order); None (no top-k computed) when none of them drafts with recycling."""
        if self.recycling is None:
            return None
        wanted = [self.method_of(r) == "recycling"
                  and supports_speculation(r.sampling_params) for r in requests]
        if not any(wanted):
            return None
        recycling, tenants = self.recycling, [r.cache_salt for r in requests]
        return lambda logits, plan: recycling.observe_step(logits, plan, tenants, wanted)

    def plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
             budget: int) -> None:
        """Drafts for this step's decoding ``requests`` (the scheduler's call): see the module
        docstring. ``rooms[i]``: most drafts request i may take; ``budget``: in all."""
        start = time.perf_counter()
        try:
            self._plan(requests, rooms, num_plain_tokens, budget)
        finally:
            self.stats.proposer_seconds += time.perf_counter() - start

    def _token_weight(self, request: Request) -> float:
        """What one of ``request``'s tokens is worth in the step's rate (background less)."""
        return 1.0 if request.priority <= 0 else self.policy.background_weight

    def _plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
              budget: int) -> None:
        candidates: list[_Candidate] = []
        looked: list[Request] = []  # requests whose proposers ran this step
        public = len(requests) <= CORPUS_MAX_REQUESTS  # may draft from the public corpus
        for request, room in zip(requests, rooms, strict=True):
            request.clear_drafts()
            k = self._wants(request, room)
            if k and request.spec_state.lookups_to_skip > 0:  # backing off
                request.spec_state.lookups_to_skip -= 1
                self.stats.num_skipped_lookups += 1
                continue
            if k:
                looked.append(request)
            if k and (candidate := self._candidate(request, k, public)) is not None:
                for c in (candidate, candidate.fallback):
                    if c is None:
                        continue
                    params = request.spec_params
                    if c.tree is not None:
                        # a tree's nodes: within the room (its depth never exceeds its size)
                        # and a request's own k; past max_k, since only a path is accepted
                        limit = params.k if params and params.k is not None \
                            else MAX_TREE_NODES
                        c.available = min(c.available, room, limit)
                    c.room = min(room, params.k) if params and params.k is not None \
                        else room
                candidates.append(candidate)
        try:
            self._grant(candidates, requests, num_plain_tokens, budget)
        finally:
            for request in looked:  # the back-off follows what was drafted
                state = request.spec_state
                drafted = bool(request.spec_token_ids) or state.model_k > 0
                state.idle_lookups = 0 if drafted else state.idle_lookups + 1
                state.lookups_to_skip = lookups_to_skip(state.idle_lookups)

    def _grant(self, candidates: list[_Candidate], requests: list[Request],
               num_plain_tokens: int, budget: int) -> None:
        """The policy's drafts for this step's ``candidates``, written to their requests."""
        if not candidates:
            return
        weights = [self._token_weight(c.request) for c in candidates]
        tokens = sum(self._token_weight(r) for r in requests)  # the step's, drafts aside
        ks, candidates = self._allocate(candidates, num_plain_tokens, weights,
                                        tokens - sum(weights))
        # Tree verification takes one-hot drafts only: a step where a sampled request
        # verifies draft-model (or head) distributions verifies chains (each tree's best
        # path; the head drafts a chain).
        chains_only = not self.verify_trees or any(
            c.tree is None and not c.request.sampling_params.greedy
            for c, k in zip(candidates, ks, strict=True) if k)
        self._chains_only = chains_only
        num_tokens = num_plain_tokens + sum(ks)
        for c, k in zip(candidates, ks, strict=True):
            c.tracker.steps_since_probe += 1
            if k == 0 and c.tracker.alpha <= self.policy.probe_below_alpha \
                    and c.tracker.steps_since_probe >= self.policy.probe_interval \
                    and self.policy.probe_pays(num_tokens, tokens):
                k = 1  # re-test a request whose acceptance had collapsed (not one that
                # was refused because drafting costs too much at this batch size), in a
                # step where a fair draft would pay
                num_tokens += 1
            k = min(k, budget)
            if not k:
                continue
            budget -= k
            c.tracker.steps_since_probe = 0
            state = c.request.spec_state
            state.verifying = c.tracker
            state.in_flight_source = c.source
            state.num_planned_steps += 1
            if c.tree is None:  # the draft model's chain, or the head's tree
                state.model_k = k
                if c.source == "head" and c.request.sampling_params.greedy \
                        and not chains_only:
                    state.model_k = min(HEAD_NODES_PER_DRAFT * k, c.room, budget + k)
                    budget -= state.model_k - k
                state.in_flight_depth = k
                continue
            tree = c.tree.top_nodes(c.scores, k)
            if chains_only and (not tree.is_chain or len(tree) > self.max_k):
                # a chain holds at most max_k drafts (what a CUDA graph's rows allow; a
                # tree's nodes may be more, since only one path of them is accepted)
                tree = TokenTree.from_chain(_best_path(c.tree, c.scores, min(k, self.max_k)))
            c.request.spec_token_ids = list(tree.token_ids)
            c.request.spec_tree = None if tree.is_chain else tree
            state.in_flight_depth = tree.max_depth

    def _allocate(self, candidates: list[_Candidate], num_plain_tokens: int,
                  weights: list[float], other_tokens: float,
                  ) -> tuple[list[int], list[_Candidate]]:
        """The policy's draft counts for ``candidates``; where some carry a free
        ``fallback`` (combined), also for the fallbacks in place of the refused ones and in
        place of all of them, keeping whichever allocation gives the step the best rate."""
        def rate(cands: list[_Candidate]) -> tuple[list[int], float]:
            return self.policy.allocate_with_rate(
                [c.tracker.alpha for c in cands], [c.available for c in cands],
                num_plain_tokens, [c.tree is None for c in cands], weights,
                [c.gains for c in cands], other_tokens=other_tokens)

        ks, best = rate(candidates)
        if not any(c.fallback is not None for c in candidates):
            return ks, candidates
        chosen = candidates

        def swap(c: _Candidate, use: bool) -> _Candidate:
            return c.fallback if use and c.fallback is not None else c
        refused = [swap(c, k == 0) for c, k in zip(candidates, ks, strict=True)]
        every = [swap(c, True) for c in candidates]
        tried = [candidates]
        for alternative in (refused, every):
            if any(all(x is y for x, y in zip(alternative, t, strict=True))
                   for t in tried):  # the same candidates: the same answer
                continue
            tried.append(alternative)
            alt_ks, alt_rate = rate(alternative)
            if alt_rate > best:
                ks, best, chosen = alt_ks, alt_rate, alternative
        return ks, chosen

    def draft(self, requests: list[Request]) -> None:
        """The draft model (or head) drafts ``spec_state.model_k`` tokens for each of
        ``requests`` in one batched call, into the slots the scheduler reserved (the block
        tables already cover ``num_tokens + model_k`` positions)."""
        start = time.perf_counter()
        by_head = [r for r in requests if r.spec_state.in_flight_source == "head"]
        if by_head:
            self._draft_with_head(by_head)
        if len(by_head) < len(requests):
            self._draft_with_model([r for r in requests
                                    if r.spec_state.in_flight_source != "head"])
        self.stats.proposer_seconds += time.perf_counter() - start

    def _draft_with_model(self, requests: list[Request]) -> None:
        assert self.draft_model is not None and self.kv is not None
        inputs: list[DraftInput] = []
        for request in requests:
            state = request.spec_state
            # Invariant: the draft cache is valid only where the target's is (verified).
            done = min(state.draft_cache_valid, request.num_computed_tokens)
            rid = request.request_id
            assert len(self.kv.block_table(rid)) * self.kv.block_size \
                >= request.num_tokens + state.model_k, "draft slots not reserved"
            inputs.append(DraftInput(
                pending_token_ids=request.token_ids_slice(done, request.num_tokens),
                start_pos=done, k=state.model_k, block_table=tuple(self.kv.block_table(rid)),
                sampling_params=request.sampling_params, generator=request.generator))
        for request, inp, out in zip(requests, inputs, self.draft_model.propose(inputs),
                                     strict=True):
            request.spec_token_ids = out.token_ids
            request.spec_draft_probs = out.probs
            request.spec_state.model_k = 0
            request.spec_state.draft_cache_valid = request.num_tokens + inp.k - 1

    def _draft_with_head(self, requests: list[Request]) -> None:
        """The head's tree (greedy; a chain for sampled requests or in a chains-only step)
        of ``model_k`` nodes per request. It first catches up on the target features of the
        positions verified since its last draft; a request missing them drafts nothing."""
        assert self.head is not None and self.kv is not None
        inputs: list[HeadInput] = []
        owed: list[Request] = []
        for request in requests:
            state = request.spec_state
            n = request.num_tokens  # the last token is pending: features end at n - 2
            feats, fstart = state.head_features(), state.head_features_start
            start = min(max(state.head_valid, fstart), n - 2)
            if feats is None or not fstart <= start or fstart + len(feats) < n - 1:
                request.spec_state.model_k = 0  # (a gap in the features: draft nothing)
                continue
            rid = request.request_id
            assert len(self.kv.block_table(rid)) * self.kv.block_size \
                >= n + state.model_k, "draft slots not reserved"
            inputs.append(HeadInput(
                features=feats[start - fstart:n - 1 - fstart],
                next_token_ids=request.token_ids_slice(start + 1, n), start_pos=start,
                k=state.model_k, block_table=tuple(self.kv.block_table(rid)),
                sampling_params=request.sampling_params, generator=request.generator,
                tree=not self._chains_only, max_depth=state.in_flight_depth or None))
            owed.append(request)
        for request, out in zip(owed, self.head.propose(inputs), strict=True):
            state = request.spec_state
            request.spec_token_ids = list(out.tree.token_ids)
            request.spec_tree = None if out.tree.is_chain else out.tree
            request.spec_draft_probs = out.probs
            state.model_k = 0
            state.in_flight_depth = out.tree.max_depth if len(out.tree) else 0
            # head K/V now holds positions [0, n - 1); features of those are spent
            state.head_valid = request.num_tokens - 1
            state.drop_features(request.num_tokens - 1)

    def features_wanted(self, requests: list[Request]) -> list[bool] | None:
        """Which of this step's requests need the target's features (for the draft head);
        None when none does."""
        if self.head is None:
            return None
        wanted = [self.method_of(r) in ("head", "combined")
                  and supports_speculation(r.sampling_params) for r in requests]
        return wanted if any(wanted) else None

    def observe_features(self, requests: list[Request], starts: list[int],
                         features: list[torch.Tensor | None]) -> None:
        """The step's verified target features per request (rows from ``starts[i]``)."""
        for request, start, rows in zip(requests, starts, features, strict=True):
            if rows is not None and len(rows):
                request.spec_state.add_features(start, rows)

    def cancel(self, request: Request) -> None:
        """The drafts planned for ``request`` will not be verified this step."""
        request.spec_state.drop_in_flight()

    def on_preempt(self, request: Request) -> None:
        request.spec_state.on_preempt()

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Account one verification of ``num_drafted`` drafts for ``request``."""
        state = request.spec_state
        tracker, state.verifying = state.verifying, None
        depth, state.in_flight_depth = state.in_flight_depth or num_drafted, 0
        source, state.in_flight_source = state.in_flight_source or "given", ""
        # the draft model's cache holds real tokens only up to the verified ones
        state.draft_cache_valid = min(state.draft_cache_valid, request.num_computed_tokens)
        if num_drafted == 0:
            return
        if tracker is not None:  # a tree's acceptance is its path's, tested depth-wise
            tracker.update(depth, num_accepted)
        request.num_spec_steps += 1
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        s = self.stats
        s.num_steps += 1
        s.num_drafted += num_drafted
        s.num_accepted += num_accepted
        for pos in range(min(depth, MAX_DEPTH)):
            s.drafted_per_position[pos] += 1
            if pos < num_accepted:
                s.accepted_per_position[pos] += 1
        if num_drafted > depth:  # a tree
            s.num_tree_steps += 1
            s.num_tree_nodes += num_drafted
        counts = s.by_source.setdefault(source, [0, 0, 0])
        counts[0] += 1
        counts[1] += num_drafted
        counts[2] += num_accepted

    def on_finish(self, request: Request, status: RequestStatus) -> None:
        """The request is done: drop its state; its output joins its tenant's suffix
        partition when it ended normally or was cancelled (not on an error)."""
        request.spec_state.on_preempt()
        request.spec_state.trackers.clear()  # (the request object may outlive the engine's use)
        if self.suffix is not None:
            if status != RequestStatus.FINISHED_ERROR and request.error is None:
                self.suffix.finish(request)
            else:
                self.suffix.forget(request.request_id)


def _best_path(tree: TokenTree, scores: list[float], k: int) -> list[int]:
    """The tokens of the path that follows the best-scored child from the root, at most
    ``k`` deep."""
    path: list[int] = []
    node = -1
    while len(path) < k and (kids := tree.children(node)):
        node = max(kids, key=lambda c: scores[c])
        path.append(tree.token_ids[node])
    return path


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
