"""Draft-head data made by transformers (``draft-head train --data transformers``, what a GPU
runs): its features against the served engine's, batched generation against one prompt at
a time, the prompts the target writes and the second turns, and the pipeline end to end
on a tiny random model on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.loader import eos_token_ids, load_config, load_tokenizer
from quickdraft.engine.models.llama_layers import ModelShape
from quickdraft.spec.draft_head import default_aux_layers, find_head
from quickdraft.spec.draft_head_data import add_new_answers, capture_one, corpus_rows
from quickdraft.spec.draft_head_hf import capture, cut_at_eos, generate, load_hf_target
from quickdraft.spec.draft_head_prompts import (
    CODE_FOLLOW_UPS,
    TOPICS,
    clean_written_prompt,
    follow_up_turns,
    self_prompt_requests,
    topic_is_held_apart,
)
from quickdraft.spec.draft_head_train import TrainConfig, run
from quickdraft.spec.suffix_corpus import write_corpus
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hf-target"), default_model_dir,
                           num_layers=4, seed=1)  # a seed whose answers are not blank


def test_capture_equals_the_served_features(tiny: Path) -> None:
    """The hooks' residual streams, argmax and top-k equal the engine's capture (fp32)."""
    engine = LLMEngine(EngineConfig(model=str(tiny), dtype="float32", speculation="off",
                                    measure_step_cost=False))
    model = engine.runner.model
    aux = default_aux_layers(model.shape.num_layers)
    hf = load_hf_target(tiny, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, 1000, (n,), generator=g).tolist(), 3) for n in (5, 37, 12)]
    got = capture(hf, sequences, aux, max_batch_tokens=40, log=lambda _m: None)
    assert [len(c.tokens) for c in got] == [5, 37, 12]
    for (tokens, _p), conv in zip(sequences, got, strict=True):
        feats, argmax, top_ids, top_probs = capture_one(
            model, engine.runner.kv_caches, engine.config.block_size, tokens, aux)
        torch.testing.assert_close(conv.features.float(), feats.float(), atol=2e-2, rtol=0)
        assert torch.equal(conv.argmax.cpu(), argmax)
        assert conv.top_ids is not None and conv.top_probs is not None
        assert torch.equal(conv.top_ids[:, 0], top_ids[:, 0])
        torch.testing.assert_close(conv.top_probs.float(), top_probs.float(), atol=2e-3,
                                   rtol=0)


def test_batched_generation_equals_one_prompt_at_a_time(tiny: Path) -> None:
    """Left padding changes nothing: greedy answers in one batch of mixed lengths equal
    each prompt's answer alone, and stop at (and keep) the first end token."""
    hf = load_hf_target(tiny, "cpu", torch.float32)
    tokenizer = load_tokenizer(tiny)
    eos = eos_token_ids(tiny, load_config(tiny), tokenizer)
    prompts = [[5, 6, 7], list(range(100, 117)), [42] * 9]
    kwargs = dict(max_new_tokens=12, eos_ids=eos, pad_id=min(eos), log=lambda _m: None)
    together = generate(hf, prompts, batch_size=8, **kwargs)  # type: ignore[arg-type]
    alone = [generate(hf, [p], batch_size=1, **kwargs)[0] for p in prompts]  # type: ignore[arg-type]
    assert together == alone
    assert all(a is not None and 1 <= len(a) <= 12 for a in together)
    assert generate(hf, prompts, batch_size=1, deadline=0.0, **kwargs) == [None] * 3  # type: ignore[arg-type]
    assert cut_at_eos([4, 2, 9, 2], frozenset({2})) == [4, 2]
    assert cut_at_eos([4, 9], frozenset({2})) == [4, 9]


def test_written_prompts_are_tidied_or_dropped() -> None:
    assert clean_written_prompt('Question: "How do volcanoes form?"\n\nMore.') == \
        "How do volcanoes form?"
    assert clean_written_prompt("Sure!") is None
    assert clean_written_prompt("x" * 500) is None
    assert clean_written_prompt("1234567890 ?? 12345") is None


def test_self_prompt_requests_skip_held_apart_topics() -> None:
    requests = self_prompt_requests(3000, seed=1)
    assert len(requests) == 3000
    held = [t for t in TOPICS if topic_is_held_apart(t, 0.1)]
    assert held and not any(f"about {t}." in r for r in requests for t in held)
    assert self_prompt_requests(50, seed=1) == requests[:50]


def test_follow_up_turns_continue_the_conversation() -> None:
    pairs = [("Write code", "def add_one(x):\n    return x + 1  # adds one to its argument"),
             ("Hi", "Hello!"),
             ("Tell me about bees", "Bees make honey, live in hives and pollinate flowers.")]
    turns = follow_up_turns(pairs * 20, num=30, seed=0)
    assert len(turns) == 30  # "Hello!" is too short to follow up
    assert all([m["role"] for m in t] == ["user", "assistant", "user"] for t in turns)
    code = [t for t in turns if t[0]["content"] == "Write code"]
    assert any(t[2]["content"] in CODE_FOLLOW_UPS for t in code)
    assert not any(t[2]["content"] in CODE_FOLLOW_UPS for t in turns if t not in code)


