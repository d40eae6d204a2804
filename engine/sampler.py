"""Next-token sampling: penalties, temperature, top-k / top-p / min-p filters, seeded draws.

Pure functions over torch tensors, vectorised across the batch: the only Python loops run
over requests (rows), never over the vocabulary. Fast paths: an all-greedy batch without
penalties is a single argmax; penalties are skipped when no request uses them; nothing is
sorted when no request uses top-k / top-p; top-k (with or without top-p) takes a partial
``topk`` of max(k) + 1 values, and top-p alone first tries the 1024 largest, sorting the
whole vocabulary only when those hold less than top_p of the mass (flat distributions).

Filter semantics (shared with the speculative rejection sampler through
:func:`apply_temperature_and_filters`) are value thresholds, so a row's result does not
depend on how ties are ordered, nor (up to float rounding of the normalisation) on which
other rows are in the batch or which of the paths above was taken:

* top-k keeps every token whose logit is >= the k-th largest (ties at the cut-off are kept);
* top-p, applied to the top-k survivors renormalised, keeps the smallest prefix of the
  descending order whose probability mass is >= top_p (at least the top token), plus ties
  at the last kept value;
* min-p drops tokens whose probability is < min_p * the top token's probability, computed in
  logit space as ``logit < max_logit + log(min_p)`` (the ratio is unchanged by the other
  filters, so min-p commutes with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels.cpu_fused import argmax_rows

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-step sampling inputs, one row per request that samples this step."""

    params: list[SamplingParams]
    # Per-request seeded generator, or None -> draw from `default_generator`.
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]  # used only for repetition_penalty
    output_token_ids: list[list[int]]  # used for all three penalties
    default_generator: torch.Generator | None = None  # None -> torch's global generator


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [batch] int64
    # [batch] float32: log_softmax of the RAW logits (before penalties / temperature) at the
    # chosen token; None when no request asked for logprobs.
    logprobs: torch.Tensor | None


# ---------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------


def _flat_positions(
    id_lists: list[list[int]], rows: list[int], vocab: int, device: torch.device,
) -> torch.Tensor:
    """``row * vocab + id`` for every id of ``id_lists[j]`` (row ``rows[j]``): ``[N]`` int64.

    Indexes the flattened ``[B * V]`` logits, so gather / scatter touch only these
    positions. Ids outside ``[0, vocab)`` are refused (they would land in another row).
    """
    ids = torch.cat([torch.as_tensor(x, dtype=torch.long) for x in id_lists])  # [N]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token id outside the vocabulary [0, {vocab})")
    lengths = torch.tensor([len(x) for x in id_lists], dtype=torch.long)  # [R]
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)  # [N]
    return (row_of * vocab + ids).to(device)


