"""The lookup back-off (spec/state.py): a request whose proposals keep drafting nothing looks
up less often, at most ``MAX_LOOKUP_SKIP`` steps late; a drafted step resets it; output is
unchanged (drafts are optional)."""

from __future__ import annotations

import itertools

from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.state import IDLE_BEFORE_BACKOFF, MAX_LOOKUP_SKIP, lookups_to_skip
from tests.spec.test_spec_engine import PROMPTS, make_engine

GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def test_lookups_to_skip_grows_with_idle_lookups_and_is_capped() -> None:
    assert [lookups_to_skip(i) for i in range(IDLE_BEFORE_BACKOFF)] == \
        [0] * IDLE_BEFORE_BACKOFF
    assert lookups_to_skip(IDLE_BEFORE_BACKOFF) == 1
    assert lookups_to_skip(2 * IDLE_BEFORE_BACKOFF) == 2
    assert lookups_to_skip(100 * IDLE_BEFORE_BACKOFF) == MAX_LOOKUP_SKIP


def expected_lookups(decode_steps: int) -> tuple[int, int]:
    """(lookups, skipped) for a request that never drafts (the rule, step by step)."""
    idle = skip = looked = skipped = 0
    for _ in range(decode_steps):
        if skip:
            skip, skipped = skip - 1, skipped + 1
            continue
        looked, idle = looked + 1, idle + 1
        skip = lookups_to_skip(idle)
    return looked, skipped


def test_a_request_that_never_drafts_backs_off(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, "suffix")
    calls: list[int] = []

    def finds_nothing(request, k, public=True, min_gain=0.0):  # a proposer that never matches
        calls.append(request.num_tokens)
        return None

    engine.speculator._candidate = finds_nothing  # type: ignore[method-assign]
    free = engine.kv.num_free_blocks
    out = engine.generate([PROMPTS[3]], GREEDY)[0]
    assert len(out.token_ids) == 60 and engine.kv.num_free_blocks == free
    stats = engine.speculator.stats
    # decode steps that may draft: tokens 2..59 (the first comes from the prefill, the
    # last step has no room for a draft)
    assert (len(calls), stats.num_skipped_lookups) == expected_lookups(58)
    assert stats.num_skipped_lookups > len(calls)  # most lookups skipped by the end
    gaps = [b - a for a, b in itertools.pairwise(calls)]  # tokens between two lookups
    assert gaps[:IDLE_BEFORE_BACKOFF - 1] == [1] * (IDLE_BEFORE_BACKOFF - 1)
    assert max(gaps) == MAX_LOOKUP_SKIP + 1  # a match is found at most that many steps late


def test_drafting_requests_look_up_every_step_and_output_is_unchanged(tiny_model_dir) -> None:
    off = make_engine(tiny_model_dir, "off")
    spec = make_engine(tiny_model_dir, "suffix")
    for prompt in PROMPTS:
        assert spec.generate([prompt], GREEDY)[0].token_ids == \
            off.generate([prompt], GREEDY)[0].token_ids
    stats = spec.speculator.stats
    # the tiny model repeats itself, so every request drafts before it goes idle for
    # IDLE_BEFORE_BACKOFF lookups: none is ever skipped
    assert stats.num_steps > 0 and stats.num_skipped_lookups == 0


def test_a_drafted_step_resets_the_back_off(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, "suffix")
    real, stats = engine.speculator._candidate, engine.speculator.stats
    seen: list[tuple[int, int]] = []  # per lookup: (idle lookups before it, skipped so far)

    # nothing for 20 lookups, then the real one
    def late_match(request, k, public=True, min_gain=0.0):
        seen.append((request.spec_state.idle_lookups, stats.num_skipped_lookups))
        return real(request, k, public, min_gain) if len(seen) > 20 else None

    engine.speculator._candidate = late_match  # type: ignore[method-assign]
    engine.generate([PROMPTS[2]], GREEDY)  # (repeats itself: the tries match)
    assert [idle for idle, _ in seen[:21]] == list(range(21))
    assert seen[20][1] == expected_lookups(20 + seen[20][1])[1] > 0  # backed off, by the rule
    assert seen[21] == (0, seen[20][1])  # drafted: the next step looks again, nothing skipped
    assert stats.num_steps > 0
