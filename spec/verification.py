"""Public types and shared steps of speculative verification, used by every verifier.

A verifier takes, for a batch of ``B`` requests, the target model's logits ``[R, V]``
(``k_i + 1`` rows per request ``i`` with ``k_i`` drafts, grouped in batch order, so
``R = D + B`` with ``D = sum(k_i)``), the draft tokens and optionally the draft distributions
``[D, V]``, and emits per request its accepted drafts plus one recovered-or-bonus token
(the rules are in :mod:`spec.rejection_sampler`'s docstring).

Two verifiers exist: the torch reference :func:`spec.rejection_sampler.rejection_sample` and
the Triton one :func:`kernels.triton_rejection.rejection_sample`. They make the same random
draws and the same decisions because they share the steps here:

* :func:`prepare_verification`: validation (:func:`validate_verification`), the float32 raw
  logits, the :class:`VerifyLayout` of the batch, the greedy mask and the processed logits
  (:func:`process_logits`: penalties on plain-decode rows, then temperature / top-k / top-p /
  min-p on sampled rows);
* :func:`draft_uniforms`: the per-draft acceptance uniforms, drawn from the requests'
  generators in a fixed order;
* :func:`assemble_output`: the per-request :class:`VerifyOutput` (with logprobs when asked).

Pure functions over tensors, apart from the generators that :func:`draft_uniforms` advances.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    apply_temperature_and_filters,
)
from quickdraft.engine.sampling_params import SamplingParams

__all__ = [
    "PreparedVerification",
    "VerifyLayout",
    "VerifyOutput",
    "assemble_output",
    "draft_uniforms",
    "emitted_logprobs",
    "greedy_on_raw_logits",
    "prepare_verification",
    "process_logits",
    "supports_speculation",
    "validate_verification",
]


@dataclass(frozen=True)
class VerifyOutput:
    """What a verifier emits for a batch: per request, the tokens to append."""

    token_ids: list[list[int]]  # per request: accepted drafts, then one recovered-or-bonus token
    num_accepted: list[int]  # per request: number of accepted drafts
    # Per request, aligned with token_ids: log_softmax of the RAW target logits (before
    # penalties / temperature) at each emitted token; None when no request asked for logprobs.
    logprobs: list[list[float]] | None = None


def supports_speculation(params: SamplingParams) -> bool:
    """Whether drafts may be verified for a request: not when it uses penalties."""
    return not params.uses_penalties


def greedy_on_raw_logits(params: Sequence[SamplingParams]) -> bool:
    """Every request greedy without penalties: its processed logits are the raw ones and
    verification draws nothing, so a verifier needs no torch layout, only argmaxes."""
    return all(p.greedy and not p.uses_penalties for p in params)


@dataclass(frozen=True)
class VerifyLayout:
    """Where each request's target rows and drafts live in a batch.

    ``B`` requests, ``D`` drafts (flattened in request order), ``R = D + B`` target rows
    (request ``i``'s ``k_i`` draft rows, then its bonus row). All int64, on the logits' device.
    """

    num_drafts: torch.Tensor  # [B] k_i
    starts: torch.Tensor  # [B] first row of each request
    draft_offsets: torch.Tensor  # [B] index of each request's first draft in [D]
    draft_ids: torch.Tensor  # [D] draft tokens, flattened in request order
    draft_req: torch.Tensor  # [D] request of each draft
    draft_pos: torch.Tensor  # [D] position of each draft within its request
    draft_rows: torch.Tensor  # [D] target row of each draft
    row_req: torch.Tensor  # [R] request of each row

    @classmethod
    def build(cls, draft_token_ids: list[list[int]], device: torch.device) -> VerifyLayout:
        """The layout of a batch whose request ``i`` has drafts ``draft_token_ids[i]``."""
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


@dataclass(frozen=True)
class PreparedVerification:
    """The torch half of verification that every verifier starts from.

    Built by :func:`prepare_verification`; ``B`` requests, ``R`` target rows, ``V`` vocabulary.
    """

    raw: torch.Tensor  # [R, V] float32 target logits, never modified (for logprobs)
    layout: VerifyLayout
    greedy: torch.Tensor  # [B] bool, per request
    logits: torch.Tensor  # [R, V] float32 processed logits (penalties, temperature, filters)


def validate_verification(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None, batch: SamplingBatch,
) -> None:
    """Raise ValueError unless the inputs describe one consistent batch.

    ``target_logits`` ``[R, V]`` must have ``k_i + 1`` rows per request, ``draft_probs``
    (when given) ``[D, V]``, every draft must lie in ``[0, V)``, and no request that uses
    penalties may have drafts (:func:`supports_speculation`).
    """
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


def process_logits(
    raw: torch.Tensor, layout: VerifyLayout, batch: SamplingBatch, greedy: torch.Tensor,
) -> torch.Tensor:
    """The processed target logits ``[R, V]``: penalties, then temperature + filters.

    Penalties apply to plain-decode rows only (validation refuses drafts for requests that
    use them), exactly as :func:`engine.sampler.sample` would. Sampled rows then get their
    request's temperature / top-k / top-p / min-p; greedy rows keep their (penalised) logits,
    for the argmax. ``raw`` ``[R, V]`` is not modified (it is returned when nothing applies).
    """
    params = batch.params
    logits = raw
    if any(p.uses_penalties for p in params):  # validated: only requests without drafts
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


def prepare_verification(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None, batch: SamplingBatch,
) -> PreparedVerification:
    """Validate the inputs, then build the raw float32 logits, layout, greedy mask and
    processed logits that every verifier starts from.

    ``target_logits`` ``[R, V]`` may be any float dtype; everything is computed in float32 on
    its device.
    """
    validate_verification(target_logits, draft_token_ids, draft_probs, batch)
    raw = target_logits.float()  # [R, V], never modified
    layout = VerifyLayout.build(draft_token_ids, raw.device)
    greedy = torch.tensor([p.greedy for p in batch.params], dtype=torch.bool,
                          device=raw.device)  # [B]
    return PreparedVerification(raw=raw, layout=layout, greedy=greedy,
                                logits=process_logits(raw, layout, batch, greedy))


def draft_uniforms(
    num_drafts: list[int], batch: SamplingBatch, device: torch.device | str,
) -> torch.Tensor:
    """``[D]`` acceptance uniforms in [0, 1) for the drafts of sampled requests (0 for greedy).

    One draw from ``batch.default_generator`` for all unseeded sampled requests' drafts (in
    draft order), then each seeded sampled request's drafts from its own generator. Draws
    nothing when no sampled request has drafts. ``num_drafts`` is ``k_i`` per request.
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


