"""Drafting with a model, after the scheduler has reserved the slots: the draft model's
chains and the draft head's trees, each batched over the step's requests that the policy
granted them (``spec_state.model_k`` drafts each). The speculator plans; this fills what it
planned, times it for the policy's draft costs, and keeps each request's draft caches
consistent: the draft model's K/V valid only where the target's is, the head's features
spent once it has caught up on them.
"""

from __future__ import annotations

import time

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request
from quickdraft.spec.draft_cost import ObservedDraftCost
from quickdraft.spec.draft_head_runner import HeadInput
from quickdraft.spec.draft_model import DraftInput
from quickdraft.spec.head_search import ROUNDS
from quickdraft.spec.proposals import Proposers
from quickdraft.spec.stats import SpeculationStats

# The deepest tree the head drafts (its catch-up and ROUNDS rounds); a chain goes deeper.
HEAD_TREE_DEPTH = ROUNDS + 1


class ModelDrafting:
    """The step's model drafts, by the draft model and head that ``proposers`` holds (read
    from there: one holder). ``kv`` is asked (never edited) for the reserved slots;
    ``stats`` gets the proposer time; ``draft_cost`` (None: not observed) each call's."""

    def __init__(self, proposers: Proposers, kv: KVCacheManager | None,
                 stats: SpeculationStats, draft_cost: ObservedDraftCost | None = None) -> None:
        self.proposers = proposers
        self.kv = kv
        self.stats = stats
        self.draft_cost = draft_cost

    def draft(self, requests: list[Request], chains_only: bool = False) -> None:
        """The draft model (or head) drafts ``spec_state.model_k`` tokens for each of
        ``requests`` in one batched call, into the slots the scheduler reserved (the block
        tables already cover ``num_tokens + model_k`` positions); ``chains_only``: this step
        verifies chains, so the head drafts one."""
        start = time.perf_counter()
        # what the policy priced: the deepest request's drafts for all of them
        depth = max((r.spec_state.in_flight_depth for r in requests), default=0)
        by_head = [r for r in requests if r.spec_state.in_flight_source == "head"]
        if by_head:
            self._draft_with_head(by_head, chains_only)
        if len(by_head) < len(requests):
            self._draft_with_model([r for r in requests
                                    if r.spec_state.in_flight_source != "head"])
        seconds = time.perf_counter() - start
        self.stats.proposer_seconds += seconds
        self.stats.model_draft_seconds += seconds
        if self.draft_cost is not None:
            self.draft_cost.observe(len(requests), depth, seconds)

    def _draft_with_model(self, requests: list[Request]) -> None:
        draft_model = self.proposers.draft_model
        assert draft_model is not None and self.kv is not None
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
        for request, inp, out in zip(requests, inputs, draft_model.propose(inputs),
                                     strict=True):
            request.spec_token_ids = out.token_ids
            request.spec_draft_probs = out.probs
            request.spec_state.model_k = 0
            request.spec_state.draft_cache_valid = request.num_tokens + inp.k - 1

    def _draft_with_head(self, requests: list[Request], chains_only: bool) -> None:
        """The head's tree (greedy; a chain for sampled requests or in a chains-only step)
        of ``model_k`` nodes per request. It first catches up on the target features of the
        positions verified since its last draft; a request missing them drafts nothing."""
        head = self.proposers.head
        assert head is not None and self.kv is not None
        inputs: list[HeadInput] = []
        owed: list[Request] = []
        for request in requests:
            state = request.spec_state
            n = request.num_tokens  # the last token is pending: features end at n - 2
            feats, fstart = state.head_features(), state.head_features_start
            start = min(max(state.head_valid, fstart), n - 2)
            if feats is None or not fstart <= start or fstart + len(feats) < n - 1:
                request.spec_state.model_k = 0  # (a gap in the features: draft nothing)
                continue
            rid = request.request_id
            assert len(self.kv.block_table(rid)) * self.kv.block_size \
                >= n + state.model_k, "draft slots not reserved"
            # one node a granted draft (the policy's chain) deeper than a tree reaches: that
            # chain, as priced (a tree of its nodes would spend the deeper ones on siblings)
            deep_chain = state.model_k <= state.in_flight_depth and \
                state.in_flight_depth > HEAD_TREE_DEPTH
            inputs.append(HeadInput(
                features=feats[start - fstart:n - 1 - fstart],
                next_token_ids=request.token_ids_slice(start + 1, n), start_pos=start,
                k=state.model_k, block_table=tuple(self.kv.block_table(rid)),
                sampling_params=request.sampling_params, generator=request.generator,
                tree=not (chains_only or deep_chain),
                max_depth=state.in_flight_depth or None))
            owed.append(request)
        for request, out in zip(owed, head.propose(inputs), strict=True):
            state = request.spec_state
            request.spec_token_ids = list(out.tree.token_ids)
            request.spec_tree = None if out.tree.is_chain else out.tree
            request.spec_draft_probs = out.probs
            state.model_k = 0
            state.in_flight_depth = out.tree.max_depth if len(out.tree) else 0
            # head K/V now holds positions [0, n - 1); features of those are spent
            state.head_valid = request.num_tokens - 1
            state.drop_features(request.num_tokens - 1)