def test_transformers_pipeline_end_to_end(tiny: Path, tmp_path: Path) -> None:
    """``--data transformers`` on the CPU: target-written prompts, second turns, training,
    a head that serves this target; a rerun answers nothing again."""
    config = TrainConfig(out_dir=tmp_path / "head", work_dir=tmp_path / "work",
                         model=str(tiny), data="transformers", num_prompts=10,
                         num_self_prompts=12, num_second_stage=4, num_follow_ups=6,
                         num_eval_prompts=3, max_new_tokens=40, generate_batch=8,
                         draft_vocab_size=512, epochs=3, batch_size=4, ttt_steps=2,
                         warmup_steps=2, checkpoint_every=4)
    report = run(config)
    assert report["optimizer_steps"] >= 3
    assert report["loss_last"] <= report["loss_first"] + 1e-3  # (this target is easy)
    turns = (tmp_path / "work" / "answers-turns.jsonl").read_text().splitlines()
    assert 1 <= len(turns) <= 6
    assert len(json.loads(json.loads(turns[0])["prompt"])) == 3  # a two-turn conversation
    shape = ModelShape.from_config(load_config(tiny))
    assert find_head(str(tmp_path / "head"), tiny, shape) is not None
    answers = {p.name: p.read_text() for p in (tmp_path / "work").glob("answers-*.jsonl")}
    again = run(config)
    assert again["train_conversations"] == report["train_conversations"]
    assert {p.name: p.read_text()
            for p in (tmp_path / "work").glob("answers-*.jsonl")} == answers
    # no answering budget: more prompts asked for, none answered; rows merged into the work
    # directory from elsewhere (any key) are trained on
    merged = tmp_path / "work" / "answers-1.jsonl"
    extra = json.loads(merged.read_text().splitlines()[0]) | {"prompt": "another run/0"}
    merged.write_text(merged.read_text() + json.dumps(extra) + "\n")
    only = run(replace(config, num_prompts=30, num_self_prompts=40, max_generate_minutes=0))
    assert only["train_conversations"] == report["train_conversations"] + 1
    answers["answers-1.jsonl"] = merged.read_text()
    assert {p.name: p.read_text()
            for p in (tmp_path / "work").glob("answers-*.jsonl")} == answers


def test_reused_corpus_and_compared_head(tiny: Path, tmp_path: Path) -> None:
    """``--reuse-corpus``: an earlier head's corpus answers are trained on too, after an
    empty user turn, except those answered again; another target's corpus is refused.
    ``--compare-head``: that head is evaluated on the same held-apart positions."""
    config = TrainConfig(out_dir=tmp_path / "head", work_dir=tmp_path / "work",
                         model=str(tiny), data="transformers", num_prompts=6,
                         num_second_stage=0, num_eval_prompts=2, max_new_tokens=24,
                         generate_batch=8, draft_vocab_size=512, epochs=1, batch_size=4,
                         ttt_steps=2, warmup_steps=1, checkpoint_every=4)
    first = run(config)
    fingerprint = first["target_fingerprint"]
    answers = [json.loads(line)["output_ids"] for line in
               (tmp_path / "work" / "answers-1.jsonl").read_text().splitlines()]
    old = tmp_path / "old"
    old.mkdir()
    write_corpus(old, [answers[0], [5, 6, 7, 8], [9, 10, 11]], fingerprint, "test")
    blank = [1, 2]
    rows = corpus_rows(old, fingerprint, blank)
    assert [r["output_ids"] for r in rows] == [answers[0], [5, 6, 7, 8], [9, 10, 11]]
    assert all(r["prompt_ids"] == blank for r in rows)
    merged = add_new_answers([{"output_ids": answers[0]}], rows)
    assert [r["output_ids"] for r in merged] == [answers[0], [5, 6, 7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match="target_fingerprint"):
        corpus_rows(old, "0" * 16, blank)
    again = run(replace(config, out_dir=tmp_path / "head2", max_generate_minutes=0,
                        reuse_corpus=old, compare_head=tmp_path / "head"))
    assert again["train_conversations"] == first["train_conversations"] + 2
    compared = again["eval"]["compared"]
    assert compared["head"] == str(tmp_path / "head")
    assert compared["positions"] == again["eval"]["positions"] == first["eval"]["positions"]
    assert abs(compared["mean_accepted"] - first["eval"]["mean_accepted"]) < 0.2  # bf16 copy


def test_transformers_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data=transformers"):
        TrainConfig(out_dir=tmp_path, work_dir=tmp_path, num_self_prompts=5)
    with pytest.raises(ValueError, match="CPU only"):
        TrainConfig(out_dir=tmp_path, work_dir=tmp_path, data="engine", device="cuda")
    with pytest.raises(ValueError, match="data must be"):
        TrainConfig(out_dir=tmp_path, work_dir=tmp_path, data="gpu")
    with pytest.raises(ValueError, match="max_generate_minutes"):
        TrainConfig(out_dir=tmp_path, work_dir=tmp_path, max_generate_minutes=-1)
    assert TrainConfig(out_dir=tmp_path, work_dir=tmp_path, device="cuda").data_maker == \
        "transformers"
