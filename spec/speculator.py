"""Engine-side speculation: the scheduler's :class:`engine.scheduler.Speculation`.

The scheduler decides; the speculator follows. Each step ``schedule()`` first chooses the
batch without drafts, then calls :meth:`Speculator.plan` with the chosen requests that decode
(all but their newest token computed), how many drafts each may take and the batch's real
size (prefill chunks included). For each, the request's proposer (or, for ``combined``, the
best of them) drafts (:mod:`spec.proposals`); the adaptive policy decides how many drafts
pay at this batch size; model-free drafts go to ``request.spec_token_ids``, the draft
model's count to ``spec_state.model_k``. The scheduler then reserves every draft's slot in
the request's one allocation and calls :meth:`Speculator.draft`, where the draft model fills
what it owes into those slots. After verification the scheduler reports each request through
:meth:`Speculator.record`; preemption and the end of a request reach
:meth:`Speculator.on_preempt` and :meth:`Speculator.on_finish`.

Per-request state lives in ``request.spec_state`` (:class:`spec.state.RequestSpecState`),
written only here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.priorities import INTERACTIVE
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.step_plan import StepPlan
from quickdraft.spec.draft_cost import ObservedDraftCost
from quickdraft.spec.draft_head_runner import DraftHeadRunner
from quickdraft.spec.draft_model import DraftModelRunner
from quickdraft.spec.model_drafting import ModelDrafting
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import SpeculationPolicy, update_by_depth
from quickdraft.spec.proposals import MAX_TREE_NODES, Candidate, Proposers
from quickdraft.spec.recycling import RecyclingProposer
from quickdraft.spec.speed_guard import SpeedGuard, SpeedGuardConfig
from quickdraft.spec.state import lookups_to_skip
from quickdraft.spec.stats import SpeculationStats
from quickdraft.spec.suffix import SuffixProposer
from quickdraft.spec.suffix_corpus import SuffixCorpus
from quickdraft.spec.token_tree import TokenTree
from quickdraft.spec.verification import supports_speculation

# The draft head drafts a tree of this many nodes per draft the policy grants it where a row
# costs little beside the step (a GPU), else a chain: the policy decides by its cost curve
# and prices the rows (spec.policy.SpeculationPolicy.model_rows_per_draft).
HEAD_NODES_PER_DRAFT = 2

# The public suffix corpus is asked only in steps of at most this many decoding requests: its
# drafts are accepted less often than a request's own (~40-55 %), which pays where extra rows
# cost little, not in a compute-bound batch (benchmarks/suffix_corpus_ab.py, 2026-11-27,
# AVX512-BF16 EPYC: C=1 1.371x -> 1.457x with it, C=4 1.254x -> 1.284x, C=8 asked at any
# size 1.089x -> 1.075x, at <= 4 requests 1.091x -> 1.095x; docs/benchmarks.md).
CORPUS_MAX_REQUESTS = 4


class Speculator:
    """Chooses each running request's drafts. ``kv`` is asked (never edited) for draft slots;
    ``draft`` is the draft-model runner (None: n-gram only); ``vocab_size`` sizes the token
    recycling tables (0: no recycling)."""

    def __init__(self, method: str, max_k: int, ngram_min: int, ngram_max: int,
                 policy: SpeculationPolicy, kv: KVCacheManager | None = None,
                 draft: DraftModelRunner | None = None, max_model_len: int = 1 << 30,
                 vocab_size: int = 0, head: DraftHeadRunner | None = None,
                 verify_trees: bool = True, suffix_corpus: SuffixCorpus | None = None,
                 speed_guard: SpeedGuardConfig | None = None,
                 draft_cost: ObservedDraftCost | None = None) -> None:
        """``verify_trees`` False: every step verifies chains (each tree's best path), for a
        kernel backend where only a chain's rows get plain decoding's bits;
        ``suffix_corpus``: the public corpus the suffix tries draft from too;
        ``speed_guard``: each method's realised speed is checked against the plain path with
        this configuration (None: no check); ``draft_cost``: the policy's draft-model (or
        head) costs, which each proposal's time updates (None: not observed)."""
        self.verify_trees = verify_trees
        self.max_k = max_k
        self.proposers = Proposers(method, max_k, ngram_min, ngram_max, draft, vocab_size,
                                   head, suffix_corpus)
        self.policy = policy
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        self._chains_only = False  # this step verifies chains only (see _plan)
        self.speed_guard = speed_guard
        self.guards: dict[str, SpeedGuard] = {}  # by method, made at its first counted step
        self.draft_cost = draft_cost
        self.model_drafting = ModelDrafting(self.proposers, kv, self.stats, draft_cost)

    @property
    def draft_model(self) -> DraftModelRunner | None:
        return self.proposers.draft_model

    @property
    def head(self) -> DraftHeadRunner | None:
        return self.proposers.head

    @property
    def suffix(self) -> SuffixProposer | None:
        """The suffix tries (None without gcc)."""
        return self.proposers.suffix

    @property
    def recycling(self) -> RecyclingProposer | None:
        """The token recycling tables (None without a vocabulary size)."""
        return self.proposers.recycling

    def method_of(self, request: Request) -> str:
        return self.proposers.method_of(request)

    def _candidate(self, request: Request, k: int, public: bool = True,
                   min_gain: float = 0.0) -> Candidate | None:
        """The request's proposal (:meth:`spec.proposals.Proposers.candidate`)."""
        return self.proposers.candidate(request, k, public, min_gain)

    def speculates(self, request: Request) -> bool:
        """Whether ``request`` may speculate in this step at all: its method is on, its
        sampling supports it, and its method's speed guard is not holding it off."""
        method = self.method_of(request)
        if method == "off" or not supports_speculation(request.sampling_params):
            return False
        guard = self.guards.get(method)
        return guard is None or guard.speculate_now()

    def observe_step(self, requests: list[Request], decoding: bool, tokens: int,
                     seconds: float) -> None:
        """A finished engine step (the engine's call): ``requests`` ran, ``decoding`` (each
        fed only its pending token and drafts), emitting ``tokens`` in ``seconds`` in all.
        Counted by the speed guard of their method when they share one."""
        if self.speed_guard is None or not decoding or not requests:
            return
        method = self.method_of(requests[0])
        if method == "off" or any(self.method_of(r) != method for r in requests[1:]):
            return
        guard = self.guards.get(method)
        if guard is None:
            guard = self.guards[method] = SpeedGuard(self.speed_guard)
        guard.observe(len(requests), tokens, seconds)

    @property
    def num_guard_off_steps(self) -> int:
        """Steps in which a method's speed guard held speculation off (all methods)."""
        return sum(g.num_off_steps for g in self.guards.values())

    @property
    def num_guard_suspensions(self) -> int:
        """Times a guard found its method slower than the plain path and suspended it."""
        return sum(g.num_suspensions for g in self.guards.values())

    def _wants(self, request: Request, room: int) -> int:
        """Most drafts this request may take (0 = no speculation for it); ``room``: what the
        scheduler leaves it this step."""
        params: SpeculationParams | None = request.spec_params
        if not self.speculates(request):
            return 0
        k = params.k if params and params.k is not None else self.max_k
        return max(min(k, self.max_k, room), 0)

    def recycler(self, requests: list[Request]
                 ) -> Callable[[torch.Tensor, StepPlan], None] | None:
        """What the runner calls with a step's logits ``[num_sample_rows, vocab]`` and plan to
        feed the recycling tables, for the step's ``requests`` (in the scheduler output's
        order); None (no top-k computed) when none of them drafts with recycling."""
        if self.recycling is None:
            return None
        wanted = [self.method_of(r) == "recycling" and self.speculates(r) for r in requests]
        if not any(wanted):
            return None
        recycling, tenants = self.recycling, [r.cache_salt for r in requests]
        return lambda logits, plan: recycling.observe_step(logits, plan, tenants, wanted)

    def plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
             budget: int) -> None:
        """Drafts for this step's decoding ``requests`` (the scheduler's call): see the module
        docstring. ``rooms[i]``: most drafts request i may take; ``budget``: in all."""
        start = time.perf_counter()
        if self.draft_cost is not None:
            self.draft_cost.tick()
        try:
            self._plan(requests, rooms, num_plain_tokens, budget)
        finally:
            self.stats.proposer_seconds += time.perf_counter() - start

    def _token_weight(self, request: Request) -> float:
        """What one of ``request``'s tokens is worth in the step's rate (background less)."""
        return 1.0 if request.priority <= INTERACTIVE else self.policy.background_weight

    def _plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
              budget: int) -> None:
        candidates: list[Candidate] = []
        looked: list[Request] = []  # requests whose proposers ran this step
        public = len(requests) <= CORPUS_MAX_REQUESTS  # may draft from the public corpus
        # a free proposal scoring no more than the floor is dropped before it is scored and
        # allocated (priced at the first look-up; docs/architecture.md, "Looking for drafts")
        tokens = sum(self._token_weight(r) for r in requests)
        # the step's prompt tokens (a chunk, or waiting prompts admitted after these
        # requests): the rate drafts must raise is the decoding rows' (policy.step_cost)
        prefill = max(num_plain_tokens - len(requests), 0)
        floor: float | None = None
        for request, room in zip(requests, rooms, strict=True):
            request.clear_drafts()
            if not (k := self._wants(request, room)):
                continue
            if request.spec_state.lookups_to_skip > 0:  # backing off
                request.spec_state.lookups_to_skip -= 1
                self.stats.num_skipped_lookups += 1
                continue
            looked.append(request)
            if floor is None:
                floor = self.policy.free_draft_floor(num_plain_tokens, tokens, prefill)
            if (candidate := self._candidate(
                    request, k, public, floor / self._token_weight(request))) is not None:
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
            self._grant(candidates, tokens, num_plain_tokens, budget, prefill)
        finally:
            for request in looked:  # the back-off follows what was drafted
                state = request.spec_state
                drafted = bool(request.spec_token_ids) or state.model_k > 0
                state.idle_lookups = 0 if drafted else state.idle_lookups + 1
                state.lookups_to_skip = lookups_to_skip(state.idle_lookups)

    def _grant(self, candidates: list[Candidate], tokens: float, num_plain_tokens: int,
               budget: int, num_prefill_tokens: int = 0) -> None:
        """The policy's drafts for this step's ``candidates``, written to their requests
        (``tokens``: what the step's requests emit without drafts, weighted;
        ``num_prefill_tokens``: the prompt tokens among ``num_plain_tokens``)."""
        if not candidates:
            return
        weights = [self._token_weight(c.request) for c in candidates]
        ks, candidates = self._allocate(candidates, num_plain_tokens, weights,
                                        tokens - sum(weights), num_prefill_tokens)
        # Tree verification takes one-hot drafts only: a step where a sampled request
        # verifies draft-model (or head) distributions verifies chains (each tree's best
        # path; the head drafts a chain).
        chains_only = not self.verify_trees or any(
            c.tree is None and not c.request.sampling_params.greedy
            for c, k in zip(candidates, ks, strict=True) if k)
        self._chains_only = chains_only
        num_tokens = num_plain_tokens + sum(ks)
        head_rows = 0  # nodes a head draft takes this step (asked once, where one is granted)
        for c, k in zip(candidates, ks, strict=True):
            c.tracker.steps_since_probe += 1
            if k == 0 and c.tracker.alpha <= self.policy.probe_below_alpha \
                    and c.tracker.steps_since_probe >= self.policy.probe_interval \
                    and self.policy.probe_pays(num_tokens, tokens, num_prefill_tokens):
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
            state.verifying = c.trackers_by_depth
            state.in_flight_source = c.source
            state.num_planned_steps += 1
            if c.tree is None:  # the draft model's chain, or the head's tree
                state.model_k = k
                if c.source == "head" and c.request.sampling_params.greedy \
                        and not chains_only:
                    head_rows = head_rows or self.policy.model_rows_per_draft(
                        num_plain_tokens, num_prefill_tokens)
                    state.model_k = min(head_rows * k, c.room, budget + k)
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

    def _allocate(self, candidates: list[Candidate], num_plain_tokens: int,
                  weights: list[float], other_tokens: float, num_prefill_tokens: int = 0,
                  ) -> tuple[list[int], list[Candidate]]:
        """The policy's draft counts for ``candidates``; where some carry a free
        ``fallback`` (combined), also for the fallbacks in place of the refused ones and in
        place of all of them, keeping whichever allocation gives the step the best rate."""
        def rate(cands: list[Candidate]) -> tuple[list[int], float]:
            return self.policy.allocate_with_rate(
                [c.tracker.alpha for c in cands], [c.available for c in cands],
                num_plain_tokens, [c.tree is None for c in cands], weights,
                [c.gains for c in cands], other_tokens=other_tokens,
                num_prefill_tokens=num_prefill_tokens)

        ks, best = rate(candidates)
        if not any(c.fallback is not None for c in candidates):
            return ks, candidates
        chosen = candidates

        def swap(c: Candidate, use: bool) -> Candidate:
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
        tables already cover ``num_tokens + model_k`` positions): :class:`ModelDrafting`."""
        self.model_drafting.draft(requests, self._chains_only)

    def features_wanted(self, requests: list[Request]) -> list[bool] | None:
        """Which of this step's requests need the target's features (for the draft head);
        None when none does."""
        if self.head is None:
            return None
        wanted = [self.method_of(r) in ("head", "combined") and self.speculates(r)
                  for r in requests]
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
        trackers, state.verifying = state.verifying, None
        depth, state.in_flight_depth = state.in_flight_depth or num_drafted, 0
        source, state.in_flight_source = state.in_flight_source or "given", ""
        # the draft model's cache holds real tokens only up to the verified ones
        state.draft_cache_valid = min(state.draft_cache_valid, request.num_computed_tokens)
        state.after_full = num_drafted > 0 and num_accepted >= depth
        if num_drafted == 0:
            return
        if trackers is not None:  # a tree's acceptance is its path's, tested depth-wise
            update_by_depth(trackers, depth, num_accepted)
        if source == "corpus" and num_accepted:  # the corpus pays here: ask it every time
            state.corpus_idle = state.corpus_to_skip = 0
        request.num_spec_steps += 1
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        self.stats.add(source, depth, num_drafted, num_accepted)

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
