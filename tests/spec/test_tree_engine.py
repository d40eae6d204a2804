"""Tree speculation end to end: token-recycling trees (and, on the default model,
``combined``'s: the suffix tries' frequency-scored trees) are verified in one step with
tree attention, the accepted path's K/V moved into place; greedy output equals output
without speculation, token for token, at batch 1 and in a staggered batch of 8 with
preemption and the prefix cache on, in fp32 (torch attention) and bf16 (the C kernels);
sampled requests run through multi-candidate rejection; no KV block leaks; the invariants
hold after every step."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels import cpu_attention
from tests.spec.test_spec_engine import GREEDY, PROMPTS, run_staggered

METHODS = ["recycling"]  # (the tiny model's outputs rarely branch a suffix trie)


def make_engine(model_dir, speculation: str, dtype: str = "float32",
                num_kv_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=dtype, speculation=speculation,
                          measure_step_cost=False, num_kv_blocks=num_kv_blocks, block_size=4,
                          enable_prefix_caching=True)
    return LLMEngine(config, progress=False)


def _tree_steps(engine) -> int:
    return engine.speculator.stats.num_tree_steps


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(tiny_model_dir, "off")


@pytest.mark.parametrize("method", METHODS)
def test_greedy_batch1_equal_with_trees(plain, tiny_model_dir, method):
    spec = make_engine(tiny_model_dir, method)
    for prompt in PROMPTS:
        want = plain.generate([prompt], GREEDY)[0].token_ids
        free = spec.kv.num_free_blocks
        assert spec.generate([prompt], GREEDY)[0].token_ids == want
        assert spec.kv.num_free_blocks == free
    assert _tree_steps(spec) > 0
    stats = spec.speculator.stats
    assert stats.num_tree_nodes > stats.num_tree_steps  # real trees, not single nodes


@pytest.mark.parametrize("method", METHODS)
def test_greedy_staggered_batch_with_preemption_equal_with_trees(plain, tiny_model_dir,
                                                                 method):
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    spec = make_engine(tiny_model_dir, method, num_kv_blocks=48)  # too small for all 8
    free = spec.kv.num_free_blocks
    for _ in range(2):  # cold tables, then warm ones
        got, _ = run_staggered(spec, PROMPTS, GREEDY)
        assert got == want
        assert spec.kv.num_free_blocks == free
    assert spec.scheduler.num_preemptions > 0
    assert _tree_steps(spec) > 0


def test_sampled_requests_verify_trees_and_free_their_blocks(default_model_dir):
    # the real model: a random one's samples are tokens its table has never seen
    spec = make_engine(default_model_dir, "recycling")
    spec.generate(PROMPTS[:2], GREEDY)  # warm the table
    free = spec.kv.num_free_blocks
    before = spec.speculator.stats.num_steps
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, ignore_eos=True)
    outs = spec.generate(PROMPTS[:4], params)
    assert all(len(o.token_ids) == 30 for o in outs)
    assert spec.kv.num_free_blocks == free
    assert spec.speculator.stats.num_steps > before  # drafts were verified


@pytest.mark.skipif(not cpu_attention.available(), reason="needs the C attention kernel")
@pytest.mark.parametrize("method", METHODS)
def test_bf16_greedy_equal_with_trees(tiny_model_dir, method):
    """bf16: tree rows go through the C kernel's masked path, which sees the same K/V in the
    same order as the decode step that would follow: still token for token."""
    plain = make_engine(tiny_model_dir, "off", "bfloat16")
    spec = make_engine(tiny_model_dir, method, "bfloat16", num_kv_blocks=48)
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    for _ in range(2):
        assert run_staggered(spec, PROMPTS, GREEDY)[0] == want
    for prompt in PROMPTS[:3]:
        assert spec.generate([prompt], GREEDY)[0].token_ids == \
            plain.generate([prompt], GREEDY)[0].token_ids
    assert _tree_steps(spec) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_greedy_equal_with_trees(default_model_dir, dtype):
    """The default model, fp32 and bf16: ``combined`` (suffix trees here) on real
    predictions."""
    if dtype == "bfloat16" and not cpu_attention.available():
        pytest.skip("needs the C attention kernel")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = make_engine(default_model_dir, "off", dtype)
    spec = make_engine(default_model_dir, "combined", dtype)
    for prompt in PROMPTS[:4]:
        assert spec.generate([prompt], params)[0].token_ids == \
            plain.generate([prompt], params)[0].token_ids
    assert spec.speculator.stats.num_accepted > 0
    assert _tree_steps(spec) > 0


@pytest.mark.parametrize("method", [*METHODS, "suffix"])
def test_chains_only_backend_verifies_at_most_k_drafts(plain, tiny_model_dir, method):
    """A backend that verifies chains only (the GPU's batch-invariant mode) gets each tree's
    best path cut at the engine's k: its CUDA graphs hold 1 + k rows a request, so a longer
    chain would run eagerly. Output still equals no speculation."""
    spec = make_engine(tiny_model_dir, method)
    spec.speculator.verify_trees = False
    k = spec.config.num_speculative_tokens
    for prompt in PROMPTS:
        assert spec.generate([prompt], GREEDY)[0].token_ids == \
            plain.generate([prompt], GREEDY)[0].token_ids
    stats = spec.speculator.stats
    assert _tree_steps(spec) == 0 and sum(stats.drafted_per_position[:k]) > 0
    assert not any(stats.drafted_per_position[k:])