def emitted_logprobs(
    raw: torch.Tensor, layout: VerifyLayout, num_accepted: torch.Tensor, tokens: torch.Tensor,
) -> list[list[float]]:
    """Raw log_softmax at every emitted token, split per request.

    ``raw`` ``[R, V]`` float32; ``num_accepted`` and ``tokens`` (the recovered-or-bonus
    token) ``[B]`` int64. Request ``i`` gets ``num_accepted[i] + 1`` values.
    """
    row_token = torch.zeros(raw.shape[0], dtype=torch.long, device=raw.device)  # [R]
    row_token[layout.draft_rows] = layout.draft_ids
    row_token[layout.starts + num_accepted] = tokens
    chosen = raw.gather(1, row_token.unsqueeze(1)).squeeze(1)  # [R]
    values = (chosen - torch.logsumexp(raw, dim=-1)).tolist()  # [R]
    starts = layout.starts.tolist()
    return [values[s:s + n + 1] for s, n in zip(starts, num_accepted.tolist(), strict=True)]


def assemble_output(
    draft_token_ids: list[list[int]], raw: torch.Tensor, layout: VerifyLayout,
    batch: SamplingBatch, num_accepted: torch.Tensor, tokens: torch.Tensor,
) -> VerifyOutput:
    """The :class:`VerifyOutput` of a verified batch.

    ``num_accepted`` and ``tokens`` (each request's recovered-or-bonus token) are ``[B]``
    int64; ``raw`` ``[R, V]`` gives the logprobs, computed only when a request asks for them.
    """
    counts = num_accepted.tolist()
    token_ids = [[*d[:n], t] for d, n, t in zip(draft_token_ids, counts, tokens.tolist(),
                                                strict=True)]
    logprobs = None
    if any(p.logprobs for p in batch.params):
        logprobs = emitted_logprobs(raw, layout, num_accepted, tokens)
    return VerifyOutput(token_ids=token_ids, num_accepted=counts, logprobs=logprobs)
