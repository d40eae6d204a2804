"""Iteration-level scheduler: each step, assign tokens to requests under a token budget.

There is no prefill or decode phase: a request is scheduled for
``num_tokens_with_spec - num_computed_tokens`` tokens (capped by the budget), which is a prefill
chunk, one decode token or k+1 verification tokens alike. Running requests go first, in order;
when the KV pool runs short the most recently admitted one is preempted (its blocks freed, its
progress reset so it is recomputed later). Waiting requests join while budget, sequence slots and
blocks last.

Speculation is decided here (see :meth:`Scheduler.schedule`): the speculator is asked for
drafts only for the requests this step runs that decode, knowing the real batch, and every
draft's KV slot is reserved in the request's one allocation (``num_lookahead_tokens``).

Invariants, asserted by :meth:`Scheduler.check_invariants` (tests run it after every step):
each request is in exactly one queue with a matching status; a running request's block table
covers its computed tokens; only verified tokens are computed or cached between steps (no
drafts are left over); a prefix-cache hit leaves at least the last prompt token to compute;
the KV pool's reference counts match the block tables.
"""

from __future__ import annotations

from collections.abc import Iterable

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.priorities import INTERACTIVE, Priorities
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.scheduler_output import (
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
    Speculation,
)

__all__ = ["INTERACTIVE", "RequestUpdate", "ScheduledRequest", "Scheduler", "SchedulerOutput",
           "Speculation"]


