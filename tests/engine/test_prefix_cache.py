"""Prefix caching inside the engine (fp32, tiny model): greedy output is identical with the
cache on and off, a shared system prompt and earlier chat turns are reused, and a preempted
request resumes from its cached blocks with the same output."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer briefly and cite the passage. " * 6


def make_engine(model_dir, caching: bool, **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype="float32", speculation="off",
                          measure_step_cost=False, block_size=4,
                          enable_prefix_caching=caching, **{"num_kv_blocks": 256, **kw})
    return LLMEngine(config, progress=False)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir, False), make_engine(tiny_model_dir, True)


def prompts() -> list[str]:
    return [SYSTEM + f"Question {i}: what is {i} plus {i}?" for i in range(6)]


def test_greedy_identical_with_cache_on_and_off(engines):
    plain, cached = engines
    want = [o.token_ids for o in plain.generate(prompts(), GREEDY)]
    assert [o.token_ids for o in cached.generate(prompts(), GREEDY)] == want
    # One by one: each later request hits the system prompt computed by the first.
    before = cached.kv.stats()
    outs = [cached.generate([p], GREEDY)[0] for p in prompts()]
    assert [o.token_ids for o in outs] == want
    assert all(o.usage.num_cached_tokens > len(SYSTEM) // 8 for o in outs)
    after = cached.kv.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == \
        sum(o.usage.num_cached_tokens for o in outs)
    assert cached.kv.num_free_blocks == cached.kv.pool.num_blocks


def test_next_chat_turn_reuses_the_earlier_turns(engines):
    plain, cached = engines
    turn1 = [{"role": "user", "content": SYSTEM + "Tell me about the sea."}]
    ids1 = cached.apply_chat_template(turn1)
    first = cached.generate([ids1], GREEDY)[0]
    turn2 = [*turn1, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "And the mountains?"}]
    ids2 = cached.apply_chat_template(turn2)
    second = cached.generate([ids2], GREEDY)[0]
    assert second.token_ids == plain.generate([ids2], GREEDY)[0].token_ids
    assert second.usage.num_cached_tokens >= (len(ids1) // 4 - 1) * 4


def test_preempted_request_resumes_from_cache_with_same_output(tiny_model_dir):
    """A pool too small for three long requests: preemptions happen, output is unchanged."""
    long_prompts = [SYSTEM + f"Item {i}. " * 5 for i in range(3)]
    want = [o.token_ids for o in
            make_engine(tiny_model_dir, False).generate(long_prompts, GREEDY)]
    small = make_engine(tiny_model_dir, True, num_kv_blocks=70)
    outs = small.generate(long_prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert small.scheduler.num_preemptions > 0
    assert sum(o.usage.num_preemptions for o in outs) == small.scheduler.num_preemptions
    assert small.kv.num_free_blocks == small.kv.pool.num_blocks


def test_salt_separates_tenants(engines):
    _, cached = engines
    prompt = SYSTEM + "Salted question."
    cached.add_request("t1", prompt, GREEDY, cache_salt="tenant-1")
    cached.add_request("t2", prompt, GREEDY, cache_salt="tenant-2")
    usage = {}
    while cached.has_unfinished_requests():
        for out in cached.step():
            if out.finished:
                usage[out.request_id] = out.usage
    assert usage["t1"].num_cached_tokens == 0 and usage["t2"].num_cached_tokens == 0
    cached.add_request("t1-again", prompt, GREEDY, cache_salt="tenant-1")
    while cached.has_unfinished_requests():
        for out in cached.step():
            if out.finished:
                usage[out.request_id] = out.usage
    assert usage["t1-again"].num_cached_tokens > 0  # same tenant: shared
