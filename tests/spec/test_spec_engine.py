"""Speculation inside the engine: greedy output with n-gram drafts equals output without them,
token for token (fp32), alone and in a staggered batch of 8; rejected drafts leave no blocks
behind; statistics add up."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.params import SpeculationParams

PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2,
    "one two three four five six seven eight nine ten " * 4,
    "Hello",
    "A B C D E F G A B C D E F G A B C",
    "The cat sat on the mat. The dog sat on the log. The cat",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,",
    "short prompt with no repeats at all",
]


def make_engine(model_dir, speculation: str, dtype_override: str = "float32", **kw
                ) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=dtype_override, speculation=speculation,
                          measure_step_cost=False, num_kv_blocks=256, block_size=4, **kw)
    return LLMEngine(config, progress=False)


def run_staggered(engine: LLMEngine, prompts: list[str], params: SamplingParams):
    tokens: dict[str, list[int]] = {}
    usage = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                usage[out.request_id] = out.usage
        step += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))], usage


def assert_lossless(plain: LLMEngine, spec: LLMEngine, prompts: list[str],
                    params: SamplingParams, source: str) -> dict:
    """``spec``'s output in a staggered batch equals ``plain``'s token for token, every KV
    block it took comes back, and drafts from ``source`` were verified; its usage."""
    want, _ = run_staggered(plain, prompts, params)
    free = spec.kv.num_free_blocks
    got, usage = run_staggered(spec, prompts, params)
    assert got == want
    assert spec.kv.num_free_blocks == free
    assert spec.speculator.stats.by_source.get(source, [0])[0] > 0
    return usage


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engine(tiny_model_dir, "off"), make_engine(tiny_model_dir, "ngram")


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_batch1_equal_with_and_without_ngram(engines, index):
    plain, spec = engines
    want = plain.generate([PROMPTS[index]], GREEDY)[0].token_ids
    free = spec.kv.num_free_blocks
    got = spec.generate([PROMPTS[index]], GREEDY)[0]
    assert got.token_ids == want
    assert spec.kv.num_free_blocks == free


def test_greedy_staggered_batch_of_8_equal_and_speculation_used(engines):
    plain, spec = engines
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    free = spec.kv.num_free_blocks
    got, usage = run_staggered(spec, PROMPTS, GREEDY)
    assert got == want
    assert spec.kv.num_free_blocks == free
    drafted = sum(u.num_drafted_tokens for u in usage.values())
    accepted = sum(u.num_accepted_tokens for u in usage.values())
    assert drafted > 0 and 0 <= accepted <= drafted
    stats = spec.speculator.stats
    assert sum(stats.drafted_per_position) == stats.num_drafted >= drafted
    assert all(a <= d for a, d in zip(stats.accepted_per_position,
                                      stats.drafted_per_position, strict=True))


def test_per_request_override_off_and_k(engines):
    _, spec = engines
    prompt = PROMPTS[2]
    spec.add_request("off", prompt, GREEDY, speculation=SpeculationParams(method="off"))
    spec.add_request("k1", prompt, GREEDY, speculation=SpeculationParams(k=1))
    usage = {}
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.finished:
                usage[out.request_id] = out.usage
    assert usage["off"].num_drafted_tokens == 0
    assert usage["k1"].num_drafted_tokens <= usage["k1"].num_spec_steps


def test_seeded_sampling_with_speculation_is_reproducible(engines):
    _, spec = engines
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    a = spec.generate([PROMPTS[0]], params)[0].token_ids
    b = spec.generate([PROMPTS[0], PROMPTS[1]], params)[0].token_ids
    assert a == b


REAL_PROMPTS = [
    "Fix the typo in this sentence and repeat it: 'The quick brown fox jumsp over the lazy dog "
    "while the farmer watches from the porch.'",
    "Add a docstring to this function:\n\ndef mean(values):\n    total = 0\n    for v in values:\n"
    "        total += v\n    return total / len(values)\n",
    "Summarise: The library opens at nine. The library closes at five. On Sundays the library "
    "is closed. Members may borrow five books at a time.",
    "What is 12 times 12?",
]


@pytest.mark.slow
def test_real_model_greedy_equal_with_ngram(default_model_dir):
    """The default model (fp32): n-gram speculation changes nothing, batch 1 and batched."""
    params = SamplingParams(max_tokens=64, temperature=0.0)
    plain = make_engine(default_model_dir, "off", max_num_batched_tokens=128)
    spec = make_engine(default_model_dir, "ngram", max_num_batched_tokens=128)
    chat = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    want = [o.token_ids for o in plain.generate(chat, params)]
    for ids, expected in zip(chat, want, strict=True):
        assert spec.generate([ids], params)[0].token_ids == expected
    outs = spec.generate(chat, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.usage.num_accepted_tokens for o in outs) > 0


def test_bf16_greedy_equal_with_and_without_ngram(tiny_model_dir):
    """bf16 too: verification runs each query row through exactly the arithmetic of a decode
    step (row-invariant GEMV, fused ops and ragged attention kernels), so drafts change
    nothing. (Where the C kernels are unavailable, the torch path is not row-invariant.)"""
    from quickdraft.kernels import cpu_attention, cpu_gemv

    if not (cpu_attention.available() and cpu_gemv.available()):
        pytest.skip("CPU kernels not built here")
    plain = make_engine(tiny_model_dir, "off", dtype_override="bfloat16")
    spec = make_engine(tiny_model_dir, "ngram", dtype_override="bfloat16")
    drafted = 0
    for prompt in PROMPTS:
        want = plain.generate([prompt], GREEDY)[0].token_ids
        got = spec.generate([prompt], GREEDY)[0]
        assert got.token_ids == want
        drafted += got.usage.num_drafted_tokens
    assert drafted > 0
