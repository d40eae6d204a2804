"""The draft allocation of :meth:`spec.policy.SpeculationPolicy.allocate_with_rate` as it was
written before its plans' rates were computed once each and its free drafts skipped where no
request has one (session 71): every depth a fresh plan, every comparison recomputing both
rates, the free drafts added at every depth. The oracle the faster loop must match exactly
(the same drafts and the same rate, bit for bit). (Since session 72 a model draft's rows are
the policy's ``model_rows_per_draft`` for the step, here as there.)"""

from __future__ import annotations

from collections.abc import Sequence

from quickdraft.spec.policy import SpeculationPolicy, _Plan


def allocate_with_rate_reference(policy: SpeculationPolicy, alphas: Sequence[float],
                                 available: Sequence[int], num_plain_tokens: int,
                                 uses_draft: Sequence[bool] | None = None,
                                 weights: Sequence[float] | None = None,
                                 gains: Sequence[Sequence[float] | None] | None = None,
                                 other_tokens: float = 0.0, num_prefill_tokens: int = 0,
                                 ) -> tuple[list[int], float]:
    cost = policy.step_cost(num_plain_tokens, num_prefill_tokens)
    uses_draft = uses_draft or [False] * len(alphas)
    w = weights or [1.0] * len(alphas)
    base = float(sum(w)) + other_tokens
    model_ids = sorted((i for i, d in enumerate(uses_draft)
                        if d and available[i] > 0 and alphas[i] > policy.min_alpha),
                       key=lambda i: -alphas[i])
    node_gains = [list(g) if g is not None else
                  [alphas[i] ** j for j in range(1, available[i] + 1)]
                  for i, g in enumerate(gains or [None] * len(alphas))]
    best = _Plan([0] * len(alphas), base, max(num_plain_tokens, 1), 0.0)
    best = policy._add_free_drafts(best, node_gains, available, uses_draft, w, cost)
    for depth in range(1, policy.max_k + 1 if model_ids else 1):
        plan = _Plan([0] * len(alphas), base, max(num_plain_tokens, 1), 0.0)
        for taken, i in enumerate(model_ids, start=1):
            trial = plan.with_draft_model(i, min(depth, available[i], policy.max_k),
                                          alphas[i], depth, taken, policy.draft_cost, w[i],
                                          policy.draft_fixed_cost,
                                          policy.model_rows_per_draft(num_plain_tokens,
                                                                      num_prefill_tokens))
            if trial.rate(cost) <= plan.rate(cost):
                break
            plan = trial
        plan = policy._add_free_drafts(plan, node_gains, available, uses_draft, w, cost)
        if plan.rate(cost) > best.rate(cost):
            best = plan
    return best.ks, best.rate(cost)
