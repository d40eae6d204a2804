"""Draft-model speculation inside the engine (tiny random models sharing SmolLM2's vocabulary).

A good draft (the target drafting for itself) and a bad one (another random model) must both
leave greedy fp32 output unchanged, token for token, alone and in a staggered batch of 8, and
leave no blocks behind. The draft's own cache must survive rejections: after a corrupted draft
is rejected, the next drafts of a self-draft are accepted again.
"""

from __future__ import annotations

import pytest

from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.engine.llm_engine import InvalidRequestError, LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.draft_model import DraftModelError, DraftOutput
from quickdraft.spec.params import SpeculationParams
from tests.conftest import make_tiny_model
from tests.spec.test_spec_engine import GREEDY, PROMPTS, run_staggered


def make_engine(model_dir, speculation: str, draft_dir=None, **kw) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=kw.pop("dtype", "float32"),
                          speculation=speculation,
                          draft_model=str(draft_dir) if draft_dir else None,
                          measure_step_cost=False, num_kv_blocks=256, block_size=4, **kw)
    return LLMEngine(config, progress=False)


@pytest.fixture(scope="module")
def bad_draft_dir(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), default_model_dir, seed=1,
                           num_layers=1, hidden=32)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(tiny_model_dir, "off")


@pytest.fixture(scope="module", params=["good-draft", "bad-draft"])
def draft_dir(request, tiny_model_dir, bad_draft_dir):
    return tiny_model_dir if request.param == "good-draft" else bad_draft_dir


@pytest.fixture(scope="module", params=["draft", "combined"])
def spec_engine(request, tiny_model_dir, draft_dir):
    return make_engine(tiny_model_dir, request.param, draft_dir)


def test_greedy_batch1_equal_for_every_prompt(plain, spec_engine):
    free = spec_engine.kv.num_free_blocks
    drafted = 0
    for prompt in PROMPTS:
        want = plain.generate([prompt], GREEDY)[0].token_ids
        got = spec_engine.generate([prompt], GREEDY)[0]
        assert got.token_ids == want, prompt
        drafted += got.usage.num_drafted_tokens
    assert drafted > 0
    assert spec_engine.kv.num_free_blocks == free


def test_greedy_staggered_batch_of_8_equal(plain, spec_engine):
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    free = spec_engine.kv.num_free_blocks
    got, usage = run_staggered(spec_engine, PROMPTS, GREEDY)
    assert got == want
    assert spec_engine.kv.num_free_blocks == free
    assert sum(u.num_drafted_tokens for u in usage.values()) > 0


def test_self_draft_accepts_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, "draft", tiny_model_dir)
    outs = engine.generate(PROMPTS[:4], GREEDY)
    for out in outs:
        assert out.usage.num_accepted_tokens == out.usage.num_drafted_tokens > 0


def test_draft_cache_stays_consistent_after_rejections(tiny_model_dir):
    """Corrupt the last draft of every other call: exactly those drafts are rejected, and
    every later draft is accepted again, so the draft's K/V was rolled back correctly."""
    engine = make_engine(tiny_model_dir, "draft", tiny_model_dir)
    assert engine.draft is not None
    original = engine.draft.propose
    corrupted = 0
    calls = 0

    def corrupting(inputs):
        nonlocal corrupted, calls
        outs = original(inputs)
        calls += 1
        if calls % 2:
            return outs
        fixed = []
        for out in outs:
            bad = list(out.token_ids)
            bad[-1] = (bad[-1] + 1) % engine.runner.vocab_size
            corrupted += 1
            fixed.append(DraftOutput(bad, out.probs))
        return fixed

    engine.draft.propose = corrupting  # type: ignore[method-assign]
    outs = engine.generate(PROMPTS[:3], GREEDY)
    want = make_engine(tiny_model_dir, "off").generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    drafted = sum(o.usage.num_drafted_tokens for o in outs)
    accepted = sum(o.usage.num_accepted_tokens for o in outs)
    assert corrupted > 0
    # A corrupted draft may also have been trimmed away by the length limit at the very end.
    assert drafted - corrupted <= accepted <= drafted - corrupted + 3


