"""Speculative verification: accept or reject draft tokens for a whole batch at once.

Each request ``i`` brings ``k_i >= 0`` draft tokens ``x_0 .. x_{k-1}`` and the target model
scores ``k_i + 1`` rows for it: row ``j < k`` is the target distribution at the position of
draft ``x_j`` (conditioned on the context and ``x_0 .. x_{j-1}``), row ``k`` the position
after the last draft. Rows are grouped per request in batch order. Per request the output is
the accepted drafts followed by exactly one more token:

* **accepted** drafts: the longest prefix ``x_0 .. x_{a-1}`` that passes the test below;
* **recovered** token: when draft ``x_a`` (``a < k``) is rejected, a replacement drawn at
  row ``a``; nothing after a rejection is used;
* **bonus** token: when all ``k`` drafts are accepted, a token drawn at row ``k`` (a plain
  decode step is the case ``k = 0``: the output is just the bonus token).

Greedy requests (temperature 0) accept ``x_j`` while it equals ``argmax`` of row ``j``; the
recovered / bonus token is the argmax of row ``a``. The output is exactly what plain greedy
decoding would produce (same ``argmax`` tie-breaking as :mod:`engine.sampler`).

Sampled requests use the speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023).
``p_j = softmax(apply_temperature_and_filters(row j))`` is the target distribution with the
request's temperature / top-k / top-p / min-p, ``q_j`` the draft distribution that ``x_j`` was
drawn from (given processed the same way, or one-hot at ``x_j`` for n-gram drafts, which are
deterministic). Draft ``x_j`` is accepted with probability ``min(1, p_j(x) / q_j(x))``
(``u * q < p`` with ``u ~ U[0, 1)``); on rejection the recovered token is drawn from
``normalize(max(0, p_a - q_a))``, or from ``p_a`` when that residual is all zeros (possible
only through rounding, since p == q is never rejected). The bonus token is drawn from ``p_k``.
Provided each ``x_j`` was drawn from ``q_j``, every emitted token is then distributed exactly
as ``p`` at its position, whatever ``q``. A draft the target filtered out (``p(x) = 0``) is
always rejected; ``q`` need not share ``p``'s support.

Randomness: a seeded request draws its ``k`` acceptance uniforms and then its categorical draw
(:func:`engine.sampler.sample_from_probs`) from its own generator, so its output does not
depend on what it is batched with; unseeded requests share ``batch.default_generator``.

Penalties depend on the tokens generated so far, hence on the draft position; they are not
applied per position here. Callers must not speculate for a request that uses them (see
:func:`spec.verification.supports_speculation`); such a request with drafts is refused, and
without drafts its single row is penalised exactly as in :func:`engine.sampler.sample`.

Vectorised: per-row work is batched tensor ops; Python loops run over requests only (seeded
generators, building the output lists), never over rows' vocabularies.

:func:`kernels.triton_rejection.rejection_sample` is a Triton version with the same results
and the same random draws. Both share the public steps of :mod:`spec.verification`
(validation, :class:`~spec.verification.VerifyLayout`, logits processing, the acceptance
uniforms and output assembly); this module keeps the torch acceptance maths: the per-draft
tests, the count of leading accepted drafts and the recovered / bonus draws.
"""

from __future__ import annotations

import torch

from quickdraft.engine.sampler import SamplingBatch, argmax_rows, sample_from_probs
from quickdraft.spec.verification import (
    VerifyLayout,
    VerifyOutput,
    assemble_output,
    draft_uniforms,
    greedy_on_raw_logits,
    prepare_verification,
    supports_speculation,
    validate_verification,
)

# VerifyOutput and supports_speculation live in spec.verification; re-exported for importers.
__all__ = ["VerifyOutput", "rejection_sample", "supports_speculation"]


