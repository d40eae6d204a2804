"""LLMEngine on a tiny random model with the real tokenizer: outputs, stops, bad input, block
accounting after finish / abort / error, and KV out-of-memory handling."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import InvalidRequestError, LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def new_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("measure_step_cost", False)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw), progress=False)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return new_engine(tiny_model_dir, num_kv_blocks=64, block_size=4,
                      max_num_batched_tokens=16)


def drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_generate_returns_blocks_and_usage(engine):
    free = engine.kv.num_free_blocks
    [out] = engine.generate(["Hello there, how are you?"], GREEDY)
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 3
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert engine.kv.num_free_blocks == free


def test_batching_does_not_change_greedy_output(engine):
    prompts = ["one two three", "a much longer prompt " * 6, "x"]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert alone == together


def test_seeded_sampling_reproducible_alone_and_batched(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = engine.generate(["seeded"], params)[0].token_ids
    batched = engine.generate(["seeded", "other", "third"], params)[0].token_ids
    again = engine.generate(["seeded"], params)[0].token_ids
    assert alone == batched == again
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate(["seeded"], other_seed)[0].token_ids != alone


def test_stop_token_ids_and_stop_strings(engine):
    [ref] = engine.generate(["stop test"], GREEDY)
    stop_tok = ref.token_ids[4]
    [out] = engine.generate(["stop test"], SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_tok,)))
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop_tok) + 1]
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        [out] = engine.generate(["stop test"], SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]


def test_logprobs_of_chosen_tokens(engine):
    [out] = engine.generate(["logprobs"], SamplingParams(max_tokens=5, temperature=0,
                                                          logprobs=True, ignore_eos=True))
    assert out.usage is not None
    rid = "lp"
    engine.add_request(rid, "logprobs", SamplingParams(max_tokens=5, temperature=0,
                                                       logprobs=True, ignore_eos=True))
    lps = [lp for o in drain(engine)[rid] for lp in (o.logprobs or [])]
    assert len(lps) == 5 and all(lp <= 0 for lp in lps)


@pytest.mark.parametrize("steps_before_abort", [1, 5])  # mid-prefill (chunked), mid-decode
def test_abort_frees_blocks(engine, steps_before_abort):
    free = engine.kv.num_free_blocks
    # (a longer answer: with speculation 12 tokens can be done in 3 decode steps)
    engine.add_request("victim", "word " * 40,
                       SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    engine.add_request("bystander", "hello", GREEDY)
    outs: dict[str, list] = {}
    for _ in range(steps_before_abort):
        for o in engine.step():  # (with speculation the bystander may finish early)
            outs.setdefault(o.request_id, []).append(o)
    victim = engine.scheduler.requests["victim"]
    assert (victim.num_computed_tokens < victim.num_prompt_tokens) == (steps_before_abort == 1)
    [final] = engine.abort("victim")
    assert final.finished and final.finish_reason == "abort"
    for rid, more in drain(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert outs["bystander"][-1].finish_reason == "length"
    assert engine.kv.num_free_blocks == free


def test_failing_step_errors_its_requests_and_engine_carries_on(engine, monkeypatch):
    free = engine.kv.num_free_blocks
    engine.add_request("doomed", "this step will fail", GREEDY)
    original = engine.runner.execute

    def explode(sched, *args):
        monkeypatch.setattr(engine.runner, "execute", original)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", explode)
    [out] = engine.step()
    assert out.finish_reason == "error" and "simulated kernel failure" in out.error
    assert engine.kv.num_free_blocks == free
    assert engine.generate(["after"], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,param", [
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=[1, 10**9]), "prompt_token_ids"),
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(prompt="x " * 3000), "prompt"),  # beyond max_model_len
])
def test_bad_requests_are_refused_with_the_field(tiny_model_dir, kwargs, param):
    engine = new_engine(tiny_model_dir, max_model_len=1024, num_kv_blocks=512)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", sampling_params=GREEDY, **kwargs)
    assert err.value.param == param
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id(engine):
    engine.add_request("dup", "a", GREEDY)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("dup", "b", GREEDY)
    engine.abort("dup")


def test_kv_pool_exhaustion_waits_preempts_or_refuses(tiny_model_dir):
    engine = new_engine(tiny_model_dir, num_kv_blocks=6, block_size=4)  # 24 tokens
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request("huge", prompt_token_ids=list(range(100, 130)), sampling_params=GREEDY)
    # Two requests that do not fit together both complete (one waits or is preempted).
    ids = [list(range(200, 210)), list(range(300, 310))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = engine.generate(ids, params)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [len(o.token_ids) for o in outs] == [8, 8]
    # One request that outgrows the pool alone ends cleanly instead of looping.
    [out] = engine.generate([list(range(400, 420))], SamplingParams(
        max_tokens=50, temperature=0, ignore_eos=True))
    assert out.finish_reason in ("length", "error")
    assert engine.kv.num_free_blocks == 6
