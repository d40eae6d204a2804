"""Scheduler and KV manager behaviour without a model: budgets, chunked prefill, preemption,
rollback of rejected drafts, and block accounting."""

from __future__ import annotations

import pytest

from quickdraft.engine.kv_cache import BlockPool, KVCacheManager
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler import Scheduler


def make(rid: str, n_prompt: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens,
                                                              temperature=0), frozenset({0}))


def sched(num_blocks=16, block_size=4, max_seqs=4, budget=16, max_len=1000):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_seqs, budget, max_len), kv


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = [[token] if r.sample else [] for r in out.requests]
    updates = s.update_from_output(out, sampled, None)
    s.check_invariants()
    return out, updates


def test_chunked_prefill_under_token_budget():
    s, _ = sched(budget=10)
    s.add_request(make("a", 25))
    chunks = []
    for _ in range(3):
        out, _ = run_step(s)
        chunks.append([(r.start_pos, r.num_tokens, r.sample) for r in out.requests])
    assert chunks == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]
    assert s.requests["a"].num_computed_tokens == 25
    assert s.requests["a"].output_token_ids == [7]


def test_decode_and_prefill_share_a_step():
    s, _ = sched(budget=8)
    s.add_request(make("a", 3))
    run_step(s)  # a: prefill done, 1 token out
    s.add_request(make("b", 20))
    out, _ = run_step(s)
    assert [(r.request_id, r.num_tokens) for r in out.requests] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_running():
    s, _ = sched(max_seqs=2, budget=100)
    for rid in "abc":
        s.add_request(make(rid, 2))
    out, _ = run_step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_blocks_freed_on_finish_in_reverse_order():
    s, kv = sched(num_blocks=8, block_size=2)
    s.add_request(make("a", 5, max_tokens=1))
    _, updates = run_step(s)
    assert updates[0].finished and updates[0].request.status == RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == 8
    # freed tail-first: the last block of the table is the first to be reused
    assert list(kv.pool._free)[-3:] == [2, 1, 0]


def test_preemption_when_pool_runs_short_and_resume():
    s, kv = sched(num_blocks=4, block_size=4, budget=64)
    s.add_request(make("a", 7, max_tokens=20))
    s.add_request(make("b", 7, max_tokens=20))
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    run_step(s)  # positions 7 -> 8 still fit in block 2
    out, _ = run_step(s)  # a needs a third block: b (last admitted) is preempted
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and len(b.output_token_ids) == 2


def test_rejected_drafts_roll_back_progress_and_blocks():
    s, kv = sched(num_blocks=16, block_size=2, budget=64)
    s.add_request(make("a", 4, max_tokens=50))
    run_step(s)  # prefill 4, one token out: num_tokens 5, computed 4
    a = s.requests["a"]
    a.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    r = out.requests[0]
    assert (r.start_pos, r.num_tokens, r.num_draft_tokens) == (4, 5, 4)
    assert len(kv.block_table("a")) == 5  # 9 positions
    # verification accepted 1 draft, then produced a recovered token
    s.update_from_output(out, [[1, 9]], None)
    assert a.output_token_ids == [7, 1, 9]
    assert a.num_computed_tokens == 6  # 4 prompt + first output + accepted draft
    assert len(kv.block_table("a")) == 3  # blocks past the new end are freed
    assert a.spec_token_ids == []


def test_abort_frees_blocks_of_waiting_and_running():
    s, kv = sched(budget=4)
    s.add_request(make("a", 10))
    s.add_request(make("b", 3))
    run_step(s)  # a mid-prefill
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 16 and not s.has_unfinished


def test_pool_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


def test_stop_inside_accepted_drafts_discards_the_rest():
    s, kv = sched(num_blocks=16, block_size=2, budget=64)
    s.add_request(make("a", 4, max_tokens=50))  # eos id is 0
    run_step(s)
    a = s.requests["a"]
    a.spec_token_ids = [5, 0, 6]
    out = s.schedule()
    [update] = s.update_from_output(out, [[5, 0, 6, 8]], None)  # all accepted + bonus
    assert update.finished and a.output_token_ids == [7, 5, 0]
    assert a.num_computed_tokens <= a.num_tokens
    assert kv.num_free_blocks == 16
