"""Priority classes in the scheduler: (priority, arrival) order, interactive work preempts
background work for slots, blocks and budget, aging keeps background from starving."""

from __future__ import annotations

import time

from quickdraft.engine.kv_cache import KVCacheManager
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler import Scheduler

INTERACTIVE, BACKGROUND = 0, 10


def make(rid: str, n_prompt: int, priority: int, arrival: float, max_tokens: int = 50,
         ) -> Request:
    return Request(rid, [rid.__hash__() % 50 + 1, *list(range(100, 100 + n_prompt - 1))],
                   SamplingParams(max_tokens=max_tokens, temperature=0), frozenset({0}),
                   arrival_time=arrival, priority=priority)


def sched(num_blocks=16, block_size=4, max_seqs=4, budget=32, aging=None, bg_tokens=8):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(kv, max_seqs, budget, 1000, priority_aging_s=aging,
                     max_background_tokens_with_interactive=bg_tokens), kv


def step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, [[7] if r.sample else [] for r in out.requests], None)
    s.check_invariants()
    return out


def test_waiting_queue_runs_by_priority_then_arrival():
    s, _ = sched(max_seqs=1)
    s.add_request(make("bg-old", 4, BACKGROUND, arrival=1.0))
    s.add_request(make("ia-new", 4, INTERACTIVE, arrival=3.0))
    s.add_request(make("ia-old", 4, INTERACTIVE, arrival=2.0))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["ia-old"]
    assert [r.request_id for r in s.waiting] == ["ia-new", "bg-old"]


def test_interactive_preempts_background_for_a_sequence_slot():
    s, _ = sched(max_seqs=2)
    for i in range(2):
        s.add_request(make(f"bg{i}", 4, BACKGROUND, arrival=float(i)))
    step(s)
    s.add_request(make("ia", 4, INTERACTIVE, arrival=5.0))
    out = step(s)
    assert out.preempted_ids == ["bg1"]  # the least urgent, newest
    assert {r.request_id for r in out.requests} == {"bg0", "ia"}
    assert s.requests["bg1"].status == RequestStatus.WAITING
    assert s.requests["bg1"].num_preemptions == 1


def test_interactive_preempts_background_for_blocks_but_never_the_reverse():
    s, _kv = sched(num_blocks=6, max_seqs=4)
    s.add_request(make("bg", 20, BACKGROUND, arrival=0.0))  # 5 blocks of 6 (+1 to grow)
    step(s)
    s.add_request(make("ia", 12, INTERACTIVE, arrival=1.0))  # needs 3 blocks
    out = step(s)
    assert out.preempted_ids == ["bg"] and [r.request_id for r in out.requests] == ["ia"]
    # Now background never pushes interactive out; it may resume only in its small share.
    for _ in range(3):
        out = step(s)
        assert "ia" not in out.preempted_ids and "ia" in [r.request_id for r in out.requests]
        assert all(r.num_tokens <= 8 for r in out.requests if r.request_id == "bg")
    assert s.requests["ia"].status == RequestStatus.RUNNING


def test_background_prefill_yields_budget_to_waiting_interactive():
    s, _ = sched(num_blocks=64, budget=16)
    s.add_request(make("bg", 64, BACKGROUND, arrival=0.0))
    step(s)  # 16 of 64 prompt tokens
    s.add_request(make("ia", 10, INTERACTIVE, arrival=1.0))
    out = step(s)
    assert [(r.request_id, r.num_tokens) for r in out.requests] == [("ia", 10)]
    out = step(s)  # interactive decodes (1 token), background prefill resumes, 8 a step
    assert [(r.request_id, r.num_tokens) for r in out.requests] == [("ia", 1), ("bg", 8)]


def test_aging_lets_old_background_work_ahead():
    now = time.monotonic()
    s, _ = sched(max_seqs=1, aging=5.0)
    s.add_request(make("bg", 4, BACKGROUND, arrival=now - 60.0))  # 12 levels: ahead of 0
    s.add_request(make("ia", 4, INTERACTIVE, arrival=now))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["bg"]


def test_background_shares_only_a_few_tokens_of_interactive_steps():
    s, _ = sched(num_blocks=64, max_seqs=8, budget=64)
    s.priorities.background_tokens_with_interactive = 2
    for i in range(5):
        s.add_request(make(f"bg{i}", 4, BACKGROUND, arrival=float(i)))
    step(s)
    assert len(step(s).requests) == 5  # alone, the batch job uses every slot
    s.add_request(make("ia", 4, INTERACTIVE, arrival=9.0))
    step(s)
    ids = [r.request_id for r in step(s).requests]
    assert ids == ["ia", "bg0", "bg1"]  # the oldest background requests keep progressing
    assert len(s.running) == 6  # the others are paused, not preempted
    s.add_request(make("bg-new", 30, BACKGROUND, arrival=10.0))
    out = step(s)
    assert all(r.request_id != "bg-new" for r in out.requests)  # no big prefill meanwhile


def test_by_default_background_pauses_while_interactive_runs():
    s, _ = sched(num_blocks=64, max_seqs=8, budget=64, bg_tokens=0)
    s.add_request(make("bg", 8, BACKGROUND, arrival=0.0))
    step(s)
    s.add_request(make("ia", 4, INTERACTIVE, arrival=1.0))
    assert [r.request_id for r in step(s).requests] == ["ia"]
    assert [r.request_id for r in step(s).requests] == ["ia"]
    assert s.requests["bg"].status == RequestStatus.RUNNING  # paused, blocks kept


def test_background_steps_stay_short_without_interactive_work():
    s, _ = sched(num_blocks=64, max_seqs=8, budget=64)
    s.priorities.background_tokens_per_step = 12
    s.add_request(make("bg", 40, BACKGROUND, arrival=0.0))
    assert [r.num_tokens for r in step(s).requests] == [12]
    s.add_request(make("ia", 40, INTERACTIVE, arrival=1.0))
    assert [(r.request_id, r.num_tokens) for r in step(s).requests] == [("ia", 40)]
