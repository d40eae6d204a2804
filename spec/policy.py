"""Adaptive speculation: how many draft tokens each request verifies this step.

Per request we keep ``alpha``, a running estimate of the chance that one draft token is
accepted. With ``k`` drafts a step emits ``E(k) = 1 + alpha + ... + alpha^k`` tokens on
average, and the k-th extra draft adds ``alpha^k``. The step's cost is ``cost(N)`` for ``N``
query tokens in the batch, measured at start-up (:mod:`spec.step_cost`): flat while the
verify batch is memory-bound, rising once it is compute-bound.

Each step, drafts are granted one at a time to the request with the largest marginal gain
while ``(tokens + gain) / cost(N + 1) > tokens / cost(N)``, i.e. while speculation raises the
batch's tokens per second (``tokens``: what every request in the step emits, drafting or
not). A request whose acceptance has collapsed therefore gets ``k = 0`` (speculation off);
it is probed again with one draft every ``probe_interval`` steps so that ``alpha`` can
recover, in steps where a draft accepted half the time would pay. When the batch is large,
the cost curve turns speculation down for everyone.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quickdraft.spec.step_cost import ObservedStepCost, StepCost


def expected_accepted(alpha: float, num_drafts: int) -> float:
    """Expected accepted drafts of a chain of ``num_drafts``, each accepted with probability
    ``alpha`` once the ones before it were: ``alpha + alpha^2 + ... + alpha^n``."""
    if num_drafts <= 0 or alpha <= 0.0:
        return 0.0
    if alpha >= 1.0:
        return float(num_drafts)
    return alpha * (1.0 - alpha ** num_drafts) / (1.0 - alpha)


# A request's estimate starts as its kind's pooled one, which counts as POOL_STRENGTH tested
# drafts at first and POOL_STRENGTH_DECAY times less at each of the request's verifications.
# Drafts are granted by this estimate, so the most went where it was highest by chance: with
# the request's own moving averages alone (SmolLM2, spec_bench, C=1, suffix, the 2-core AMX
# Xeon, 2026-11-30) verifications granted six or more drafts expected 311 accepted and got
# 270 after 8+-token matches, 37 and got 10 after 4-7, while single drafts expected fewer
# than they got. Shrunk toward the pool: 1.170x -> 1.210x over off (one engine, arms
# alternating, 4 rounds); a pool that kept its full strength, 1.141 -> 1.196, 1.177 -> 1.215,
# 1.170 -> 1.178, but then a request whose drafts are never accepted keeps 0.6 of the pool's
# estimate and keeps drafting; with the strength fading it falls to ~0.1 of it within 20
# verifications.
POOL_STRENGTH = 5.0
POOL_STRENGTH_DECAY = 0.9


@dataclass
class AcceptanceTracker:
    """Acceptance estimate: the chance that a draft is accepted once the drafts before it
    were. ``pooled``: an estimate over many requests' drafts of the same kind, updated
    alongside; a request's tracker starts from it (see :meth:`from_pool`).

    Accepted over tested drafts, not the average of each verification's ratio: with ``a`` of
    ``n`` drafts accepted a verification tested ``min(a + 1, n)`` of them, and the mean of
    ``a / (a + 1)`` is well below the acceptance rate (for a long chain accepted at 0.5 a
    draft, 0.31). Measured with the mean of ratios (SmolLM2, spec_bench, C=1, suffix, the
    2-core AMX Xeon, 2026-11-30): suffix drafts after a 1-3 / 4-7 / 8+ token match were
    accepted 0.59 / 0.72 / 0.94 of the time at their first draft and about as often at each
    later one, while their trackers said 0.47 / 0.64 / 0.85; so drafts that paid were
    refused.

    A pooled tracker (or one without a pool): accepted and tested drafts each a moving
    average over verifications (``weight``: the tested drafts' average, in which the prior
    counts as one tested draft). A request's tracker with a pool: its accepted and tested
    drafts as decayed sums, to which the pool's estimate adds ``POOL_STRENGTH`` tested drafts
    fading by ``POOL_STRENGTH_DECAY`` a verification (see there)."""

    alpha: float = 0.6  # optimistic prior: the first drafts are worth trying
    decay: float = 0.7
    steps_since_probe: int = 0
    pooled: AcceptanceTracker | None = None
    weight: float = 1.0  # without a pool: moving average of tested drafts per verification
    accepted_sum: float = 0.0  # with a pool: decayed sums of accepted and tested drafts
    tested_sum: float = 0.0
    num_updates: int = 0

    @classmethod
    def from_pool(cls, pooled: AcceptanceTracker) -> AcceptanceTracker:
        return cls(alpha=pooled.alpha, pooled=pooled)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        # A rejection at position a says nothing about positions past a: count the drafts
        # that were actually tested (accepted ones plus the rejected one).
        tested = min(num_accepted + 1, num_drafted)
        self.num_updates += 1
        if self.pooled is None:
            weight = self.decay * self.weight + (1 - self.decay) * tested
            accepted = self.decay * self.alpha * self.weight + (1 - self.decay) * num_accepted
            self.alpha, self.weight = accepted / weight, weight
        else:
            self.pooled.update(num_drafted, num_accepted)
            self.accepted_sum = self.decay * self.accepted_sum + num_accepted
            self.tested_sum = self.decay * self.tested_sum + tested  # >= 1 from here on
            strength = POOL_STRENGTH * POOL_STRENGTH_DECAY ** self.num_updates
            self.alpha = (self.accepted_sum + strength * self.pooled.alpha) \
                / (self.tested_sum + strength)
        assert 0.0 <= self.alpha <= 1.0 + 1e-9, (self.alpha, num_drafted, num_accepted)


def update_by_depth(segments: Sequence[tuple[int, AcceptanceTracker]], depth: int,
                    num_accepted: int) -> None:
    """Account one verification whose drafts at depths ``start..`` (1-based, up to the next
    segment's start) are tracked by each segment's tracker: ``depth`` drafts along the path
    tested, the first ``num_accepted`` accepted. A segment is tested only if every draft
    before it was accepted; each gets its own drafts and accepted count, so that its
    ``alpha`` is the chance a draft at those depths is accepted once the ones before it
    were. ``segments`` start at depth 1 and go deeper."""
    assert segments and segments[0][0] == 1, segments
    for n, (start, tracker) in enumerate(segments):
        if start > depth or num_accepted < start - 1:
            break
        end = segments[n + 1][0] - 1 if n + 1 < len(segments) else depth
        drafted = min(end, depth) - start + 1
        tracker.update(drafted, min(num_accepted - (start - 1), drafted))


@dataclass
class SpeculationPolicy:
    """``cost``: the target's step time by query tokens; ``draft_cost``: one draft-model
    forward by batch size (None: drafting is free, e.g. n-gram only); ``draft_fixed_cost``:
    what drafting costs by batch size whatever the depth (a draft head's catch-up forward
    over the newly verified positions; None: nothing). The engine passes both as observed
    (:class:`spec.draft_cost.ObservedDraftCost`)."""

    cost: StepCost | ObservedStepCost = field(default_factory=StepCost.memory_bound)
    max_k: int = 4
    min_alpha: float = 0.05
    probe_interval: int = 16
    probe_below_alpha: float = 0.3  # probe only requests refused for low acceptance
    # ... and only in a step where a draft accepted this often would pay (a probe in a
    # saturated batch costs every request the first draft row's time)
    probe_alpha: float = 0.5
    draft_cost: Callable[[int], float] | None = None
    # Background tokens count this much in the batch's rate: when drafting stops paying for
    # everyone (a saturated batch), background requests lose their drafts first.
    background_weight: float = 0.25
    draft_fixed_cost: Callable[[int], float] | None = None
    # target rows verified per draft granted to the draft model's proposals where a row is
    # cheap (a draft head drafts a tree of this many nodes per granted draft: each node is a
    # verified row); see model_rows_per_draft
    rows_per_model_draft: int = 1
    # ... and what "cheap" is: the price of one more row, as a fraction of the step it
    # joins, at or below which a head's sibling rows are drafted (model_rows_per_draft)
    tree_max_row_price: float = 0.05

    def allocate(self, alphas: Sequence[float], available: Sequence[int],
                 num_plain_tokens: int, uses_draft: Sequence[bool] | None = None,
                 weights: Sequence[float] | None = None,
                 gains: Sequence[Sequence[float] | None] | None = None,
                 other_tokens: float = 0.0, num_prefill_tokens: int = 0) -> list[int]:
        """Draft counts per request: :meth:`allocate_with_rate`'s."""
        return self.allocate_with_rate(alphas, available, num_plain_tokens, uses_draft,
                                       weights, gains, other_tokens, num_prefill_tokens)[0]

    def allocate_with_rate(self, alphas: Sequence[float], available: Sequence[int],
                           num_plain_tokens: int, uses_draft: Sequence[bool] | None = None,
                           weights: Sequence[float] | None = None,
                           gains: Sequence[Sequence[float] | None] | None = None,
                           other_tokens: float = 0.0, num_prefill_tokens: int = 0,
                           ) -> tuple[list[int], float]:
        """Draft counts per request, and the step's expected rate with them (weighted
        tokens per second: what two alternative proposals are compared by).
        ``available[i]``: drafts request i could verify (proposer output, already capped);
        ``num_plain_tokens``: the step's tokens without drafts;
        ``uses_draft[i]``: request i's drafts come from the draft model, whose cost is one
        batched forward per draft position (``depth`` = the deepest such request);
        ``weights[i]``: what request i's tokens are worth (1 interactive, less background);
        ``gains[i]`` (model-free drafts only; None: a chain, ``alpha^j``): the expected
        accepted tokens each further draft adds, non-increasing — a token tree's nodes in
        best-first order, each the probability that its whole path is accepted;
        ``other_tokens``: what the step's other requests emit (weighted), e.g. decoding
        requests with nothing to draft. They count in the step's rate: leaving them out
        would make a draft look worth more, the fewer requests have one;
        ``num_prefill_tokens``: the prompt tokens among ``num_plain_tokens``, whose cost the
        rate leaves out (:meth:`step_cost`)."""
        cost = self.step_cost(num_plain_tokens, num_prefill_tokens)
        uses_draft = uses_draft or [False] * len(alphas)
        w = weights or [1.0] * len(alphas)
        base = float(sum(w)) + other_tokens
        model_ids = sorted((i for i, d in enumerate(uses_draft)
                            if d and available[i] > 0 and alphas[i] > self.min_alpha),
                           key=lambda i: -alphas[i])
        node_gains = [list(g) if g is not None else
                      [alphas[i] ** j for j in range(1, available[i] + 1)]
                      for i, g in enumerate(gains or [None] * len(alphas))]
        # Each plan's rate is computed once, and the free drafts are added only where some
        # request has one to add (_add_free_drafts would return the plan as it is): the same
        # plans and rates as before (tests/spec/policy_allocation_reference.py), at a
        # fraction of the cost where a draft head's request is priced at every depth (one
        # request's allocation 141 -> 68 us hot; the head's served plan 0.216 -> 0.156 ms a
        # ~9 ms step on the 2-core AVX2-only Zen 3 EPYC, 2026-12-01, where the head was
        # granted drafts in a few % of steps).
        free = any(not uses_draft[i] and min(available[i], len(g)) > 0
                   and g[0] > self.min_alpha for i, g in enumerate(node_gains))
        plain = _Plan([0] * len(alphas), base, max(num_plain_tokens, 1), 0.0)
        plain_rate = plain.rate(cost)
        best = (self._add_free_drafts(plain, node_gains, available, uses_draft, w, cost)
                if free else plain)
        best_rate = best.rate(cost) if free else plain_rate
        rows = self.model_rows_per_draft(num_plain_tokens, num_prefill_tokens) \
            if model_ids else 1
        for depth in range(1, self.max_k + 1 if model_ids else 1):
            plan, rate = plain, plain_rate
            for taken, i in enumerate(model_ids, start=1):
                trial = plan.with_draft_model(i, min(depth, available[i], self.max_k),
                                              alphas[i], depth, taken, self.draft_cost, w[i],
                                              self.draft_fixed_cost, rows)
                trial_rate = trial.rate(cost)
                if trial_rate <= rate:
                    break
                plan, rate = trial, trial_rate
            if free:
                plan = self._add_free_drafts(plan, node_gains, available, uses_draft, w, cost)
                rate = plan.rate(cost)
            if rate > best_rate:
                best, best_rate = plan, rate
        return best.ks, best_rate

    def step_cost(self, num_plain_tokens: int, num_prefill_tokens: int = 0
                  ) -> Callable[[int], float]:
        """The price of a step of ``n`` query tokens that drafts are weighed against, in a
        step of ``num_plain_tokens`` tokens without drafts of which ``num_prefill_tokens``
        are prompt tokens: :attr:`cost` less what the prompt tokens add to it. A draft row
        still costs what it adds at the step's real size, but the rate it must raise is the
        decoding rows' own: a prompt chunk's time is work that pays later (its tokens come
        in later steps), not this step's price per token, and counting it made every node
        look worth its row (a rag_qa prompt of ~170 tokens beside 8 decoding requests on
        the 2-core AVX2 Zen 3 EPYC, priced by its start-up curve: a node paid from a ~4 %
        chance of acceptance, against 60-75 % without the prompt; nodes granted in steps with
        64+ prompt tokens were accepted 0.20 of a node in rag_qa, 0.21 in summarisation,
        against 0.56 and 0.75 in decode-only steps)."""
        prefill = min(max(num_prefill_tokens, 0), max(num_plain_tokens, 1) - 1)
        if prefill == 0:
            return self.cost
        cost = self.cost
        n = max(num_plain_tokens, 1)
        sunk = cost(n) - cost(n - prefill)  # >= 0: the cost curve does not fall
        return lambda tokens: cost(tokens) - sunk

    def model_rows_per_draft(self, num_plain_tokens: int, num_prefill_tokens: int = 0
                             ) -> int:
        """Target rows a draft granted to the draft model's proposals takes in a step of
        ``num_plain_tokens`` tokens without drafts (``num_prefill_tokens`` of them prompt
        tokens): ``rows_per_model_draft`` (a draft head's tree, the likeliest token and its
        siblings at each depth) where one more row after a one-draft chain costs at most
        ``tree_max_row_price`` of the step (:meth:`step_cost`), else 1 (a chain).

        A sibling is accepted only where the likeliest token was not, a few tenths of the
        time (it adds ~0.1 token a verification at the head's ~0.6 acceptance), so its row
        pays only beside a step it adds little to: on a GPU, where a few more rows cost ~1 %
        of the step, not on the 2-core CPUs, where the third row of a 1-request step adds
        18-22 % of it. Measured (SmolLM2, C=1, the shipped head alone against off, 2-core
        AVX2-only Zen 3 EPYC, 2026-12-01, one engine, arms alternating by category, 3 rounds):
        two nodes a draft 0.996x, one 1.043x over five categories, and 0.996x -> 1.085x over
        seven in a second run (open writing 1.034 -> 1.258, chat 1.053 -> 1.215, code editing
        0.995 -> 1.179, translation 0.935 -> 0.909); a step verifying one draft and its
        sibling (3 rows) took +1.1 ms over an 8.1 ms 1-row step."""
        if self.rows_per_model_draft <= 1:
            return 1
        cost = self.step_cost(num_plain_tokens, num_prefill_tokens)
        n = max(num_plain_tokens, 1) + 1  # the step with one draft
        if cost(n + 1) <= cost(n) * (1.0 + self.tree_max_row_price):
            return self.rows_per_model_draft
        return 1

    def probe_pays(self, num_tokens: int, tokens: float, num_prefill_tokens: int = 0) -> bool:
        """Whether one more draft, accepted with probability ``probe_alpha``, raises the rate
        of a step of ``num_tokens`` query tokens (``num_prefill_tokens`` of them prompt
        tokens) that emits ``tokens`` (weighted)."""
        return self.probe_alpha > self.first_draft_threshold(num_tokens, tokens,
                                                             num_prefill_tokens)

    def free_draft_floor(self, num_tokens: int, tokens: float,
                         num_prefill_tokens: int = 0) -> float:
        """What a free proposal's best node must score to be worth scoring in a step of
        ``num_tokens`` query tokens that emits ``tokens``: :meth:`first_draft_threshold`, or
        0 where a probe could pay (a collapsed request is then re-tested whatever its
        score)."""
        bar = self.first_draft_threshold(num_tokens, tokens, num_prefill_tokens)
        return 0.0 if self.probe_alpha > bar else bar

    def first_draft_threshold(self, num_tokens: int, tokens: float,
                              num_prefill_tokens: int = 0) -> float:
        """The expected accepted tokens (weighted) above which one free draft raises the rate
        of a step of ``num_tokens`` query tokens that emits ``tokens``: ``(tokens + g) /
        cost(n + 1) > tokens / cost(n)`` iff ``g > tokens * (cost(n + 1) / cost(n) - 1)``,
        with the step's cost less its ``num_prefill_tokens`` prompt tokens'
        (:meth:`step_cost`)."""
        n = max(num_tokens, 1)
        cost = self.step_cost(n, num_prefill_tokens)
        return tokens * (cost(n + 1) / cost(n) - 1.0)

    def _add_free_drafts(self, plan: _Plan, gains: Sequence[Sequence[float]],
                         available: Sequence[int], uses_draft: Sequence[bool],
                         weights: Sequence[float], cost: Callable[[int], float]) -> _Plan:
        """Grant model-free drafts one at a time by marginal gain while the rate improves
        (request i's next draft adds ``gains[i][ks[i]]``)."""
        limit = [min(available[i], len(gains[i])) for i in range(len(gains))]
        heap = [(-g[0] * weights[i], i) for i, g in enumerate(gains)
                if not uses_draft[i] and limit[i] > 0 and g[0] > self.min_alpha]
        heapq.heapify(heap)
        # (plain floats and one _Plan at the end: this runs every step; a trial's rate is
        # _Plan.rate's expression for the plan with one more draft)
        ks, tokens, n, fixed = list(plan.ks), plan.tokens, plan.n, plan.draft_seconds
        rate = tokens / (cost(n) + fixed)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            trial = (tokens + -neg_gain) / (cost(n + 1) + fixed)
            if trial <= rate:
                break
            tokens, n, rate = tokens + -neg_gain, n + 1, trial
            ks[i] += 1
            if ks[i] < limit[i]:
                heapq.heappush(heap, (-gains[i][ks[i]] * weights[i], i))
        return _Plan(ks, tokens, n, fixed)


@dataclass(frozen=True)
class _Plan:
    """A candidate allocation: drafts per request, expected tokens, target query tokens and
    the draft model's time."""

    ks: list[int]
    tokens: float
    n: int
    draft_seconds: float

    def rate(self, cost: Callable[[int], float]) -> float:
        return self.tokens / (cost(self.n) + self.draft_seconds)

    def with_draft_model(self, i: int, k: int, alpha: float, depth: int, batch: int,
                         draft_cost: Callable[[int], float] | None, weight: float = 1.0,
                         fixed_cost: Callable[[int], float] | None = None,
                         rows_per_draft: int = 1,
                         ) -> _Plan:
        """Request ``i`` drafts ``k`` tokens with the model (``rows_per_draft * k`` rows
        verified); ``batch`` requests now do."""
        ks = list(self.ks)
        ks[i] = k
        gain = weight * sum(alpha ** j for j in range(1, k + 1))
        seconds = depth * draft_cost(batch) if draft_cost is not None else 0.0
        if fixed_cost is not None:
            seconds += fixed_cost(batch)
        return _Plan(ks, self.tokens + gain, self.n + rows_per_draft * k, seconds)
