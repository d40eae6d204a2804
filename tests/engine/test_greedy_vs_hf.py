"""Ground truth: our greedy tokens equal HF transformers `generate` (fp32) on the default model,
for six chat prompts of very different lengths run together with staggered arrivals, so
continuous batching, chunked prefill and paging cannot change results."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PASSAGE = (
    "The history of the bicycle spans more than two centuries. Early designs such as the "
    "draisine, built in 1817, had no pedals: riders pushed along the ground with their feet. "
    "Pedals attached to the front wheel arrived in the 1860s, and the high-wheeled penny-farthing "
    "followed, fast but dangerous. The safety bicycle of the 1880s, with two wheels of equal size "
    "and a chain drive to the rear wheel, made cycling practical for millions of people. "
)
PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in three sentences why the sky is blue.",
    "Summarise the following text in two sentences.\n\n" + PASSAGE * 3,
    "Here is some background:\n" + PASSAGE * 8 + "\nQuestion: when did pedals first appear?",
]
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                  max_num_batched_tokens=256, max_num_seqs=8), progress=False)


@pytest.fixture(scope="module")
def prompt_ids(engine):
    ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    lengths = sorted(len(x) for x in ids)
    assert lengths[0] < 40 and lengths[-1] > 700, lengths  # very different lengths
    return ids


@pytest.fixture(scope="module")
def hf_tokens(default_model_dir, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(gen[0, len(ids):].tolist())
    return out


def test_staggered_continuous_batching_equals_hf(engine, prompt_ids, hf_tokens):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    free_before = engine.kv.num_free_blocks
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new arrival every third step
            i, ids = pending.pop(0)
            engine.add_request(f"r{i}", sampling_params=params, prompt_token_ids=ids)
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        step += 1
    for i, want in enumerate(hf_tokens):
        got = tokens[f"r{i}"]
        mismatch = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                        None)
        assert got == want, f"prompt {i}: first mismatch at token {mismatch}"

    assert engine.kv.num_free_blocks == free_before