class Scheduler:
    """``priority_aging_s``: a waiting request's effective priority improves by one level per
    this many seconds (background work is never starved forever); None = no aging. It and the
    two background shares are :class:`engine.priorities.Priorities`' (see there)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, priority_aging_s: float | None = 30.0,
                 max_background_tokens_with_interactive: int = 0,
                 max_background_tokens_per_step: int = 64,
                 speculation: Speculation | None = None) -> None:
        self.kv = kv
        self.speculation = speculation  # None: drafts only as set by the caller (tests)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # effective priorities (aging) and the background share of each step
        self.priorities = Priorities(priority_aging_s, max_background_tokens_with_interactive,
                                     max_background_tokens_per_step)
        self.waiting: list[Request] = []  # ordered by (effective priority, arrival)
        self.running: list[Request] = []  # ordered likewise at every schedule()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

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
            request.clear_drafts()
            if self.speculation is not None:
                self.speculation.on_finish(request, status)
            finished.append(request)
        return finished

    def schedule(self) -> SchedulerOutput:
        """This step's batch: who runs, with how many tokens and drafts, slots reserved.

        1. choose the running requests that run and their plain tokens (prefill chunk or the
           one pending token), under the token budget and the background share;
        2. let speculation plan drafts for the chosen decoding requests against that real
           batch (prefill chunks and waiting prompts included): model-free drafts now, the
           draft model's count only;
        3. allocate each chosen request's tokens plus its lookahead (draft) slots in one
           call, preempting the least urgent when the pool runs short (drafts go first);
        4. admit waiting requests with what is left;
        5. the draft model drafts into the slots reserved for it.
        """
        self.priorities.start_step((*self.running, *self.waiting))
        self.waiting.sort(key=self.priorities.key)
        self.running.sort(key=self.priorities.key)
        preempted: list[str] = []
        chosen, budget = self._choose_running(self.max_num_batched_tokens)
        budget -= self._plan_drafts(chosen, budget)
        steps: list[tuple[Request, int]] = []
        for request, num_plain, _ in chosen:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted this step to make room for a more urgent one
            if not self._allocate_or_preempt(request, num_plain, preempted):
                break  # `request` itself was preempted; everything after it too
            steps.append((request, num_plain + request.num_lookahead_tokens))
        self._admit_waiting(budget, steps, preempted)
        if self.speculation is not None:
            owed = [r for r, _ in steps if r.spec_state.model_k]
            if owed:
                self.speculation.draft(owed)
        return SchedulerOutput(
            [self._schedule_one(r, min(n, r.num_tokens_with_spec - r.num_computed_tokens))
             for r, n in steps], preempted)

    def _choose_running(self, budget: int) -> tuple[list[tuple[Request, int, int]], int]:
        """The running requests this step runs, in order, with their plain tokens and their
        cap (tokens they may take in all); and the budget left. Allocates nothing."""
        urgent = self.priorities.key(self.waiting[0])[0] if self.waiting else None
        chosen: list[tuple[Request, int, int]] = []
        for request in self.running:
            if budget <= 0:
                break
            if urgent is not None and self.priorities.key(request)[0] > urgent \
                    and request.num_tokens - request.num_computed_tokens > 1:
                continue  # a less urgent prefill yields its budget to waiting work
            cap = self.priorities.cap(request, budget)
            if cap == 0:
                continue  # background paused (keeps its blocks) while interactive work runs
            num_plain = min(request.num_tokens - request.num_computed_tokens, cap)
            chosen.append((request, num_plain, cap))
            budget -= num_plain
            self.priorities.spend(request, num_plain)
        return chosen, budget

    def _plan_drafts(self, chosen: list[tuple[Request, int, int]], budget: int) -> int:
        """Drafts for the chosen requests that decode (one pending token); returns the
        lookahead tokens they take from ``budget``. Without speculation, drafts set by the
        caller (tests) are only trimmed to what fits."""
        decoding: list[Request] = []
        rooms: list[int] = []
        left = budget
        for request, num_plain, cap in chosen:
            room = self._draft_room(request, min(cap - num_plain, left))
            if self.speculation is None:
                del request.spec_token_ids[room:]
                if request.spec_tree is not None:
                    request.spec_tree = request.spec_tree.prune(room)
                left -= len(request.spec_token_ids)
            elif num_plain == 1 and request.num_computed_tokens == request.num_tokens - 1:
                decoding.append(request)
                rooms.append(room)
        if decoding and self.speculation is not None:
            # the step's tokens without drafts: the chosen requests' and, roughly, the
            # prompts of the waiting requests admitted after them
            free_seqs = max(self.max_num_seqs - len(self.running), 0)
            num_plain = sum(n for _, n, _ in chosen) + min(
                budget, sum(r.num_tokens for r in self.waiting[:free_seqs]))
            self.speculation.plan(decoding, rooms, num_plain, budget)
        used = 0
        for request, _, _ in chosen:
            used += request.num_lookahead_tokens
            self.priorities.spend(request, request.num_lookahead_tokens)
        assert used <= max(budget, 0), (used, budget)
        return used

    def _draft_room(self, request: Request, budget: int) -> int:
        """Most drafts ``request`` may verify this step: within the token budget, the context
        limit and the tokens it may still emit (one of them comes from the target)."""
        return max(min(budget,
                       self.max_model_len - request.num_tokens - 1,
                       request.sampling_params.max_tokens - request.num_output_tokens - 1), 0)

    def _admit_waiting(self, budget: int, steps: list[tuple[Request, int]],
                       preempted: list[str]) -> int:
        """Admit waiting requests in order while budget, slots and blocks last; preempt less
        urgent running requests to make room (interactive never waits behind background)."""
        kv_pressure = bool(preempted)  # running work already needed preemption this step
        while self.waiting and budget > 0:
            request = self.waiting[0]
            cap = self.priorities.cap(request, budget)
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
                steps.append((request, num_new))
                budget -= num_new
                self.priorities.spend(request, num_new)
                continue
            victim = self._less_urgent_victim(request)
            if victim is None:
                break  # wait for blocks, slots or budget to be freed
            budget += self._unschedule(victim, steps)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            self.waiting.sort(key=self.priorities.key)
            kv_pressure = False
        return budget

    def _admit(self, request: Request, budget: int) -> bool:
        """Allocate the waiting head's first chunk, starting after its cached prefix."""
        assert request.num_computed_tokens == 0  # fresh, or preempted (recompute)
        cached = self.kv.find_cached_prefix(
            request.request_id, request.token_ids_slice(0, request.num_tokens),
            request.cache_salt)
        num_cached = len(cached) * self.kv.block_size
        assert num_cached <= request.num_tokens - 1  # a hit leaves the last token to compute
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
        key = self.priorities.key(request)[0]
        for victim in reversed(self.running):
            if self.priorities.key(victim)[0] > key:
                return victim
        return None

    @staticmethod
    def _unschedule(victim: Request, steps: list[tuple[Request, int]]) -> int:
        """Drop ``victim`` from this step if it was scheduled; returns its tokens."""
        for j, (request, num_new) in enumerate(steps):
            if request is victim:
                del steps[j]
                return num_new
        return 0

    def _allocate_or_preempt(self, request: Request, num_plain: int,
                             preempted: list[str]) -> bool:
        """One allocation for ``num_plain`` tokens plus the request's lookahead (draft)
        slots. When the pool is short, the drafts go first, then the least urgent requests
        are preempted (possibly ``request`` itself: False)."""
        rid = request.request_id
        while not self.kv.allocate_slots(
                rid, request.num_computed_tokens + num_plain + request.num_lookahead_tokens):
            if request.num_lookahead_tokens:
                self._drop_drafts(request)
                continue
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _drop_drafts(self, request: Request) -> None:
        request.clear_drafts()
        if self.speculation is not None:
            self.speculation.cancel(request)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.clear_drafts()
        if self.speculation is not None:
            self.speculation.on_preempt(request)
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
            draft_tree=(request.spec_tree.prune(num_drafts)
                        if request.spec_tree is not None and num_drafts else None),
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
        logprobs: list[list[float]] | None, num_accepted: list[int] | None = None,
    ) -> list[RequestUpdate]:
        """Advance progress, append verified tokens, finish requests that hit a stop condition.

        ``sampled[i]`` holds the tokens accepted for ``output.requests[i]``: empty for a
        non-final prefill chunk, else the accepted drafts followed by one sampled token;
        ``num_accepted[i]`` the accepted drafts (default ``len(sampled[i]) - 1``). For a tree,
        the runner has already moved the accepted path's K/V to the slots right after the
        verified tokens, so progress rolls back past the rejected drafts alike.
        """
        updates: list[RequestUpdate] = []
        for i, sched in enumerate(output.requests):
            request = self.requests.get(sched.request_id)
            if request is None:  # finished while the step ran
                continue
            tokens = sampled[i]
            accepted = (num_accepted[i] if num_accepted is not None
                        else max(len(tokens) - 1, 0))
            assert not tokens or len(tokens) == accepted + 1, (tokens, accepted)
            num_rejected = sched.num_draft_tokens - accepted if tokens else 0
            # Rejected drafts' K/V is discarded: progress rolls back past them.
            request.num_computed_tokens = sched.start_pos + sched.num_tokens - num_rejected
            request.clear_drafts()
            if self.speculation is not None and tokens:
                self.speculation.record(request, sched.num_draft_tokens, accepted)
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

    def check_invariants(self) -> None:
        """Between steps (tests run it after every step): every request is in exactly one
        queue with a status to match; a running request's block table covers its computed
        tokens and no more blocks than its tokens need; nothing is computed past the verified
        tokens and no drafts are left over; the KV pool's own invariants hold."""
        assert len(self.requests) == len(self.waiting) + len(self.running)
        bs = self.kv.block_size
        for request in self.waiting:
            assert request.status == RequestStatus.WAITING, request.request_id
            assert request.num_computed_tokens == 0, request.request_id
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request.request_id
            assert self.requests[request.request_id] is request
            blocks = len(self.kv.block_table(request.request_id))
            assert request.num_computed_tokens <= blocks * bs, request.request_id
            # only verified tokens are cached (drafts were rolled back before caching)
            assert self.kv.num_hashed_tokens(request.request_id) \
                <= request.num_computed_tokens, request.request_id
            assert blocks <= -(-request.num_tokens // bs) + 1, (request.request_id, blocks)
        for request in self.requests.values():
            assert request.num_computed_tokens <= request.num_tokens, request.request_id
            assert not request.spec_token_ids and request.spec_tree is None
            request.spec_state.check_invariants(request.num_computed_tokens)
        self.kv.check_invariants()
