"""The suffix proposer: drafts from the request's own context and from its tenant's earlier
responses, never from another tenant's; inside the engine, greedy output equals output
without speculation and no KV block leaks."""

from __future__ import annotations

import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import suffix_tree
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from tests.spec.test_spec_engine import GREEDY, PROMPTS, make_engine, run_staggered

pytestmark = pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]


def _request(rid: str, prompt: list[int], output: list[int], salt: str | None) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64), frozenset(), cache_salt=salt)
    r.output_token_ids = list(output)
    return r


def _learn(proposer: SuffixProposer, salt: str | None) -> None:
    proposer.finish(_request("earlier", [1, 2, 3], ANSWER, salt))


def test_earlier_responses_are_drafted_for_the_same_tenant_only() -> None:
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=2.0, min_match_len=1))
    _learn(proposer, "tenant-a")
    # a new request, same tenant, that has started to re-emit the earlier answer
    same = _request("same", [7, 8], ANSWER[:4], "tenant-a")
    draft = proposer.propose(same, k=6)
    assert draft.tokens == ANSWER[4:10] and draft.match_len == 4
    # the same context under another tenant, or no tenant: nothing from tenant-a's answer
    for salt in ("tenant-b", None):
        other = _request(f"other-{salt}", [7, 8], ANSWER[:4], salt)
        assert proposer.propose(other, k=6).tokens == []
    assert proposer.stats() == {"requests": 3, "partitions": 1, "responses": 1,
                                "tokens": len(ANSWER)}


def test_a_seeded_sampled_request_drafts_from_its_own_context_only() -> None:
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=2.0, min_match_len=1))
    _learn(proposer, "t")
    seeded = _request("s", [7, 8], ANSWER[:4], "t")
    seeded.sampling_params = SamplingParams(max_tokens=64, temperature=0.8, seed=3)
    assert proposer.propose(seeded, k=6).tokens == []
    unseeded = _request("u", [7, 8], ANSWER[:4], "t")
    unseeded.sampling_params = SamplingParams(max_tokens=64, temperature=0.8)
    assert proposer.propose(unseeded, k=6).tokens == ANSWER[4:10]


def test_the_request_drafts_from_its_own_context() -> None:
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=1.0, min_token_prob=0.1))
    # the prompt holds a passage the output starts to repeat
    r = _request("r", [9, 20, 21, 22, 23, 24, 25, 9], [20, 21, 22], None)
    assert proposer.propose(r, k=3).tokens == [23, 24, 25]
    r.output_token_ids += [23, 24]  # the trie follows the request as it grows
    assert proposer.propose(r, k=2).tokens == [25, 9]
    proposer.forget("r")
    assert proposer.stats()["requests"] == 0


def test_partitions_are_bounded_lru() -> None:
    config = SuffixConfig(max_partition_tokens=6, max_partitions=2, max_spec_factor=2.0,
                          min_match_len=1)
    proposer = SuffixProposer(config)
    for i in range(3):  # three 3-token outputs: the oldest goes (6-token budget)
        proposer.finish(_request(f"a{i}", [1], [100 + i, 200 + i, 300 + i], "a"))
    assert proposer.stats() == {"requests": 0, "partitions": 1, "responses": 2, "tokens": 6}
    assert proposer.propose(_request("x", [1], [100], "a"), 2).tokens == []
    assert proposer.propose(_request("y", [1], [102], "a"), 2).tokens == [202, 302]
    proposer.finish(_request("b", [1], [5, 6, 7], "b"))
    proposer.finish(_request("c", [1], [5, 6, 7], "c"))  # a third tenant: "a" (LRU) goes
    assert proposer.stats()["partitions"] == 2
    assert proposer.propose(_request("z", [1], [102], "a"), 2).tokens == []
    # the token budget over all partitions drops least recently used tenants too
    proposer = SuffixProposer(SuffixConfig(max_total_tokens=7))
    for salt in ("a", "b", "c"):
        proposer.finish(_request(salt, [1], [1, 2, 3], salt))
    assert proposer.stats() == {"requests": 0, "partitions": 2, "responses": 2, "tokens": 6}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir, "off"), make_engine(tiny_model_dir, "suffix")


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_batch1_equal_with_and_without_suffix(engines, index):
    plain, spec = engines
    want = plain.generate([PROMPTS[index]], GREEDY)[0].token_ids
    free = spec.kv.num_free_blocks
    assert spec.generate([PROMPTS[index]], GREEDY)[0].token_ids == want
    assert spec.kv.num_free_blocks == free


def test_greedy_staggered_batch_of_8_equal_and_answers_learnt(engines):
    plain, spec = engines
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    free = spec.kv.num_free_blocks
    first, usage1 = run_staggered(spec, PROMPTS, GREEDY)
    second, usage2 = run_staggered(spec, PROMPTS, GREEDY)  # again, with the answers learnt
    assert first == want and second == want
    assert spec.kv.num_free_blocks == free
    accepted1 = sum(u.num_accepted_tokens for u in usage1.values())
    accepted2 = sum(u.num_accepted_tokens for u in usage2.values())
    assert accepted2 >= accepted1 > 0
    suffix = spec.speculator.suffix
    assert suffix is not None
    stats = suffix.stats()
    assert stats["requests"] == 0  # every request's trie dropped at its end
    assert stats["responses"] >= 2 * len(PROMPTS)  # both runs' answers learnt


def test_a_paused_background_request_is_not_drafted_for(tiny_model_dir):
    """Drafts go only to requests the step scheduled: background work paused behind an
    interactive request gets none (they would go stale unverified)."""
    engine = make_engine(tiny_model_dir, "suffix", max_background_tokens_with_interactive=0)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("bg", PROMPTS[2], params, priority=10)
    for _ in range(3):
        engine.step()  # the background request alone: prefilled and decoding
    bg = engine.scheduler.requests["bg"]
    engine.add_request("ia", PROMPTS[0], params)
    paused = 0
    while "ia" in engine.scheduler.requests:
        before = bg.num_computed_tokens
        engine.step()
        if bg.num_computed_tokens == before:  # not scheduled this step: no drafts for it
            assert bg.spec_token_ids == []
            paused += 1
    assert paused > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert bg.num_output_tokens == 30
