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
:func:`supports_speculation`); such a request with drafts is refused, and without drafts its
single row is penalised exactly as in :func:`engine.sampler.sample`.

Vectorised: per-row work is batched tensor ops; Python loops run over requests only (seeded
generators, building the output lists), never over rows' vocabularies.

:func:`kernels.triton_rejection.rejection_sample` is a Triton version with the same results
and the same random draws; it shares this module's validation, layout, logits processing,
uniform draws and output assembly (the ``_``-prefixed helpers below).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from quickdraft.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_temperature_and_filters,
    sample_from_probs,
)
from quickdraft.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one recovered-or-bonus token
    num_accepted: list[int]  # per request: number of accepted drafts
    # Per request, aligned with token_ids: log_softmax of the RAW target logits (before
    # penalties / temperature) at each emitted token; None when no request asked for logprobs.
    logprobs: list[list[float]] | None = None


def supports_speculation(params: SamplingParams) -> bool:
    """Whether drafts may be verified for a request: not when it uses penalties."""
    return not params.uses_penalties


@dataclass(frozen=True)
class _Layout:
    """Where each request's rows and drafts live. B requests, R = D + B rows, D drafts."""

    num_drafts: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] first row of each request
    draft_offsets: torch.Tensor  # [B] index of each request's first draft in [D]
    draft_ids: torch.Tensor  # [D] draft tokens, flattened in request order
    draft_req: torch.Tensor  # [D] request of each draft
    draft_pos: torch.Tensor  # [D] position of each draft within its request
    draft_rows: torch.Tensor  # [D] target row of each draft
    row_req: torch.Tensor  # [R] request of each row

    @classmethod
    def build(cls, draft_token_ids: list[list[int]], device: torch.device) -> _Layout:
        num_requests = len(draft_token_ids)
        num_drafts = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.long)  # [B]
        flat = list(itertools.chain.from_iterable(draft_token_ids))
        draft_ids = torch.tensor(flat, dtype=torch.long)  # [D]
        requests = torch.arange(num_requests)  # [B]
        starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)  # [B]
        draft_offsets = torch.cumsum(num_drafts, 0) - num_drafts  # [B]
        draft_req = torch.repeat_interleave(requests, num_drafts)  # [D]
        draft_pos = torch.arange(len(flat)) - draft_offsets[draft_req]  # [D]
        row_req = torch.repeat_interleave(requests, num_drafts + 1)  # [R]
        return cls(*(t.to(device) for t in (
            num_drafts, starts, draft_offsets, draft_ids, draft_req, draft_pos,
            starts[draft_req] + draft_pos, row_req)))


def _validate(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None, batch: SamplingBatch,
) -> None:
    num_drafts = sum(len(d) for d in draft_token_ids)
    num_rows, vocab = target_logits.shape
    if len(batch.params) != len(draft_token_ids):
        raise ValueError(f"{len(batch.params)} requests but {len(draft_token_ids)} draft lists")
    if num_rows != num_drafts + len(draft_token_ids):
        raise ValueError(f"{num_rows} target rows, expected drafts + 1 per request = "
                         f"{num_drafts + len(draft_token_ids)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_probs is {tuple(draft_probs.shape)}, "
                         f"expected {(num_drafts, vocab)}")
    if any(not 0 <= t < vocab for d in draft_token_ids for t in d):
        raise ValueError(f"draft token id outside the vocabulary [0, {vocab})")
    for i, (d, p) in enumerate(zip(draft_token_ids, batch.params, strict=True)):
        if d and not supports_speculation(p):
            raise ValueError(f"request {i} uses penalties: it must not be given drafts")


def _processed_logits(
    raw: torch.Tensor, layout: _Layout, batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """Penalties (plain-decode rows only), then temperature + filters on sampled rows.

    ``raw`` is ``[R, V]``; greedy rows keep their (penalised) logits, for the argmax.
    """
    params = batch.params
    logits = raw
    if any(p.uses_penalties for p in params):  # _validate: only requests without drafts
        bonus_rows = layout.starts + layout.num_drafts  # [B]
        logits = raw.clone()
        logits[bonus_rows] = apply_penalties(raw[bonus_rows], batch)
    if bool(greedy.all()):
        return logits

    def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=raw.device)[layout.row_req]  # [R]

    # Greedy rows get neutral parameters, which leave them untouched.
    return apply_temperature_and_filters(
        logits,
        temperature=column([p.temperature if not p.greedy else 1.0 for p in params],
                           torch.float32),
        top_k=column([p.top_k if not p.greedy else 0 for p in params], torch.long),
        top_p=column([p.top_p if not p.greedy else 1.0 for p in params], torch.float32),
        min_p=column([p.min_p if not p.greedy else 0.0 for p in params], torch.float32),
    )  # [R, V]


def _draft_uniforms(
    num_drafts: list[int], batch: SamplingBatch, device: torch.device | str,
) -> torch.Tensor:
    """``[D]`` uniforms in [0, 1) for the drafts of sampled requests (0 for greedy ones).

    One draw from ``batch.default_generator`` for all unseeded sampled requests' drafts (in
    draft order), then each seeded sampled request's drafts from its own generator. Drawing
    nothing when no sampled request has drafts.
    """
    u = torch.zeros(sum(num_drafts), device=device)  # [D]
    shared_req = torch.tensor([not p.greedy and g is None
                               for p, g in zip(batch.params, batch.generators, strict=True)],
                              dtype=torch.bool)  # [B]
    shared = torch.repeat_interleave(shared_req, torch.tensor(num_drafts, dtype=torch.long))
    if bool(shared.any()):  # [D]
        shared = shared.to(device)
        u[shared] = torch.empty(int(shared.sum()), device=device).uniform_(
            generator=batch.default_generator)
    offset = 0
    for n, p, g in zip(num_drafts, batch.params, batch.generators, strict=True):
        if g is not None and n and not p.greedy:
            u[offset:offset + n].uniform_(generator=g)
        offset += n
    return u


