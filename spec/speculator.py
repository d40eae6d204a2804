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
from quickdraft.spec.draft_model import DraftInput, DraftModelRunner
from quickdraft.spec.ngram import NgramProposer
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import AcceptanceTracker, SpeculationPolicy, expected_accepted
from quickdraft.spec.recycling import RecyclingProposer
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_tree import available as suffix_tree_available
from quickdraft.spec.verification import supports_speculation


@dataclass
class SpeculationStats:
    """Global counters (for the metrics endpoint)."""

    num_steps: int = 0  # verification steps (request-steps with >= 1 draft)
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max_k]
    drafted_per_position: list[int] = field(default_factory=list)  # [max_k]
    proposer_seconds: float = 0.0  # wall time spent choosing drafts (all proposers)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the one sampled token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


@dataclass
class _Candidate:
    request: Request
    drafts: list[int] | None  # model-free drafts; None = ask the draft model
    available: int
    tracker: AcceptanceTracker


class Speculator:
    """Chooses each running request's drafts. ``kv`` is asked (never edited) for draft slots;
    ``draft`` is the draft-model runner (None: n-gram only); ``vocab_size`` sizes the token
    recycling tables (0: no recycling)."""

    def __init__(self, method: str, max_k: int, ngram_min: int, ngram_max: int,
                 policy: SpeculationPolicy, kv: KVCacheManager | None = None,
                 draft: DraftModelRunner | None = None, max_model_len: int = 1 << 30,
                 vocab_size: int = 0) -> None:
        self.method = method
        self.max_k = max_k
        self.proposer = NgramProposer(min_n=ngram_min, max_n=ngram_max, k=max_k)
        # suffix tries (per request, per tenant); None without gcc: "suffix" drafts n-grams
        self.suffix = SuffixProposer(_suffix_config()) if suffix_tree_available() else None
        # target-prediction tables (per tenant): "recycling", and "suffix" when nothing matched
        self.recycling = RecyclingProposer(vocab_size) if vocab_size else None
        self.policy = policy
        self.kv = kv
        self.draft_model = draft
        self.max_model_len = max_model_len
        self.stats = SpeculationStats(accepted_per_position=[0] * max_k,
                                      drafted_per_position=[0] * max_k)

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

    def _candidate(self, request: Request, k: int) -> _Candidate | None:
        method = self.method_of(request)
        if method == "combined":
            return self._best_candidate(request, k)
        drafts: list[int] = []
        source = ""
        if method == "suffix" and self.suffix is not None:
            drafts, source = self.suffix.propose(request, k).tokens, "suffix"
        elif method in ("ngram", "suffix"):
            drafts = self.proposer.propose(_context(request, self.proposer.max_context))[:k]
            source = "ngram"
        if not drafts and method in ("suffix", "recycling") and self.recycling is not None:
            # nothing to copy (a chat prompt): follow the target's own recent predictions
            drafts, source = self.recycling.propose(request, k), "recycling"
        if drafts:
            return _Candidate(request, drafts, len(drafts), self._tracker(request, source))
        if method == "draft" and self.draft_model is not None:
            return _Candidate(request, None, k, self._tracker(request, "draft"))
        return None

    def _best_candidate(self, request: Request, k: int) -> _Candidate | None:
        """``combined``: every model-free proposer drafts, and the chain with the largest
        expected accepted length under this request's acceptance of that source wins; the
        draft model (a forward pass per draft) only when none of them has anything."""
        best: _Candidate | None = None
        best_gain = 0.0
        for source, drafts in self._model_free_drafts(request, k):
            tracker = self._tracker(request, source)
            gain = expected_accepted(tracker.alpha, len(drafts))
            if best is None or gain > best_gain:
                best, best_gain = _Candidate(request, drafts, len(drafts), tracker), gain
        if best is None and self.draft_model is not None:
            best = _Candidate(request, None, k, self._tracker(request, "draft"))
        return best

    def _model_free_drafts(self, request: Request, k: int) -> list[tuple[str, list[int]]]:
        """(source, drafts) of each model-free proposer that found something."""
        found = [("ngram",
                  self.proposer.propose(_context(request, self.proposer.max_context))[:k])]
        if self.suffix is not None:
            found.append(("suffix", self.suffix.propose(request, k).tokens))
        if self.recycling is not None:
            found.append(("recycling", self.recycling.propose(request, k)))
        return [(source, drafts) for source, drafts in found if drafts]

    @staticmethod
    def _tracker(request: Request, source: str) -> AcceptanceTracker:
        return request.spec_state.tracker(source)

    def recycler(self, requests: list[Request]
                 ) -> Callable[[torch.Tensor, StepPlan], None] | None:
        """What the runner calls with a step's logits ``[num_sample_rows, vocab]`` and plan to
        feed the recycling tables, for the step's ``requests`` (in the scheduler output's
        order); None (no top-k computed) when none of them drafts with recycling."""
        if self.recycling is None:
            return None
        wanted = [self.method_of(r) in ("suffix", "recycling", "combined")
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

    def _plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
              budget: int) -> None:
        candidates: list[_Candidate] = []
        for request, room in zip(requests, rooms, strict=True):
            request.clear_drafts()
            k = self._wants(request, room)
            if k and (candidate := self._candidate(request, k)) is not None:
                candidates.append(candidate)
        if not candidates:
            return
        ks = self.policy.allocate([c.tracker.alpha for c in candidates],
                                  [c.available for c in candidates], num_plain_tokens,
                                  [c.drafts is None for c in candidates],
                                  [1.0 if c.request.priority <= 0 else
                                   self.policy.background_weight for c in candidates])
        for c, k in zip(candidates, ks, strict=True):
            c.tracker.steps_since_probe += 1
            if k == 0 and c.tracker.alpha <= self.policy.probe_below_alpha \
                    and c.tracker.steps_since_probe >= self.policy.probe_interval:
                k = 1  # re-test a request whose acceptance had collapsed (not one that
                # was refused because drafting costs too much at this batch size)
            k = min(k, budget)
            if not k:
                continue
            budget -= k
            c.tracker.steps_since_probe = 0
            state = c.request.spec_state
            state.verifying = c.tracker
            state.num_planned_steps += 1
            if c.drafts is None:
                state.model_k = k
            else:
                c.request.spec_token_ids = c.drafts[:k]

    def draft(self, requests: list[Request]) -> None:
        """The draft model drafts ``spec_state.model_k`` tokens for each of ``requests`` in
        one batched call, into the slots the scheduler reserved (the block tables already
        cover ``num_tokens + model_k`` positions)."""
        assert self.draft_model is not None and self.kv is not None
        start = time.perf_counter()
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
        self.stats.proposer_seconds += time.perf_counter() - start

    def cancel(self, request: Request) -> None:
        """The drafts planned for ``request`` will not be verified this step."""
        request.spec_state.verifying = None
        request.spec_state.model_k = 0

    def on_preempt(self, request: Request) -> None:
        request.spec_state.on_preempt()

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Account one verification of ``num_drafted`` drafts for ``request``."""
        state = request.spec_state
        tracker, state.verifying = state.verifying, None
        # the draft model's cache holds real tokens only up to the verified ones
        state.draft_cache_valid = min(state.draft_cache_valid, request.num_computed_tokens)
        if num_drafted == 0:
            return
        if tracker is not None:
            tracker.update(num_drafted, num_accepted)
        request.num_spec_steps += 1
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        s = self.stats
        s.num_steps += 1
        s.num_drafted += num_drafted
        s.num_accepted += num_accepted
        for pos in range(num_drafted):
            s.drafted_per_position[pos] += 1
            if pos < num_accepted:
                s.accepted_per_position[pos] += 1

    def on_finish(self, request: Request, status: RequestStatus) -> None:
        """The request is done: drop its state; its output joins its tenant's suffix
        partition when it ended normally or was cancelled (not on an error)."""
        request.spec_state.on_preempt()
        request.spec_state.trackers.clear()
        if self.suffix is not None:
            if status != RequestStatus.FINISHED_ERROR and request.error is None:
                self.suffix.finish(request)
            else:
                self.suffix.forget(request.request_id)


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
