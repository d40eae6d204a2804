"""Prefix cache over the paged KV: exact block ids in a tiny pool.

Sharing and reference counts, LRU eviction order, hash chaining and salts, the len - 1 cap,
rejected drafts never cached, nothing leaked after abort."""

from __future__ import annotations

from quickdraft.engine.kv_cache import KVCacheManager, hash_block
from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.scheduler import Scheduler

BS = 4


def fill(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None,
         ) -> list[int]:
    """Admit ``tokens`` like the scheduler does, compute them all, register full blocks."""
    hits = kv.find_cached_prefix(rid, tokens, salt)
    assert kv.allocate_slots(rid, len(tokens), hits)
    kv.cache_verified(rid, len(tokens), lambda a, b: tokens[a:b], salt)
    return hits


def test_chained_hash_names_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4], None)
    assert hash_block(a, [5, 6, 7, 8], None) != hash_block(hash_block(None, [0, 2, 3, 4], None),
                                                           [5, 6, 7, 8], None)
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != a  # the salt separates namespaces
    assert hash_block(None, [1, 2, 3, 4], None) == a


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(8, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert fill(kv, "a", prompt) == []
    assert kv.block_table("a") == [0, 1, 2]
    hits = fill(kv, "b", [*prompt[:8], 99, 98, 97])
    assert hits == [0, 1] and kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free("a")
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_hit_is_capped_at_len_minus_one():
    kv = KVCacheManager(8, BS)
    prompt = list(range(8))  # exactly 2 full blocks
    fill(kv, "a", prompt)
    kv.free("a")
    # Everything is cached, but the last token must be computed: only block 0 is a hit.
    assert kv.find_cached_prefix("b", prompt) == [0]
    assert kv.find_cached_prefix("c", [*prompt, 8]) == [0, 1]


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    kv = KVCacheManager(6, BS)
    fill(kv, "a", list(range(12)))  # blocks 0, 1, 2 (all full, hashed)
    kv.free("a")  # freed tail first: the free list ends ... 2, 1, 0
    assert list(kv.pool._free) == [3, 4, 5, 2, 1, 0]
    assert kv.pool.num_cached == 3
    assert kv.allocate_slots("x", 4 * BS)  # takes 3, 4, 5 and then block 2: evicted
    assert kv.block_table("x") == [3, 4, 5, 2]
    assert kv.find_cached_prefix("b", [*list(range(12)), 0]) == [0, 1]  # 2 is gone


def test_a_hit_on_a_free_block_takes_it_off_the_free_list():
    kv = KVCacheManager(4, BS)
    fill(kv, "a", list(range(9)))  # blocks 0, 1 full; 2 partial
    kv.free("a")
    hits = kv.find_cached_prefix("b", list(range(9)))
    assert hits == [0, 1]
    assert not kv.allocate_slots("b", 5 * BS, hits)  # 2 reused + 3 new > 4 blocks
    assert kv.block_table("b") == [] and kv.num_free_blocks == 4  # no change on failure
    assert kv.allocate_slots("b", 9, hits)
    assert kv.block_table("b")[:2] == [0, 1] and kv.num_free_blocks == 1


def test_only_verified_tokens_are_cached():
    """Drafts occupy slots past the verified end; a rollback frees them unhashed."""
    kv = KVCacheManager(8, BS)
    tokens = list(range(6))
    fill(kv, "a", tokens)  # block 0 full and hashed, block 1 partial
    assert kv.allocate_slots("a", 6 + 5)  # 4 drafts + 1: positions up to 10, blocks 1, 2
    drafts = [50, 51, 52, 53]
    verified = 7  # one draft accepted
    kv.truncate("a", verified)
    kv.cache_verified("a", verified, lambda a, b: (tokens + drafts)[a:b])
    assert kv.pool.num_cached == 1  # block 1 holds 3 verified tokens: not full, not cached
    kv.cache_verified("a", 8, lambda a, b: ([*tokens, 50, 60])[a:b])  # later: 8 verified
    assert kv.pool.num_cached == 2
    assert kv.find_cached_prefix("b", [*tokens, 50, 60, 0]) == [0, 1]
    assert kv.find_cached_prefix("c", [*tokens, 50, 51, 0]) == [0]  # the rejected path


def scheduler(num_blocks: int = 16) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256), kv


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), frozenset())


def test_scheduler_starts_after_the_hit_and_counts_it():
    s, kv = scheduler()
    s.add_request(request("a", list(range(10))))
    out = s.schedule()
    s.update_from_output(out, [[7]], None)
    s.add_request(request("b", list(range(10))))
    out = s.schedule()
    b = out.requests[-1]
    assert (b.request_id, b.start_pos, b.num_tokens) == ("b", 8, 2)
    assert s.requests["b"].num_cached_tokens == 8
    stats = kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_abort_while_waiting_or_running_leaks_nothing():
    s, kv = scheduler(num_blocks=8)
    s.add_request(request("a", list(range(20))))
    s.update_from_output(s.schedule(), [[1]], None)
    s.add_request(request("b", list(range(20))))
    s.add_request(request("c", list(range(30))))  # does not fit next to a and b
    s.schedule()
    s.finish_requests(["a", "b", "c"], s.requests["a"].status.FINISHED_ABORTED)
    assert kv.num_free_blocks == 8 and kv.pool.num_cached == 5
