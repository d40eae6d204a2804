"""Triton speculative verification: :func:`spec.rejection_sampler.rejection_sample` on the GPU.

Same rules, same random draws, same results as the torch reference (read its module
docstring for the rules). The work is split in two:

* **torch** (shared with the reference through the public :mod:`spec.verification`:
  :func:`~spec.verification.prepare_verification`): validation, the batch layout, penalties
  and temperature / top-k / top-p / min-p on the target rows (``[R, V]`` processed logits),
  and the random numbers. Those are drawn **on CPU** with the requests' CPU
  ``torch.Generator``\\ s, in the reference's order: first the ``[D]`` acceptance uniforms
  (:func:`spec.verification.draft_uniforms`), then the ``[S, V]`` Exp(1)
  noise of the ``S`` sampled requests' final draws
  (:func:`engine.sampler.draw_exponential_noise_`, what ``sample_from_probs`` uses). They are
  then copied to the logits' device (``D + S * V`` floats), which keeps a seeded request's
  output the same on every device and identical to the reference's on CPU.
* **one Triton program per request** (grid ``(B,)``) walks its drafts in order while they
  are accepted: greedy requests compare the draft with the first argmax of its row; sampled
  ones test ``u * q(x) < p(x)`` with ``p(x) = exp(logit(x) - logsumexp(row))`` and ``q(x)``
  from ``draft_probs`` (1 for n-gram drafts). It then emits the recovered / bonus token at
  row ``start + accepted``: the first argmax for greedy requests; for sampled ones the
  exponential race ``argmax(r / noise)`` with ``r = max(0, p - q)`` after a rejection
  (``p`` itself when that residual is all zeros) and ``r = p`` at the bonus row, where
  ``p = exp(logit - max) / sum`` is the row's softmax. The race needs no normalisation.

The vocabulary is walked in ``BLOCK_V`` tiles: one pass for the max and first argmax (running
over tiles, a later tile wins only when strictly larger: torch.argmax's tie-breaking), one for
``sum(exp(logit - max))`` (skipped for greedy requests), and for a sampled final token one
more for the race (both ``r / noise`` and ``p / noise`` arg-maxima are kept, so the empty
residual needs no extra pass). The statistics of the rejected row are reused for its race.

Exactness: the decisions and draws are the reference's; the floats may differ in the last
bits because the sums run in another order (and, under the interpreter, numpy's ``exp``
differs from torch's in the last bit). A result can therefore differ only when a uniform or
two race keys fall within a rounding of each other (about 1e-7 per decision). Compiled, exp
and log are libdevice's (CUDA's ``expf`` / ``logf``, as torch's CUDA kernels use) and every
division is correctly rounded (``div_rn``), so only the order of the sums differs from torch
on a GPU.

Importing this module never fails: without triton, :func:`available` is False and
:func:`rejection_sample` raises. ``TRITON_INTERPRET=1`` must be set before import to run on
CPU tensors.
"""

# No ``from __future__ import annotations``: triton reads the ``tl.constexpr`` annotations.
import torch

from quickdraft.engine.sampler import SamplingBatch, draw_exponential_noise_
from quickdraft.kernels.triton_common import INTERPRET, available, jit, next_pow2, require, tl
from quickdraft.spec.verification import (
    VerifyLayout,
    VerifyOutput,
    assemble_output,
    draft_uniforms,
    prepare_verification,
)

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised only without triton
    libdevice = None

__all__ = ["available", "rejection_sample"]

_BLOCK_V = 1024  # vocabulary tile (the tests shrink it so that rows span several tiles)
_NUM_WARPS = 4  # a guess: tune on a GPU
# torch rounds every product and sum on its own: no contraction into FMAs here either.
_NO_FMA = {"enable_fp_fusion": False}


# ----------------------------------------------------------------------------------------------
# kernels


if INTERPRET or libdevice is None:
    # Plain functions that look ``tl.exp`` up when called: the interpreter patches ``tl``
    # while a kernel runs. (Not @jit helpers: every nested call costs the interpreter ~1 ms.)
    def _exp(x):  # type: ignore[no-untyped-def]
        return tl.exp(x)

    def _log(x):  # type: ignore[no-untyped-def]
        return tl.log(x)
else:  # compiled: CUDA's expf / logf (libdevice), as torch's CUDA kernels use
    _exp = libdevice.exp
    _log = libdevice.log


@jit
def _argmax_update(best, best_i, keys, start):
    """Fold a tile's ``keys`` into a running (max, first index of the max)."""
    m, i = tl.max(keys, 0, return_indices=True, return_indices_tie_break_left=True)
    take = m > best  # strictly: an earlier tile keeps ties
    return tl.where(take, m, best), tl.where(take, start + i, best_i)