def test_seeded_sampling_with_a_draft_is_reproducible(tiny_model_dir, bad_draft_dir):
    engine = make_engine(tiny_model_dir, "draft", bad_draft_dir)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11,
                            ignore_eos=True)
    a = engine.generate([PROMPTS[0]], params)[0]
    b = engine.generate([PROMPTS[0]], params)[0]
    assert a.token_ids == b.token_ids and a.usage.num_drafted_tokens > 0


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir, default_model_dir):
    other = make_tiny_model(tmp_path / "other-vocab", default_model_dir, vocab=1000)
    with pytest.raises(DraftModelError, match="vocabulary"):
        make_engine(tiny_model_dir, "draft", other)


def test_draft_methods_need_a_draft_model(tiny_model_dir, plain):
    with pytest.raises(ConfigError, match="draft_model"):
        EngineConfig(model=str(tiny_model_dir), speculation="draft")
    with pytest.raises(InvalidRequestError) as info:
        plain.add_request("x", "hi", GREEDY, speculation=SpeculationParams(method="draft"))
    assert info.value.param == "speculation.method"


def test_per_request_method_switch(tiny_model_dir):
    """One engine, three requests: draft, n-gram and off side by side, all equal to plain."""
    engine = make_engine(tiny_model_dir, "combined", tiny_model_dir)
    methods = {"d": "draft", "n": "ngram", "o": "off"}
    for rid, method in methods.items():
        engine.add_request(rid, PROMPTS[0], GREEDY, speculation=SpeculationParams(method))
    tokens: dict[str, list[int]] = {rid: [] for rid in methods}
    usage = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                usage[out.request_id] = out.usage
    want = make_engine(tiny_model_dir, "off").generate([PROMPTS[0]], GREEDY)[0].token_ids
    assert all(t == want for t in tokens.values())
    assert usage["o"].num_drafted_tokens == 0
    assert usage["d"].num_drafted_tokens > 0 and usage["n"].num_drafted_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_draft_sampling_draws_from_the_distribution_it_reports():
    """The premise of lossless verification: each sampled draft x is drawn from the q handed
    to the rejection sampler (temperature + top-k applied as for the target)."""
    import torch
    from scipy.stats import chisquare

    from quickdraft.spec.draft_model import DraftInput, DraftModelRunner

    runner = DraftModelRunner(None, 4, None, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                           [0.0, 3.0, 1.0, 0.0, 0.0, 0.0]])  # [2, V]
    sampled = SamplingParams(temperature=0.8, top_k=4)

    def inputs(seed: int) -> list[DraftInput]:
        return [DraftInput([1], 0, 1, (0,), sampled, torch.Generator().manual_seed(seed)),
                DraftInput([1], 0, 1, (0,), GREEDY, None)]

    counts = torch.zeros(6)
    for seed in range(4000):
        tokens, q = runner._sample(logits, inputs(seed))
        assert q is not None and tokens[1] == 1  # greedy row: argmax
        counts[tokens[0]] += 1
    expected = torch.softmax(torch.where(logits[0] >= 0.0, logits[0] / 0.8, -torch.inf), -1)
    assert torch.allclose(q[0], expected)
    assert counts[4:].sum() == 0  # filtered out by top-k
    assert chisquare(counts[:4], expected[:4] * 4000).pvalue > 1e-3


@pytest.mark.slow
def test_real_model_drafting_for_itself_changes_nothing(default_model_dir):
    """The default model (fp32) as its own draft, draft and combined: greedy output equals
    plain decoding for real chat prompts, alone and batched, and nearly every draft passes."""
    from tests.spec.test_spec_engine import REAL_PROMPTS

    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = make_engine(default_model_dir, "off", max_num_batched_tokens=128)
    chat = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    want = [o.token_ids for o in plain.generate(chat, params)]
    for method in ("draft", "combined"):
        spec = make_engine(default_model_dir, method, default_model_dir,
                           max_num_batched_tokens=128)
        assert [spec.generate([ids], params)[0].token_ids for ids in chat] == want
        outs = spec.generate(chat, params)
        assert [o.token_ids for o in outs] == want
        drafted = sum(o.usage.num_drafted_tokens for o in outs)
        accepted = sum(o.usage.num_accepted_tokens for o in outs)
        assert drafted > 0
        if method == "draft":  # n-gram drafts (combined) are rejected more often
            assert accepted >= 0.9 * drafted
        assert spec.kv.num_free_blocks == spec.kv.pool.num_blocks
