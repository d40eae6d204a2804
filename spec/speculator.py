"""Engine-side speculation: choose drafts for the next step and keep acceptance statistics.

After each step the engine calls :meth:`Speculator.propose` with the running requests. For
every request in its decode phase (all but the newest token computed) whose settings allow
speculation, the proposer drafts up to ``max_k`` tokens, the adaptive policy decides how many
of them are worth verifying, and they are stored in ``request.spec_token_ids``; the scheduler
then schedules them with the request's next token and the runner verifies them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request
from quickdraft.engine.step_plan import StepPlan
from quickdraft.spec.draft_model import DraftInput, DraftModelRunner
from quickdraft.spec.ngram import NgramProposer
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import AcceptanceTracker, SpeculationPolicy, expected_accepted
from quickdraft.spec.recycling import RecyclingProposer
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_tree import available as suffix_tree_available
from quickdraft.spec.verification import supports_speculation

# Recycling drafts were accepted 26–34 % of the time on spec_bench (SmolLM2, 2026-11-24);
# the tracker's optimistic 0.6 made every request pay for drafts that mostly fail before it
# learned that, and suffix-with-fallback came out a little slower than suffix alone.
RECYCLING_PRIOR = 0.3


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
        self.draft = draft
        self.max_model_len = max_model_len
        # Per request and source ("ngram" / "suffix" / "recycling" / "draft"): acceptance
        # differs a lot between them.
        self._trackers: dict[tuple[str, str], AcceptanceTracker] = {}
        self._verifying: dict[str, AcceptanceTracker] = {}  # tracker of this step's drafts
        # Draft-model cache progress: request id -> (valid positions, preemptions seen).
        self._draft_progress: dict[str, tuple[int, int]] = {}
        self.stats = SpeculationStats(accepted_per_position=[0] * max_k,
                                      drafted_per_position=[0] * max_k)

    def method_of(self, request: Request) -> str:
        params: SpeculationParams | None = request.spec_params
        return params.method if params and params.method else self.method

    def _wants(self, request: Request) -> int:
        """Most drafts this request may take (0 = no speculation for it)."""
        params: SpeculationParams | None = request.spec_params
        if self.method_of(request) == "off" or not supports_speculation(request.sampling_params):
            return 0
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0  # still prefilling, or just preempted
        k = params.k if params and params.k is not None else self.max_k
        # One token always comes from the target; drafts past the limits are wasted.
        room = min(self.max_model_len - request.num_tokens - 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
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
        if method == "draft" and self.draft is not None:
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
        if best is None and self.draft is not None:
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

    def _tracker(self, request: Request, source: str) -> AcceptanceTracker:
        """This request's acceptance estimate for drafts from ``source``."""
        key = (request.request_id, source)
        if key not in self._trackers:  # recycling starts at its measured mean, not 0.6
            prior = RECYCLING_PRIOR if source == "recycling" else AcceptanceTracker.alpha
            self._trackers[key] = AcceptanceTracker(alpha=prior)
        return self._trackers[key]

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

    def propose(self, running: list[Request], num_plain_tokens: int) -> None:
        """Fill ``spec_token_ids`` (and ``spec_draft_probs``) of the running requests."""
        start = time.perf_counter()
        try:
            self._propose(running, num_plain_tokens)
        finally:
            self.stats.proposer_seconds += time.perf_counter() - start

    def _propose(self, running: list[Request], num_plain_tokens: int) -> None:
        candidates: list[_Candidate] = []
        for request in running:
            request.spec_token_ids, request.spec_draft_probs = [], None
            k = self._wants(request)
            if k and (candidate := self._candidate(request, k)) is not None:
                candidates.append(candidate)
        if not candidates:
            return
        ks = self.policy.allocate([c.tracker.alpha for c in candidates],
                                  [c.available for c in candidates], num_plain_tokens,
                                  [c.drafts is None for c in candidates],
                                  [1.0 if c.request.priority <= 0 else
                                   self.policy.background_weight for c in candidates])
        by_model: list[tuple[Request, int]] = []
        for c, k in zip(candidates, ks, strict=True):
            c.tracker.steps_since_probe += 1
            if k == 0 and c.tracker.alpha <= self.policy.probe_below_alpha \
                    and c.tracker.steps_since_probe >= self.policy.probe_interval:
                k = 1  # re-test a request whose acceptance had collapsed (not one that
                # was refused because drafting costs too much at this batch size)
            if not k:
                continue
            c.tracker.steps_since_probe = 0
            self._verifying[c.request.request_id] = c.tracker
            if c.drafts is None:
                by_model.append((c.request, k))
            else:
                c.request.spec_token_ids = c.drafts[:k]
        if by_model:
            self._propose_with_model(by_model)

    def _propose_with_model(self, items: list[tuple[Request, int]]) -> None:
        """One batched draft-model call for every request that drafts with it."""
        assert self.draft is not None and self.kv is not None
        inputs: list[DraftInput] = []
        requests: list[Request] = []
        for request, k in items:
            rid = request.request_id
            done, preemptions = self._draft_progress.get(rid, (0, request.num_preemptions))
            # Invariant: the draft cache is valid only where the target's is (verified tokens).
            done = min(done, request.num_computed_tokens) \
                if preemptions == request.num_preemptions else 0
            if not self.kv.allocate_slots(rid, request.num_tokens + k):
                continue  # the pool is short: no drafts this step
            inputs.append(DraftInput(
                pending_token_ids=request.token_ids_slice(done, request.num_tokens),
                start_pos=done, k=k, block_table=tuple(self.kv.block_table(rid)),
                sampling_params=request.sampling_params, generator=request.generator))
            requests.append(request)
        for request, inp, out in zip(requests, inputs, self.draft.propose(inputs), strict=True):
            request.spec_token_ids = out.token_ids
            request.spec_draft_probs = out.probs
            self._draft_progress[request.request_id] = (
                request.num_tokens + inp.k - 1, request.num_preemptions)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Account one verification of ``num_drafted`` drafts for ``request``."""
        tracker = self._verifying.pop(request.request_id, None)
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

    def finish(self, request: Request, learn: bool = True) -> None:
        """The request is done: drop its state; with ``learn``, its output joins its
        tenant's suffix partition (only requests that ran to a normal end)."""
        request_id = request.request_id
        for source in ("ngram", "suffix", "recycling", "draft"):
            self._trackers.pop((request_id, source), None)
        self._verifying.pop(request_id, None)
        self._draft_progress.pop(request_id, None)
        if self.suffix is not None:
            if learn:
                self.suffix.finish(request)
            else:
                self.suffix.forget(request_id)


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