@jit
def _row_stats(row_ptr, vocab, sampled, BLOCK_V: tl.constexpr):
    """``(first argmax, shift, sum(exp(logit - shift)))`` of a ``[vocab]`` fp32 row.

    ``shift`` is the row's max, or 0 when that is infinite (torch.logsumexp's guard). The sum is
    computed for sampled requests only (greedy ones need just the argmax)."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    m_i = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
        m, m_i = _argmax_update(m, m_i, x, start)
    shift = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    total = tl.zeros([], tl.float32)
    if sampled:
        acc = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
            acc += _exp(x - shift)
        total = tl.sum(acc, 0)
    return m_i, shift, total


@jit
def _accepts(row_ptr, x, d, sampled, argmax, shift, total, draft_probs_ptr, stride_q,
             uniforms_ptr, HAS_DRAFT_PROBS: tl.constexpr):
    """Whether draft ``d`` (token ``x``, target row at ``row_ptr``) passes its test."""
    ok = argmax == x  # greedy
    if sampled:
        lse = _log(total) + shift
        p = _exp(tl.load(row_ptr + x) - lse)  # p(x); 0 when the target filtered x
        q = 1.0  # n-gram drafts: one-hot
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + d * stride_q + x).to(tl.float32)
        ok = tl.load(uniforms_ptr + d) * q < p
    return ok


@jit
def _race(row_ptr, noise_row_ptr, q_row_ptr, x, rejected, vocab, shift, total,
          HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """``argmax(r / noise)`` over the row: r the residual ``max(0, p - q)`` of the rejected
    draft ``x`` (``q_row_ptr``: its draft distribution), or ``p`` when ``not rejected`` or when
    the residual is all zeros."""
    cols = tl.arange(0, BLOCK_V)
    best_r = tl.full([], -1.0, tl.float32)  # keys are >= 0: the first tile always wins
    idx_r = tl.zeros([], tl.int32)
    best_p = tl.full([], -1.0, tl.float32)
    idx_p = tl.zeros([], tl.int32)
    r_max = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        c = start + cols
        mask = c < vocab
        logit = tl.load(row_ptr + c, mask=mask, other=float("-inf"))
        p = tl.math.div_rn(_exp(logit - shift), total)  # softmax, 0 on padding
        if HAS_DRAFT_PROBS:
            # read only after a rejection (q_row_ptr is past the drafts at the bonus row);
            # not ``mask & rejected``: the interpreter refuses a mask and-ed with a scalar
            q_end = tl.where(rejected, vocab, 0)
            q = tl.load(q_row_ptr + c, mask=c < q_end, other=0.0).to(tl.float32)
        else:
            q = tl.where(c == x, 1.0, 0.0)
        r = tl.where(rejected, tl.maximum(p - q, 0.0), p)
        noise = tl.load(noise_row_ptr + c, mask=mask, other=1.0)
        best_r, idx_r = _argmax_update(best_r, idx_r, tl.math.div_rn(r, noise), start)
        best_p, idx_p = _argmax_update(best_p, idx_p, tl.math.div_rn(p, noise), start)
        r_max = tl.maximum(r_max, tl.max(r, 0))
    return tl.where(r_max > 0.0, idx_r, idx_p)


@jit
def _rejection_kernel(
    logits_ptr,  # [R, V] fp32, processed target logits
    draft_ids_ptr,  # [D] int64
    draft_probs_ptr,  # [D, V] any float dtype (unused without HAS_DRAFT_PROBS)
    uniforms_ptr,  # [D] fp32 acceptance uniforms
    noise_ptr,  # [S, V] fp32 Exp(1) noise of the sampled requests' final draws
    starts_ptr, num_drafts_ptr, draft_offsets_ptr,  # [B] int64: first row, k, first draft
    noise_rows_ptr,  # [B] int32: request's row of noise, -1 for greedy requests
    tokens_ptr, accepted_ptr,  # [B] int64 outputs: final token, accepted drafts
    vocab, stride_l, stride_q, stride_n,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(starts_ptr + req)
    k = tl.load(num_drafts_ptr + req).to(tl.int32)
    first = tl.load(draft_offsets_ptr + req)
    noise_row = tl.load(noise_rows_ptr + req)
    sampled = noise_row >= 0

    a = tl.zeros([], tl.int32)  # drafts accepted so far
    argmax = tl.zeros([], tl.int32)
    shift = tl.zeros([], tl.float32)
    total = tl.zeros([], tl.float32)
    go = k > 0
    while go:  # until the first rejection
        row_ptr = logits_ptr + (start + a) * stride_l
        argmax, shift, total = _row_stats(row_ptr, vocab, sampled, BLOCK_V)
        x = tl.load(draft_ids_ptr + first + a)
        ok = _accepts(row_ptr, x, first + a, sampled, argmax, shift, total, draft_probs_ptr,
                      stride_q, uniforms_ptr, HAS_DRAFT_PROBS)
        a += ok.to(tl.int32)
        go = ok & (a < k)

    rejected = a < k
    row_ptr = logits_ptr + (start + a) * stride_l
    if a == k:  # the bonus row (all drafts accepted, or k = 0) has not been read yet
        argmax, shift, total = _row_stats(row_ptr, vocab, sampled, BLOCK_V)
    token = argmax
    if sampled:
        x = tl.load(draft_ids_ptr + first + a, mask=rejected, other=-1)
        token = _race(row_ptr, noise_ptr + noise_row.to(tl.int64) * stride_n,
                      draft_probs_ptr + (first + a) * stride_q, x, rejected, vocab, shift,
                      total, HAS_DRAFT_PROBS, BLOCK_V)
    tl.store(tokens_ptr + req, token.to(tl.int64))
    tl.store(accepted_ptr + req, a.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# entry point


def _random_draws(
    num_drafts: list[int], batch: SamplingBatch, vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's random numbers, drawn on CPU in its order.

    ``(uniforms [D] fp32, noise [S, V] fp32, noise_rows [B] int32)``: the acceptance uniforms
    (0 for greedy requests' drafts), the Exp(1) noise of the sampled requests' final draws,
    and each request's row of noise (-1 for greedy requests)."""
    uniforms = draft_uniforms(num_drafts, batch, "cpu")  # [D]
    sampled = [i for i, p in enumerate(batch.params) if not p.greedy]
    noise = torch.empty(len(sampled), vocab, dtype=torch.float32)  # [S, V]
    if sampled:
        draw_exponential_noise_(noise, [batch.generators[i] for i in sampled],
                                batch.default_generator)
    noise_rows = torch.full((len(batch.params),), -1, dtype=torch.int32)  # [B]
    noise_rows[sampled] = torch.arange(len(sampled), dtype=torch.int32)
    return uniforms, noise, noise_rows


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _launch(
    logits: torch.Tensor, layout: VerifyLayout, draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor, noise: torch.Tensor, noise_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel; returns ``(tokens [B] int64, num_accepted [B] int64)``."""
    num_requests, vocab = layout.num_drafts.shape[0], logits.shape[1]
    device = logits.device
    tokens = torch.empty(num_requests, dtype=torch.long, device=device)  # [B]
    accepted = torch.empty(num_requests, dtype=torch.long, device=device)  # [B]
    if num_requests == 0:
        return tokens, accepted
    logits = _unit_rows(logits)  # [R, V] fp32
    has_q = draft_probs is not None and draft_probs.shape[0] > 0
    # empty tensors may have null pointers: never-read arguments get the logits instead
    probs = _unit_rows(draft_probs.to(device)) if has_q and draft_probs is not None else logits
    ids = layout.draft_ids if layout.draft_ids.numel() else layout.starts  # [D]
    u = uniforms.to(device) if uniforms.numel() else logits  # [D]
    noise = noise.to(device) if noise.numel() else logits  # [S, V]
    _rejection_kernel[(num_requests,)](
        logits, ids, probs, u, noise, layout.starts, layout.num_drafts, layout.draft_offsets,
        noise_rows.to(device), tokens, accepted, vocab, logits.stride(0), probs.stride(0),
        noise.stride(0), HAS_DRAFT_PROBS=has_q,
        BLOCK_V=min(_BLOCK_V, next_pow2(vocab)), num_warps=_NUM_WARPS,
        **_NO_FMA)
    return tokens, accepted


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> VerifyOutput:
    """:func:`spec.rejection_sampler.rejection_sample` with the per-request work in Triton.

    ``target_logits`` ``[R, V]`` (any float dtype, computed in float32) on a CUDA device (or
    on CPU under ``TRITON_INTERPRET=1``); ``draft_probs`` ``[D, V]`` or None (n-gram drafts);
    ``batch.generators`` / ``default_generator`` must be CPU generators (the random numbers
    are drawn on CPU, see the module docstring). Same draws and results as the reference.
    """
    require("quickdraft.kernels.triton_rejection")
    prep = prepare_verification(target_logits, draft_token_ids, draft_probs, batch)
    uniforms, noise, noise_rows = _random_draws(
        [len(d) for d in draft_token_ids], batch, prep.logits.shape[1])
    tokens, accepted = _launch(prep.logits, prep.layout, draft_probs, uniforms, noise,
                               noise_rows)
    return assemble_output(draft_token_ids, prep.raw, prep.layout, batch, accepted, tokens)
