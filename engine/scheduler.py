"""Iteration-level scheduler: each step, assign tokens to requests under a token budget.

There is no prefill or decode phase: a request is scheduled for
``num_tokens_with_spec - num_computed_tokens`` tokens (capped by the budget), which is a prefill
chunk, one decode token or k+1 verification tokens alike. Running requests go first, in order;
when the KV pool runs short the most recently admitted one is preempted (its blocks freed, its
progress reset so it is recomputed later). Waiting requests join while budget, sequence slots and
blocks last.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: the scheduler -> runner contract (read-only there)."""

    request_id: str
    token_ids: list[int]  # inputs: not-yet-computed tokens, then draft tokens
    start_pos: int  # position of token_ids[0] (= num_computed_tokens)
    block_table: tuple[int, ...]  # covers start_pos + len(token_ids) positions
    num_draft_tokens: int  # drafts at the tail of token_ids, to verify this step
    # [num_draft_tokens, vocab] draft-model distributions, or None (one-hot / greedy drafts)
    draft_probs: torch.Tensor | None
    sample: bool  # the step reaches the end of the request: sample 1 + num_draft_tokens rows
    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did to one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


INTERACTIVE = 0  # priorities <= this are interactive; greater ones are background


class Scheduler:
    """``priority_aging_s``: a waiting request's effective priority improves by one level per
    this many seconds (background work is never starved forever); None = no aging."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, priority_aging_s: float | None = 30.0,
                 max_background_tokens_with_interactive: int = 0,
                 max_background_tokens_per_step: int = 64) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.priority_aging_s = priority_aging_s
        # While interactive work runs, background requests share at most this many tokens of
        # each step (default 0: they pause; on a compute-bound CPU every extra row slows every
        # interactive token). Aging lifts a long-waiting background request into the
        # interactive class, so the batch job always progresses.
        self.max_background_tokens_with_interactive = max_background_tokens_with_interactive
        # Without interactive work, background steps stay short anyway, so that an arriving
        # interactive request never waits long for the step in flight to finish.
        self.max_background_tokens_per_step = max_background_tokens_per_step
        self._background_budget = 0  # this step's background tokens left (set in schedule)
        self.waiting: list[Request] = []  # ordered by (effective priority, arrival)
        self.running: list[Request] = []  # ordered likewise at every schedule()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._now = time.monotonic()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, stop string, error) and free their blocks now."""
        finished = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.kv.free(rid)
            finished.append(request)
        return finished

    def _key(self, request: Request) -> tuple[float, float]:
        """(effective priority, arrival): lower runs first."""
        priority: float = request.priority
        if self.priority_aging_s:
            priority -= (self._now - request.arrival_time) // self.priority_aging_s
        return priority, request.arrival_time

    def schedule(self) -> SchedulerOutput:
        self._now = time.monotonic()
        self.waiting.sort(key=self._key)
        self.running.sort(key=self._key)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        urgent = self._key(self.waiting[0])[0] if self.waiting else None
        interactive = any(r.priority <= INTERACTIVE for r in (*self.running, *self.waiting))
        self._background_budget = (self.max_background_tokens_with_interactive if interactive
                                   else self.max_background_tokens_per_step)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if urgent is not None and self._key(request)[0] > urgent \
                    and request.num_tokens - request.num_computed_tokens > 1:
                continue  # a less urgent prefill yields its budget to waiting work
            cap = self._cap(request, budget)
            if cap == 0:
                continue  # background paused (keeps its blocks) while interactive work runs
            self._trim_drafts(request, cap)
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, cap)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # `request` itself was preempted; everything after it too
            scheduled.append(self._schedule_one(request, num_new))
            budget -= num_new
            self._spend(request, num_new)
        budget = self._admit_waiting(budget, scheduled, preempted)
        return SchedulerOutput(scheduled, preempted)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest],
                       preempted: list[str]) -> int:
        """Admit waiting requests in order while budget, slots and blocks last; preempt less
        urgent running requests to make room (interactive never waits behind background)."""
        kv_pressure = bool(preempted)  # running work already needed preemption this step
        while self.waiting and budget > 0:
            request = self.waiting[0]
            cap = self._cap(request, budget)
            if cap == 0 or request.request_id in preempted:
                break  # background waits while interactive work has used its share; and
                # what was preempted this step does not come back in the same step
            admitted = not kv_pressure and len(self.running) < self.max_num_seqs \
                and self._admit(request, cap)
            if admitted:
                self.waiting.pop(0)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                num_new = min(request.num_tokens - request.num_computed_tokens, cap)
                scheduled.append(self._schedule_one(request, num_new))
                budget -= num_new
                self._spend(request, num_new)
                continue
            victim = self._less_urgent_victim(request)
            if victim is None:
                break  # wait for blocks, slots or budget to be freed
            budget += self._unschedule(victim, scheduled)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            self.waiting.sort(key=self._key)
            kv_pressure = False
        return budget

    def _cap(self, request: Request, budget: int) -> int:
        """Tokens ``request`` may take this step: the budget, or less for background work
        while interactive work runs."""
        if self._key(request)[0] <= INTERACTIVE:
            return budget  # interactive, or background aged into the interactive class
        return min(budget, self._background_budget)

    def _spend(self, request: Request, num_tokens: int) -> None:
        if self._key(request)[0] > INTERACTIVE:
            self._background_budget -= num_tokens

    def _admit(self, request: Request, budget: int) -> bool:
        """Allocate the waiting head's first chunk, starting after its cached prefix."""
        assert request.num_computed_tokens == 0  # fresh, or preempted (recompute)
        cached = self.kv.find_cached_prefix(
            request.request_id, request.token_ids_slice(0, request.num_tokens),
            request.cache_salt)
        num_cached = len(cached) * self.kv.block_size
        num_new = min(request.num_tokens - num_cached, budget)
        if not self.kv.allocate_slots(request.request_id, num_cached + num_new, cached):
            return False
        self.kv.record_query(request.num_tokens, num_cached)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
        return True

    def _less_urgent_victim(self, request: Request) -> Request | None:
        """The least urgent, newest running request less urgent than ``request``."""
        key = self._key(request)[0]
        for victim in reversed(self.running):
            if self._key(victim)[0] > key:
                return victim
        return None

    @staticmethod
    def _unschedule(victim: Request, scheduled: list[ScheduledRequest]) -> int:
        """Drop ``victim`` from this step if it was scheduled; returns its tokens."""
        for j, s in enumerate(scheduled):
            if s.request_id == victim.request_id:
                del scheduled[j]
                return s.num_tokens
        return 0

    def _trim_drafts(self, request: Request, budget: int) -> None:
        """Drop drafts that cannot be verified usefully this step: past the token budget, the
        context limit, or the tokens the request may still emit (one comes from the target)."""
        if not request.spec_token_ids:
            return
        room = min(
            budget - (request.num_tokens - request.num_computed_tokens),
            self.max_model_len - request.num_tokens - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
        )
        del request.spec_token_ids[max(room, 0):]

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        while not self.kv.allocate_slots(request.request_id,
                                         request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)  # re-sorted by (priority, arrival) next schedule()

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        num_drafts = max(end - request.num_tokens, 0)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, end),
            start_pos=start,
            block_table=tuple(self.kv.block_table(request.request_id)),
            num_draft_tokens=num_drafts,
            draft_probs=(request.spec_draft_probs[:num_drafts]
                         if request.spec_draft_probs is not None and num_drafts else None),
            sample=end == request.num_tokens_with_spec,
            sampling_params=request.sampling_params,
            generator=request.generator,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def update_from_output(
        self, output: SchedulerOutput, sampled: list[list[int]],
        logprobs: list[list[float]] | None,
    ) -> list[RequestUpdate]:
        """Advance progress, append verified tokens, finish requests that hit a stop condition.

        ``sampled[i]`` holds the tokens accepted for ``output.requests[i]``: empty for a
        non-final prefill chunk, else the accepted drafts followed by one sampled token.
        """
        updates: list[RequestUpdate] = []
        for i, sched in enumerate(output.requests):
            request = self.requests.get(sched.request_id)
            if request is None:  # finished while the step ran
                continue
            tokens = sampled[i]
            num_rejected = sched.num_draft_tokens - max(len(tokens) - 1, 0) if tokens else 0
            # Rejected drafts' K/V is discarded: progress rolls back past them.
            request.num_computed_tokens = sched.start_pos + sched.num_tokens - num_rejected
            request.spec_token_ids, request.spec_draft_probs = [], None
            new_tokens: list[int] = []
            status = None
            for j, token in enumerate(tokens):
                request.append_output(token, logprobs[i][j] if logprobs else None)
                new_tokens.append(token)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    break
            if status is not None:  # a stop inside the accepted drafts: the rest is void
                request.num_computed_tokens = min(request.num_computed_tokens,
                                                  request.num_tokens - 1)
            assert request.num_computed_tokens <= request.num_tokens
            self.kv.truncate(request.request_id, request.num_computed_tokens)
            # Only verified tokens enter the prefix cache: drafts were rolled back above.
            self.kv.cache_verified(request.request_id, request.num_computed_tokens,
                                   request.token_ids_slice, request.cache_salt)
            if status is not None:
                self.finish_requests([request.request_id], status)
            updates.append(RequestUpdate(request, new_tokens, status is not None))
        return updates
