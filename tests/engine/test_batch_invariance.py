"""A request's greedy tokens on the default CPU serving paths (int4-q8, int4, dense bf16) do not
depend on what else is in its batch, how its prompt is chunked, whether its prefix came from
the cache, or speculation: every kernel on these paths computes a row the same way whatever
the other rows are (int4 matmul, the tiled bf16 GEMV, fused ops, C attention)."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels import cpu_attention, cpu_gemv, cpu_int4, cpu_q4q8

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (cpu_gemv.available() and cpu_attention.available()),
                                 reason="needs the C kernels")]

# four prompts: prefilled together they make a step of > 48 rows (the old GEMM switch-over)
PROMPTS = ["What is the most interesting colour and why?", "Write a short poem about the sea.",
           "Explain how a bicycle works.", "Summarise: the quick brown fox jumps over the "
           "lazy dog. The dog sleeps on. The fox runs home."]


def _engine(**kw) -> LLMEngine:
    kw.setdefault("speculation", "off")
    return LLMEngine(EngineConfig(measure_step_cost=False, **kw), progress=False)


def _greedy(llm: LLMEngine, prompts: list[str], *, stagger: bool = False,
            n: int = 24) -> dict[str, list[int]]:
    baseline = llm.kv.num_free_blocks
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    pending = list(enumerate(ids))
    out: dict[str, list[int]] = {}
    while pending or llm.has_unfinished_requests():
        while pending:
            i, prompt = pending.pop(0)
            llm.add_request(str(i), prompt_token_ids=prompt,
                            sampling_params=SamplingParams(temperature=0, max_tokens=n))
            if stagger:
                break
        for delta in llm.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert llm.kv.num_free_blocks == baseline
    return out



@pytest.mark.parametrize("weights", ["int4-q8", "int4", "dense"])
def test_greedy_tokens_do_not_depend_on_batch_chunks_cache_or_speculation(weights):
    if weights == "int4" and not cpu_int4.available():
        pytest.skip("no CPU int4 ops in this torch")
    if weights == "int4-q8" and not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    llm = _engine(weights=weights)
    alone = {str(i): _greedy(llm, [p])["0"] for i, p in enumerate(PROMPTS)}
    assert _greedy(llm, PROMPTS) == alone  # one batch, prefills together
    assert _greedy(llm, PROMPTS, stagger=True) == alone  # prefills beside decodes
    assert _greedy(llm, PROMPTS, stagger=True) == alone  # prefix-cache hits
    assert _greedy(_engine(weights=weights, max_num_batched_tokens=16), PROMPTS) == alone
    assert _greedy(_engine(weights=weights, speculation="ngram"), PROMPTS,
                   stagger=True) == alone