def _accept_drafts(
    logits: torch.Tensor, layout: _Layout, draft_probs: torch.Tensor | None,
    batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """Per-draft accept decisions ``[D]`` bool (independent of earlier drafts' fate)."""
    ids = layout.draft_ids  # [D]
    rows = logits[layout.draft_rows]  # [D, V]
    greedy_draft = greedy[layout.draft_req]  # [D]
    accept = torch.zeros_like(greedy_draft)  # [D]
    if bool(greedy_draft.any()):
        accept = greedy_draft & (rows.argmax(dim=-1) == ids)
    if not bool(greedy_draft.all()):
        index = torch.arange(ids.shape[0], device=ids.device)  # [D]
        p = torch.exp(rows[index, ids] - torch.logsumexp(rows, dim=-1))  # [D] p_j(x_j)
        q = (draft_probs[index, ids].to(p) if draft_probs is not None
             else torch.ones_like(p))  # [D] q_j(x_j)
        u = _draft_uniforms(layout.num_drafts.tolist(), batch, ids.device)  # [D]
        accept = torch.where(greedy_draft, accept, u * q < p)
    return accept


def _count_accepted(accept: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Leading accepted drafts per request ``[B]``: cumprod over a padded [B, max_k] mask."""
    num_requests = layout.num_drafts.shape[0]
    max_k = int(layout.num_drafts.max()) if num_requests else 0
    padded = torch.zeros(num_requests, max_k, dtype=torch.long, device=accept.device)
    padded[layout.draft_req, layout.draft_pos] = accept.long()  # [B, max_k], padding rejects
    return torch.cumprod(padded, dim=1).sum(dim=1)  # [B]


def _final_tokens(
    logits: torch.Tensor, layout: _Layout, num_accepted: torch.Tensor,
    draft_probs: torch.Tensor | None, batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """The recovered-or-bonus token of every request ``[B]``, drawn at row start + accepted."""
    final = logits[layout.starts + num_accepted]  # [B, V]
    tokens = final.argmax(dim=-1)  # [B], kept for greedy requests
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


def _emitted_logprobs(
    raw: torch.Tensor, layout: _Layout, num_accepted: torch.Tensor, tokens: torch.Tensor,
) -> list[list[float]]:
    """Raw log_softmax at every emitted token, split per request."""
    row_token = torch.zeros(raw.shape[0], dtype=torch.long, device=raw.device)  # [R]
    row_token[layout.draft_rows] = layout.draft_ids
    row_token[layout.starts + num_accepted] = tokens
    chosen = raw.gather(1, row_token.unsqueeze(1)).squeeze(1)  # [R]
    values = (chosen - torch.logsumexp(raw, dim=-1)).tolist()  # [R]
    starts = layout.starts.tolist()
    return [values[s:s + n + 1] for s, n in zip(starts, num_accepted.tolist(), strict=True)]


def _prepare(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None, batch: SamplingBatch,
) -> tuple[torch.Tensor, _Layout, torch.Tensor, torch.Tensor]:
    """Validate, then ``(raw [R, V] float32, layout, greedy [B] bool, processed [R, V])``.

    The torch half of every verifier (this module's and :mod:`kernels.triton_rejection`'s).
    """
    _validate(target_logits, draft_token_ids, draft_probs, batch)
    raw = target_logits.float()  # [R, V], never modified
    layout = _Layout.build(draft_token_ids, raw.device)
    greedy = torch.tensor([p.greedy for p in batch.params], dtype=torch.bool,
                          device=raw.device)  # [B]
    return raw, layout, greedy, _processed_logits(raw, layout, batch, greedy)


def _output(
    draft_token_ids: list[list[int]], raw: torch.Tensor, layout: _Layout, batch: SamplingBatch,
    num_accepted: torch.Tensor, tokens: torch.Tensor,
) -> VerifyOutput:
    """Assemble the per-request lists (and logprobs, when asked) from ``[B]`` int64 tensors."""
    counts = num_accepted.tolist()
    token_ids = [[*d[:n], t] for d, n, t in zip(draft_token_ids, counts, tokens.tolist(),
                                                strict=True)]
    logprobs = None
    if any(p.logprobs for p in batch.params):
        logprobs = _emitted_logprobs(raw, layout, num_accepted, tokens)
    return VerifyOutput(token_ids=token_ids, num_accepted=counts, logprobs=logprobs)


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
    raw, layout, greedy, logits = _prepare(target_logits, draft_token_ids, draft_probs, batch)
    accept = _accept_drafts(logits, layout, draft_probs, batch, greedy)  # [D]
    num_accepted = _count_accepted(accept, layout)  # [B]
    tokens = _final_tokens(logits, layout, num_accepted, draft_probs, batch, greedy)  # [B]
    return _output(draft_token_ids, raw, layout, batch, num_accepted, tokens)
