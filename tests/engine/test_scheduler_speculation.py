"""Speculation decided by the scheduler: who gets drafts, against which batch, with their
slots reserved in the request's one allocation; preemption and the end of a request reach
the speculation hooks; the invariants hold after every step. A recording fake stands in for
:class:`spec.speculator.Speculator` (the real one is exercised by the engine tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler import Scheduler

INTERACTIVE, BACKGROUND = 0, 10


@dataclass
class FakeSpeculation:
    """Drafts ``k`` copies of token 5 (``by_model``: owed by a "draft model", filled in
    :meth:`draft`) for every request it is asked about; records every call."""

    k: int = 3
    by_model: bool = False
    plans: list[tuple[list[str], list[int], int, int]] = field(default_factory=list)
    drafted: list[list[str]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    records: list[tuple[str, int, int]] = field(default_factory=list)

    def plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
             budget: int) -> None:
        self.plans.append(([r.request_id for r in requests], list(rooms), num_plain_tokens,
                           budget))
        for request, room in zip(requests, rooms, strict=True):
            k = min(self.k, room)
            if self.by_model:
                request.spec_state.model_k = k
            else:
                request.spec_token_ids = [5] * k

    def draft(self, requests: list[Request]) -> None:
        self.drafted.append([r.request_id for r in requests])
        for request in requests:
            request.spec_token_ids = [5] * request.spec_state.model_k
            request.spec_state.model_k = 0

    def cancel(self, request: Request) -> None:
        request.spec_state.model_k = 0
        self.events.append(("cancel", request.request_id))

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.records.append((request.request_id, num_drafted, num_accepted))

    def on_preempt(self, request: Request) -> None:
        request.spec_state.on_preempt()
        self.events.append(("preempt", request.request_id))

    def on_finish(self, request: Request, status: RequestStatus) -> None:
        self.events.append(("finish", request.request_id))


def make(rid: str, n_prompt: int, priority: int = INTERACTIVE, arrival: float = 0.0,
         max_tokens: int = 50) -> Request:
    return Request(rid, [1 + len(rid), *range(100, 100 + n_prompt - 1)],
                   SamplingParams(max_tokens=max_tokens, temperature=0), frozenset({0}),
                   arrival_time=arrival, priority=priority)


def setup(spec: FakeSpeculation, num_blocks: int = 32, budget: int = 64,
          bg_tokens: int = 0) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    return Scheduler(kv, 4, budget, 1000, priority_aging_s=None,
                     max_background_tokens_with_interactive=bg_tokens,
                     speculation=spec), kv


def step(s: Scheduler, accept: int = 0):
    """One step where every request with drafts gets ``accept`` of them accepted."""
    out = s.schedule()
    sampled = [[5] * min(accept, r.num_draft_tokens) + [7] if r.sample else []
               for r in out.requests]
    accepted = [len(t) - 1 if t else 0 for t in sampled]
    s.update_from_output(out, sampled, None, accepted)
    s.check_invariants()
    return out


def test_drafts_only_for_scheduled_decoding_requests_against_the_real_batch():
    spec = FakeSpeculation()
    s, _ = setup(spec)
    s.add_request(make("a", 6))
    step(s)  # prefill: nothing to draft for
    assert spec.plans == []
    s.add_request(make("b", 20))
    out = step(s)  # a decodes, b prefills in the same step
    [(ids, rooms, num_plain, budget)] = spec.plans
    assert ids == ["a"] and rooms[0] >= 3
    assert num_plain == 1 + 20  # a's pending token + b's prompt: the batch that will run
    assert budget == 64 - 1
    by_id = {r.request_id: r for r in out.requests}
    assert by_id["a"].num_draft_tokens == 3 and by_id["a"].num_tokens == 4
    assert by_id["b"].num_draft_tokens == 0


def test_lookahead_slots_are_reserved_in_one_allocation():
    spec = FakeSpeculation(k=5)
    s, kv = setup(spec)
    s.add_request(make("a", 7))
    step(s)  # 7 prompt tokens + 1 output: 8 tokens, 7 computed
    calls: list[tuple[str, int]] = []
    allocate = kv.allocate_slots

    def spy(rid: str, n: int, *args):
        calls.append((rid, n))
        return allocate(rid, n, *args)

    kv.allocate_slots = spy  # type: ignore[method-assign]
    out = s.schedule()
    assert calls == [("a", 8 + 5)]  # the pending token and 5 draft slots, one call
    assert out.requests[0].num_draft_tokens == 5
    assert len(kv.block_table("a")) * 4 >= 13


def test_draft_model_drafts_after_its_slots_are_reserved():
    spec = FakeSpeculation(k=2, by_model=True)
    s, _ = setup(spec)
    s.add_request(make("a", 7))
    step(s)
    out = step(s, accept=1)
    assert spec.drafted == [["a"]]
    assert out.requests[0].num_draft_tokens == 2
    assert [r for r in spec.records if r[1]] == [("a", 2, 1)]
    assert s.requests["a"].output_token_ids == [7, 5, 7]


def test_a_paused_background_request_is_never_drafted():
    spec = FakeSpeculation()
    s, _ = setup(spec, bg_tokens=0)
    s.add_request(make("bg", 5, BACKGROUND, arrival=0.0))
    step(s)  # bg prefills alone
    step(s)  # ... and decodes (with drafts) while alone
    s.add_request(make("chat", 5, INTERACTIVE, arrival=1.0))
    before = len(spec.plans)
    for _ in range(7):
        out = step(s)
        assert [r.request_id for r in out.requests] == ["chat"]
    asked = [rid for ids, *_ in spec.plans[before:] for rid in ids]
    assert "bg" not in asked and asked.count("chat") == 6  # chat's prefill step: none


def test_pool_short_drops_drafts_before_preempting():
    spec = FakeSpeculation(k=8)
    s, _ = setup(spec, num_blocks=6)
    s.add_request(make("a", 7))
    s.add_request(make("b", 7))
    step(s)  # 2 + 2 blocks; 2 free
    out = step(s)  # each wants 8 + 8 slots: the pool cannot hold both with drafts
    assert s.num_preemptions == 0
    assert ("cancel", "a") in spec.events or ("cancel", "b") in spec.events
    assert {r.request_id for r in out.requests} == {"a", "b"}


def test_preempt_and_finish_reach_the_hooks_and_blocks_return():
    spec = FakeSpeculation(k=2)
    s, kv = setup(spec, num_blocks=5)
    baseline = kv.num_free_blocks
    s.add_request(make("old", 8, arrival=0.0, max_tokens=11))  # 19 tokens: 5 blocks
    s.add_request(make("new", 4, arrival=1.0, max_tokens=8))  # 3 blocks; 5 in the pool
    for _ in range(40):
        if not s.has_unfinished:
            break
        step(s)
    assert not s.has_unfinished
    assert ("finish", "old") in spec.events and ("finish", "new") in spec.events
    assert any(e == "preempt" for e, _ in spec.events)
    assert kv.num_free_blocks == baseline


def test_background_drafts_over_the_share_never_admit_a_negative_chunk():
    """Regression: the drafts granted to several background requests in one step could
    together exceed the background share, and a waiting background request was then admitted
    with a negative chunk (a table of its cached prefix only, a step that failed). Now nothing
    more runs in that step, and every scheduled request's table covers its tokens."""
    spec = FakeSpeculation(k=6)
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    s = Scheduler(kv, 4, 64, 1000, priority_aging_s=None,
                  max_background_tokens_per_step=12, speculation=spec)
    for rid in ("a", "b"):
        s.add_request(make(rid, 5, priority=BACKGROUND))
    step(s)
    step(s)  # both decode now; each gets drafts within the share left when it was chosen
    s.add_request(make("c", 9, priority=BACKGROUND))
    for _ in range(4):
        out = step(s)
        for r in out.requests:
            assert r.num_tokens > 0
            assert len(r.block_table) * 4 >= r.start_pos + r.num_tokens, r.request_id