def _accept_drafts(
    logits: torch.Tensor, layout: VerifyLayout, draft_probs: torch.Tensor | None,
    batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """Per-draft accept decisions ``[D]`` bool (independent of earlier drafts' fate)."""
    ids = layout.draft_ids  # [D]
    rows = logits[layout.draft_rows]  # [D, V]
    greedy_draft = greedy[layout.draft_req]  # [D]
    accept = torch.zeros_like(greedy_draft)  # [D]
    if bool(greedy_draft.any()):
        accept = greedy_draft & (argmax_rows(rows) == ids)
    if not bool(greedy_draft.all()):
        index = torch.arange(ids.shape[0], device=ids.device)  # [D]
        p = torch.exp(rows[index, ids] - torch.logsumexp(rows, dim=-1))  # [D] p_j(x_j)
        q = (draft_probs[index, ids].to(p) if draft_probs is not None
             else torch.ones_like(p))  # [D] q_j(x_j)
        u = draft_uniforms(layout.num_drafts.tolist(), batch, ids.device)  # [D]
        accept = torch.where(greedy_draft, accept, u * q < p)
    return accept


def _count_accepted(accept: torch.Tensor, layout: VerifyLayout) -> torch.Tensor:
    """Leading accepted drafts per request ``[B]``: cumprod over a padded [B, max_k] mask."""
    num_requests = layout.num_drafts.shape[0]
    max_k = int(layout.num_drafts.max()) if num_requests else 0
    padded = torch.zeros(num_requests, max_k, dtype=torch.long, device=accept.device)
    padded[layout.draft_req, layout.draft_pos] = accept.long()  # [B, max_k], padding rejects
    return torch.cumprod(padded, dim=1).sum(dim=1)  # [B]


def _final_tokens(
    logits: torch.Tensor, layout: VerifyLayout, num_accepted: torch.Tensor,
    draft_probs: torch.Tensor | None, batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """The recovered-or-bonus token of every request ``[B]``, drawn at row start + accepted."""
    final = logits[layout.starts + num_accepted]  # [B, V]
    tokens = argmax_rows(final)  # [B], kept for greedy requests
    sampled = (~greedy).nonzero().squeeze(1)  # [S]
    if sampled.numel() == 0:
        return tokens
    probs = torch.softmax(final[sampled], dim=-1)  # [S, V]
    rejected = num_accepted[sampled] < layout.num_drafts[sampled]  # [S]
    if bool(rejected.any()):
        req = sampled[rejected]  # [X]
        index = layout.draft_offsets[req] + num_accepted[req]  # [X] rejected draft
        if draft_probs is not None:
            q = draft_probs[index].to(probs)  # [X, V]
        else:
            q = torch.nn.functional.one_hot(layout.draft_ids[index], probs.shape[1]).to(probs)
        residual = torch.clamp(probs[rejected] - q, min=0.0)  # [X, V]
        empty = residual.sum(dim=-1, keepdim=True) <= 0  # [X, 1]
        probs[rejected] = torch.where(empty, probs[rejected], residual)  # race normalises
    generators = [batch.generators[i] for i in sampled.tolist()]
    tokens[sampled] = sample_from_probs(probs, generators, batch.default_generator)
    return tokens


def _greedy(target_logits: torch.Tensor, draft_token_ids: list[list[int]]) -> VerifyOutput:
    """The all-greedy batch (no penalties, no logprobs): one argmax over every row, then each
    request's longest prefix of drafts equal to the argmax before them, plus the argmax after
    it. The same tokens as the general path (whose processed logits are the raw ones here;
    argmax breaks ties at the lowest id either way) at a fraction of its ~30 small torch ops,
    which cost more than the argmax on a CPU."""
    argmax = argmax_rows(target_logits).tolist()  # [R]
    token_ids: list[list[int]] = []
    counts: list[int] = []
    row = 0
    for drafts in draft_token_ids:
        n = 0
        while n < len(drafts) and argmax[row + n] == drafts[n]:
            n += 1
        token_ids.append([*drafts[:n], argmax[row + n]])
        counts.append(n)
        row += len(drafts) + 1
    return VerifyOutput(token_ids=token_ids, num_accepted=counts, logprobs=None)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> VerifyOutput:
    """Verify every request's drafts and emit accepted drafts + one more token each.

    ``target_logits`` ``[R, V]`` (any float dtype, computed in float32): ``len(drafts) + 1``
    rows per request, grouped in batch order. ``draft_probs`` ``[D, V]``: the draft
    distribution at each draft (flattened in request order), or None for one-hot (n-gram)
    drafts. ``batch`` has one row per request. See the module docstring for the rules.
    """
    if greedy_on_raw_logits(batch.params) and not any(p.logprobs for p in batch.params):
        validate_verification(target_logits, draft_token_ids, draft_probs, batch)
        return _greedy(target_logits, draft_token_ids)
    prep = prepare_verification(target_logits, draft_token_ids, draft_probs, batch)
    layout, logits, greedy = prep.layout, prep.logits, prep.greedy
    accept = _accept_drafts(logits, layout, draft_probs, batch, greedy)  # [D]
    num_accepted = _count_accepted(accept, layout)  # [B]
    tokens = _final_tokens(logits, layout, num_accepted, draft_probs, batch, greedy)  # [B]
    return assemble_output(draft_token_ids, prep.raw, layout, batch, num_accepted, tokens)
