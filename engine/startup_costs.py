"""What the speculation policy prices drafts with, measured once when the engine starts: the
target's step time by query tokens (:func:`measure_target_cost`) and a draft model's or
draft head's proposal time by batch size (:func:`measure_draft_costs`). While serving, both
are corrected by what steps and proposals really take
(:class:`spec.step_cost.ObservedStepCost`, :class:`spec.draft_cost.ObservedDraftCost`)."""

from __future__ import annotations

import logging

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.kv_cache import cdiv
from quickdraft.engine.model_runner import ModelRunner
from quickdraft.spec.draft_head_runner import DraftHeadRunner
from quickdraft.spec.draft_model import DraftModelRunner
from quickdraft.spec.step_cost import StepCost, measure_step_cost

log = logging.getLogger(__name__)
COST_CONTEXT = 256  # cached positions before the timed tokens of the step-cost curve


def measure_target_cost(config: EngineConfig, runner: ModelRunner) -> StepCost:
    """How a step's time grows with its number of tokens, measured on this machine (the
    default memory-bound curve when the config measures nothing or speculation is off).

    The sizes straddle every 8-row boundary: the bf16 GEMV kernel takes 8 rows per pass,
    so 9 tokens can cost about as much as 16, which a curve through powers of two would
    miss."""
    if not config.measure_step_cost or config.speculation == "off":
        return StepCost.memory_bound()
    limit = min(config.max_num_batched_tokens, 64)
    sizes = sorted({1, 2, 4, *range(8, 49, 8), *range(9, 50, 8), 64})
    # after a chat-sized context (where it fits): every verification row attends to the
    # whole context, so extra rows cost more there than after a short one
    blocks_needed = cdiv(COST_CONTEXT + limit, config.block_size)
    context = COST_CONTEXT if blocks_needed <= runner.num_blocks else 64
    cost = measure_step_cost(lambda n: runner.time_forward(n, context),
                             [n for n in sizes if n <= limit])
    log.info("step cost by tokens: %s", dict(zip(cost.num_tokens, cost.seconds, strict=True)))
    return cost


def measure_draft_costs(config: EngineConfig, head: DraftHeadRunner | None,
                        draft: DraftModelRunner | None
                        ) -> tuple[StepCost | None, StepCost | None]:
    """``(per draft, fixed)`` by batch size (None when not measured: drafting is free).
    The draft model: one forward per draft, nothing fixed. A draft head (without a draft
    model): a proposal for one draft (a tree of depth 1: its catch-up forward alone) is
    timed beside one for the most drafts (depth ``k``: ``k - 1`` rounds more); the
    difference per extra draft is the per-draft cost, the rest is fixed (``k`` drafts cost
    ``fixed + k * per_draft``)."""
    if not config.measure_step_cost:
        return None, None
    if head is not None and draft is None:
        k = max(config.num_speculative_tokens, 2)
        sizes = [n for n in (1, 2, 4, 8, 16) if n <= config.max_num_seqs]
        one = measure_step_cost(lambda b: head.time_propose(b, 2, max_depth=1), sizes)
        most = measure_step_cost(lambda b: head.time_propose(b, 2 * k, max_depth=k), sizes)
        n = min(len(one.seconds), len(most.seconds))  # (each stops on its budget)
        batches = one.num_tokens[:n]
        per_draft = tuple(max((m - o) / (k - 1), 0.0)
                          for o, m in zip(one.seconds[:n], most.seconds[:n], strict=True))
        fixed = tuple(max(o - d, 0.0) for o, d in zip(one.seconds, per_draft, strict=False))
        log.info("draft head cost by batch: per draft %s, fixed %s",
                 dict(zip(batches, per_draft, strict=True)),
                 dict(zip(batches, fixed, strict=True)))
        return StepCost(batches, per_draft), StepCost(batches, fixed)
    if draft is None:
        return None, None
    sizes = [n for n in (1, 2, 4, 8, 9, 16, 17, 32) if n <= config.max_num_seqs]
    cost = measure_step_cost(draft.time_forward, sizes)
    log.info("draft step cost by batch: %s", dict(zip(cost.num_tokens, cost.seconds, strict=True)))
    return cost, None