def _penalty_column(values: list[float], positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per-row values ``[B]`` spread to flat ``positions`` ``[N]``: ``[N]`` float32."""
    table = torch.tensor(values, dtype=torch.float32, device=positions.device)  # [B]
    return table[positions // vocab]  # [N]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, presence and frequency penalties; ``logits`` is ``[B, V]`` float32.

    * repetition (HF / CTRL): logits of tokens seen in prompt + output are divided by the
      penalty when positive and multiplied by it otherwise;
    * presence / frequency (OpenAI): ``logit -= presence * (count > 0) + frequency * count``
      with ``count`` taken over output tokens only.

    Work is proportional to the number of prompt / output ids, not to the vocabulary (one
    gather and one scatter of the seen positions, plus a copy of the logits). Duplicate ids
    compute and write identical values. The input is never modified in place (it is
    returned as is when no row uses a penalty).
    """
    params, vocab = batch.params, logits.shape[-1]
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return logits
    outputs = _flat_positions([batch.output_token_ids[i] for i in rows], rows, vocab,
                              logits.device)  # [No]
    prompts = [batch.prompt_token_ids[i] if params[i].repetition_penalty != 1.0 else []
               for i in rows]
    seen = torch.cat([_flat_positions(prompts, rows, vocab, logits.device), outputs])  # [N]
    if seen.numel() == 0:
        return logits
    counts = torch.zeros(logits.numel(), dtype=torch.float32, device=logits.device)  # [B*V]
    counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
    count = counts[seen]  # [N] occurrences in the output
    rep = _penalty_column([p.repetition_penalty for p in params], seen, vocab)  # [N]
    presence = _penalty_column([p.presence_penalty for p in params], seen, vocab)  # [N]
    frequency = _penalty_column([p.frequency_penalty for p in params], seen, vocab)  # [N]
    out = logits.clone(memory_format=torch.contiguous_format)  # [B, V]
    flat = out.view(-1)  # [B*V]
    values = flat[seen]  # [N]
    values = torch.where(values > 0, values / rep, values * rep)
    flat[seen] = values - frequency * count - presence * (count > 0)
    return out


# ---------------------------------------------------------------------------------------
# Temperature and filters
# ---------------------------------------------------------------------------------------


# Top-p rows without top-k first look for their cut-off among this many largest logits
# (a partial ``topk``); only when those hold less than top_p of the mass is the whole
# vocabulary sorted.
_TOP_P_CANDIDATES = 1024


def _top_p_cutoff(
    cands: torch.Tensor, kth: torch.Tensor, logits: torch.Tensor, top_p: torch.Tensor,
    use_k: torch.Tensor, use_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-p cut-off value ``[B, 1]`` (-inf for rows without top-p).

    ``cands`` ``[B, n]`` holds each row's n largest logits in descending order and ``kth``
    ``[B, 1]`` the top-k cut-off; the mass is over the top-k survivors, renormalised (the
    whole row when a row has no top-k). Also returns ``settled`` ``[B]`` bool: False where
    the candidates hold less than top_p of the mass, so the prefix may run past them.
    """
    survivors = cands.masked_fill(cands < kth, _NEG_INF)  # [B, n]
    log_z = torch.logsumexp(survivors, dim=-1)  # [B]
    if bool((use_p & ~use_k).any()):
        log_z = torch.where(use_k, log_z, torch.logsumexp(logits, dim=-1))
    probs = torch.exp(survivors - log_z.unsqueeze(1))  # [B, n]
    cum = torch.cumsum(probs, dim=-1)  # [B, n]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [B, n]
    n_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)  # [B, 1], >= 1
    cutoff = cands.gather(1, n_keep - 1).masked_fill(~use_p.unsqueeze(1), _NEG_INF)
    settled = use_k | ~use_p | (cum[:, -1] >= top_p)  # [B]
    return cutoff, settled


def _top_k_top_p_cutoff(
    logits: torch.Tensor, n: int, top_k: torch.Tensor, top_p: torch.Tensor,
    use_k: torch.Tensor, use_p: torch.Tensor,
) -> torch.Tensor | None:
    """Per-row cut-off ``[B, 1]`` found among the ``n`` largest logits of each row.

    None when ``n`` candidates cannot settle it: top-k ties reaching the last candidate
    (their mass would be missing from the top-p normalisation), or a top-p prefix that may
    run past the candidates. With ``n == V`` it always succeeds.
    """
    vocab = logits.shape[-1]
    if n == vocab:
        cands = torch.sort(logits, dim=-1, descending=True).values  # [B, V]
    else:
        cands = torch.topk(logits, n, dim=-1, sorted=True).values  # [B, n]
    k_index = torch.where(use_k, top_k, 1).unsqueeze(1) - 1  # [B, 1]
    kth = cands.gather(1, k_index).masked_fill(~use_k.unsqueeze(1), _NEG_INF)  # [B, 1]
    if not bool(use_p.any()):
        return kth  # top-k alone: the k-th value needs no normalisation
    partial = n < vocab
    if partial and bool((use_k & use_p & (kth.squeeze(1) == cands[:, -1])).any()):
        return None
    p_cutoff, settled = _top_p_cutoff(cands, kth, logits, top_p, use_k, use_p)
    if partial and not bool(settled.all()):
        return None
    return torch.maximum(kth, p_cutoff)  # [B, 1]


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
) -> torch.Tensor:
    """Mask tokens outside top-k and then top-p with -inf; ``logits`` is ``[B, V]``."""
    vocab = logits.shape[-1]
    top_k = top_k.to(device=logits.device, dtype=torch.long)  # [B]
    top_p = top_p.to(device=logits.device, dtype=logits.dtype)  # [B]
    use_k = (top_k > 0) & (top_k < vocab)  # [B]
    use_p = top_p < 1.0  # [B]
    if not bool((use_k | use_p).any()):
        return logits
    # One past the largest k, so that top-k ties running past the candidates are detected.
    n = int(top_k[use_k].max()) + 1 if bool(use_k.any()) else 1
    if bool((use_p & ~use_k).any()):
        n = max(n, _TOP_P_CANDIDATES)
    cutoff = _top_k_top_p_cutoff(logits, min(n, vocab), top_k, top_p, use_k, use_p)
    if cutoff is None:
        cutoff = _top_k_top_p_cutoff(logits, vocab, top_k, top_p, use_k, use_p)
    assert cutoff is not None
    return logits.masked_fill(logits < cutoff, _NEG_INF)  # [B, V]


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    log_min_p = torch.log(min_p.to(device=logits.device, dtype=logits.dtype))  # [B]
    cutoff = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(logits < cutoff, _NEG_INF)  # log(0) = -inf: row untouched


def apply_temperature_and_filters(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """``logits / temperature`` with filtered-out entries set to -inf.

    ``logits`` is ``[B, V]`` float; per-row parameters: ``temperature`` ``[B]`` float (> 0),
    ``top_k`` ``[B]`` int (0 or >= V = off), ``top_p`` ``[B]`` float (1 = off), ``min_p``
    ``[B]`` float (0 = off). Filters use the module docstring's threshold semantics. The
    input is never modified; it is returned as is when nothing applies. Deterministic.
    """
    temperature = temperature.to(device=logits.device, dtype=logits.dtype)  # [B]
    if bool((temperature != 1.0).any()):
        logits = logits / temperature.unsqueeze(1)  # [B, V]
    logits = _apply_top_k_top_p(logits, top_k, top_p)
    if bool((min_p > 0).any()):
        logits = _apply_min_p(logits, min_p)
    return logits


# ---------------------------------------------------------------------------------------
# Drawing and the per-step entry point
# ---------------------------------------------------------------------------------------


def draw_exponential_noise_(
    out: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Fill ``out`` ``[B, V]`` float32 in place with Exp(1) noise and return it.

    ``-log(u)``, ``u ~ U[0, 1)`` (several times faster on CPU than ``exponential_``). Row i's
    uniforms come from ``generators[i]`` alone, so a seeded row gets the same noise whatever
    it is batched with; rows with ``None`` share one draw from ``default_generator``. The
    order of the draws is part of the contract: the speculative verifiers
    (:mod:`spec.rejection_sampler`, :mod:`kernels.triton_rejection`) reproduce
    :func:`sample_from_probs` through it. ``u == 0`` gives ``inf``, never nan.
    """
    if len(generators) != out.shape[0]:
        raise ValueError(f"{len(generators)} generators for {out.shape[0]} rows")
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        out.uniform_(generator=default_generator)
    elif len(seeded) < len(generators):
        unseeded = [i for i, g in enumerate(generators) if g is None]
        noise = torch.empty(len(unseeded), out.shape[1], device=out.device)  # [U, V]
        out[unseeded] = noise.uniform_(generator=default_generator)
    for i in seeded:
        out[i].uniform_(generator=generators[i])
    return out.log_().neg_()  # [B, V] Exp(1) by inversion


def sample_from_probs(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]``: ``argmax(probs / q)``, ``q ~ Exp(1)``.

    The exponential race picks token i with probability ``probs[i] / sum(probs)``. The noise
    ``q`` is :func:`draw_exponential_noise_`'s: row i's from ``generators[i]`` alone, so a
    seeded row draws the same tokens whatever it is batched with; rows with ``None`` share
    one draw from ``default_generator``. Returns ``[B]`` int64.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    q = torch.empty_like(probs, dtype=torch.float32)  # [B, V]
    draw_exponential_noise_(q, generators, default_generator)
    return argmax_rows(probs / q)  # [B]


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
    """Draw for the non-greedy ``rows``; ``logits`` ``[R, V]`` holds just those rows."""
    params = [batch.params[i] for i in rows]

    def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=logits.device)  # [R]

    filtered = apply_temperature_and_filters(
        logits,
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([p.top_k for p in params], torch.long),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
    )  # [R, V]
    probs = torch.softmax(filtered, dim=-1)  # [R, V]
    generators = [batch.generators[i] for i in rows]
    return sample_from_probs(probs, generators, batch.default_generator)  # [R]


def _pick_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Greedy rows take the argmax, the others are sampled; ``logits`` ``[B, V]`` penalised."""
    greedy = [i for i, p in enumerate(batch.params) if p.greedy]
    if len(greedy) == logits.shape[0]:
        return argmax_rows(logits)  # [B]
    sampled = [i for i, p in enumerate(batch.params) if not p.greedy]
    if not greedy:
        return _sample_rows(logits, batch, sampled)
    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # [B]
    token_ids[greedy] = argmax_rows(logits[greedy])
    token_ids[sampled] = _sample_rows(logits[sampled], batch, sampled)
    return token_ids


def _chosen_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at ``token_ids``, without materialising the full ``[B, V]``."""
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
    return chosen - torch.logsumexp(logits, dim=-1)  # [B]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick the next token for every row of ``logits`` ``[B, V]`` (any float dtype).

    Computation is in float32. Greedy rows (temperature 0) take the argmax of the penalised
    logits; the others go penalties -> temperature + filters -> softmax -> exponential race.
    """
    if len(batch.params) != logits.shape[0]:
        raise ValueError(f"{len(batch.params)} requests for {logits.shape[0]} logit rows")
    raw = logits.float()  # [B, V]; no copy when already float32, never modified
    if all(p.greedy and not p.uses_penalties for p in batch.params):
        token_ids = argmax_rows(raw)  # [B]
    else:
        token_ids = _pick_tokens(apply_penalties(raw, batch), batch)  # [B]
    logprobs = _chosen_logprobs(raw, token_ids) if any(p.logprobs for p in batch.params) else None
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
