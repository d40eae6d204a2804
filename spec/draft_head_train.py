"""``quickdraft draft-head train``: self-distil a draft head from the target, resumably.

Stages, each written under ``work_dir`` and skipped on a rerun once finished (a crash loses
at most the stage's current shard or the steps since the last checkpoint):

1. answers: the target answers the first-stage prompts, then second-stage prompts built from
   its own answers (:mod:`spec.draft_head_prompts`), and the held-apart evaluation prompts;
2. features: each conversation's aux-layer hidden states and greedy argmax
   (:mod:`spec.draft_head_data`);
3. training: AdamW over the answers' positions with EAGLE-3's training-time test
   (``ttt_steps`` unrolled steps, step ``j`` weighted ``0.8^j``); checkpoints every
   ``checkpoint_every`` steps (weights, optimiser, step, data order);
4. evaluation: on the held-apart conversations, the greedy chain acceptance: at each answer
   position, how many of the head's next ``eval_depth`` drafts the target accepts;
5. the head (``draft_head.json`` + ``draft_head.safetensors``) and ``train_report.json``.

Deterministic for a seed on one machine and thread count (data order, initialisation).
With ``device`` other than the CPU (or ``data="transformers"``), stages 1-2 are made by
transformers' batched generation on that device instead (:mod:`spec.draft_head_hf`), and
training and evaluation run there.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_layers import ModelShape
from quickdraft.spec.draft_head import (
    DraftHead,
    DraftHeadConfig,
    load_head,
    model_fingerprint,
    save_head,
)
from quickdraft.spec.draft_head_data import (
    add_new_answers,
    capture_features,
    corpus_rows,
    generate_answers,
    load_conversations,
    token_counts,
)
from quickdraft.spec.draft_head_fit import TargetParts, evaluate, train
from quickdraft.spec.draft_head_prompts import first_stage_prompts, second_stage_prompts
from quickdraft.spec.suffix_corpus import write_corpus, write_texts


@dataclass(frozen=True)
class TrainConfig:
    out_dir: Path
    work_dir: Path
    model: str | None = None  # a model spec (None: the default model)
    num_prompts: int = 1600  # first-stage training prompts (at most ~2000 exist)
    num_second_stage: int = 600
    num_eval_prompts: int = 48
    max_new_tokens: int = 256
    concurrency: int = 16
    draft_vocab_size: int = 4096
    epochs: float = 2.0
    batch_size: int = 4  # conversations per optimiser step
    max_seq_len: int = 768
    ttt_steps: int = 3
    soft_labels: bool = True  # train on the target's top-k distribution, not its argmax
    lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0
    eval_depth: int = 5
    checkpoint_every: int = 25
    max_train_minutes: float | None = None  # stop training early (then not deterministic)
    device: str = "cpu"  # the torch device that makes the data and trains
    # Who makes the data: "engine" (the served engine, CPU only), "transformers" (batched
    # generate and capture on ``device``: spec/draft_head_hf.py), "auto": engine on the CPU.
    data: str = "auto"
    num_self_prompts: int = 0  # extra prompts the target writes itself (transformers data)
    num_follow_ups: int = 0  # second user turns on earlier conversations (transformers)
    generate_batch: int = 512  # conversations generated at once (transformers data)
    max_generate_minutes: float | None = None  # stop starting new answers (transformers)
    # a head directory whose suffix corpus (its training answers) is trained on as well
    reuse_corpus: Path | None = None
    # a head directory evaluated on the same held-apart data, for comparison
    compare_head: Path | None = None

    @property
    def data_maker(self) -> str:
        return self.data if self.data != "auto" else (
            "engine" if self.device == "cpu" else "transformers")

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "concurrency", "draft_vocab_size",
                     "batch_size", "max_seq_len", "ttt_steps", "eval_depth",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not self.epochs > 0 or not self.lr > 0:
            raise ValueError("epochs and lr must be positive")
        if self.data not in ("auto", "engine", "transformers"):
            raise ValueError(f"data must be auto, engine or transformers, not {self.data!r}")
        if self.data == "engine" and self.device != "cpu":
            raise ValueError("the engine makes data on the CPU only: use data=transformers")
        if self.data_maker == "engine" and (self.num_self_prompts or self.num_follow_ups):
            raise ValueError("num_self_prompts and num_follow_ups need data=transformers")
        if self.max_generate_minutes is not None and not self.max_generate_minutes >= 0:
            raise ValueError("max_generate_minutes must be >= 0 (0: no new answers), not "
                             f"{self.max_generate_minutes}")
        if self.num_self_prompts < 0 or self.num_follow_ups < 0 or self.generate_batch < 1:
            raise ValueError("num_self_prompts and num_follow_ups must be >= 0, "
                             "generate_batch >= 1")


def run(config: TrainConfig, engine: Any = None) -> dict[str, Any]:
    """All stages; ``engine`` (an LLMEngine on ``config.model``, speculation off) is built
    when not given. Returns the report written to ``out_dir/train_report.json``."""
    from quickdraft.engine import loader
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine

    if config.data_maker == "transformers":
        from quickdraft.spec.draft_head_hf import run_on_device

        return run_on_device(config)
    started = time.perf_counter()
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = loader.resolve_model(config.model)
    if engine is None:
        engine = LLMEngine(EngineConfig(model=config.model, speculation="off",
                                        measure_step_cost=False, seed=config.seed))
    model: LlamaForCausalLM = engine.runner.model
    fingerprint = model_fingerprint(model_dir)
    head_config = DraftHeadConfig.for_target(model.shape, fingerprint, config.draft_vocab_size)
    compared = (None if config.compare_head is None
                else load_target_head(config.compare_head, model.shape, fingerprint, "cpu"))
    reused = [] if config.reuse_corpus is None else corpus_rows(
        config.reuse_corpus, fingerprint,
        engine.apply_chat_template([{"role": "user", "content": ""}]))
    timings: dict[str, float] = {}

    # 1. answers
    t0 = time.perf_counter()
    train_prompts, eval_prompts = first_stage_prompts(config.num_prompts, config.seed)
    first = generate_answers(engine, train_prompts, work / "answers-1.jsonl",
                             config.max_new_tokens, config.concurrency, "answers (1/3)")
    decode = engine.tokenizer.decode
    second_prompts = second_stage_prompts(
        [(r["prompt"], decode(r["output_ids"], skip_special_tokens=True)) for r in first],
        config.num_second_stage, config.seed)
    second = generate_answers(engine, second_prompts, work / "answers-2.jsonl",
                              config.max_new_tokens, config.concurrency, "answers (2/3)")
    held = generate_answers(engine, eval_prompts[:config.num_eval_prompts],
                            work / "answers-eval.jsonl", config.max_new_tokens,
                            config.concurrency, "answers (3/3, held apart)")
    timings["answers_s"] = time.perf_counter() - t0
    train_rows = add_new_answers(first + second, reused)

    # 2. features
    t0 = time.perf_counter()
    aux = head_config.aux_layers
    block_size = engine.config.block_size
    kv = engine.runner.kv_caches
    train_shards = capture_features(model, kv, block_size, train_rows, aux,
                                    work / "features-train", desc="features (train)")
    eval_shards = capture_features(model, kv, block_size, held, aux, work / "features-eval",
                                   desc="features (held apart)")
    timings["features_s"] = time.perf_counter() - t0

    # 3. training
    t0 = time.perf_counter()
    draft_vocab, coverage = choose_draft_vocab(train_rows, model.shape.vocab_size,
                                               head_config.draft_vocab_size)
    parts = TargetParts.of(model)
    train_data = list(load_conversations(train_shards))
    head, steps_done, losses = train(head_config, parts, draft_vocab, train_data, config,
                                     work)
    timings["train_s"] = time.perf_counter() - t0

    # 4. evaluation, 5. files
    eval_data = list(load_conversations(eval_shards))
    acceptance = evaluate(head, parts, eval_data, config.eval_depth)
    if compared is not None:
        acceptance["compared"] = {"head": str(config.compare_head),
                                  **evaluate(compared, parts, eval_data, config.eval_depth)}
    return finish(config, head, str(model_dir), fingerprint, train_rows, len(eval_data),
                  steps_done, losses, coverage, acceptance, timings, started,
                  f"{platform.processor() or platform.machine()}, "
                  f"{torch.get_num_threads()} threads",
                  lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))


def load_target_head(head_dir: Path, shape: ModelShape, fingerprint: str,
                     device: torch.device | str) -> DraftHead:
    """The head saved in ``head_dir``, in fp32 on ``device``; DraftHeadError (naming the
    field) unless it was made for this target (:meth:`DraftHeadConfig.check_target`).
    Loaded before any work, so that a wrong ``compare_head`` fails at once rather than
    after training."""
    head = load_head(head_dir, torch.float32)
    head.config.check_target(shape, fingerprint)
    return head.to(device)


def choose_draft_vocab(rows: list[dict[str, Any]], vocab_size: int, size: int,
                       ) -> tuple[torch.Tensor, float]:
    """The ``size`` tokens most frequent in the rows' answers (sorted target ids ``[V_d]``)
    and the share of answer tokens they cover."""
    counts = token_counts(rows, vocab_size)
    draft_vocab = torch.argsort(counts, descending=True, stable=True)[:size].sort().values
    return draft_vocab, float(counts[draft_vocab].sum() / max(int(counts.sum()), 1))


def finish(config: TrainConfig, head: DraftHead, target: str, fingerprint: str,
           train_rows: list[dict[str, Any]], num_eval: int, steps_done: int,
           losses: list[float], coverage: float, acceptance: dict[str, Any],
           timings: dict[str, float], started: float, machine: str,
           decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    """Save the head and the suffix corpus (the training answers, :mod:`spec.suffix_corpus`)
    and write (and return) ``train_report.json``."""
    save_head(head.cpu(), config.out_dir)
    corpus = write_training_corpus(config.out_dir, train_rows, fingerprint, decode)
    report = {
        "target": target, "target_fingerprint": fingerprint,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "train_conversations": len(train_rows),
        "train_answer_tokens": sum(len(r["output_ids"]) for r in train_rows),
        "train_tokens": sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in train_rows),
        "eval_conversations": num_eval, "optimizer_steps": steps_done,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "draft_vocab_coverage": round(coverage, 4), "eval": acceptance,
        "suffix_corpus": corpus,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(time.perf_counter() - started, 1), "machine": machine,
    }
    (config.out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def write_training_corpus(out_dir: Path, rows: list[dict[str, Any]], fingerprint: str,
                          decode: Callable[[list[int]], str] | None = None,
                          ) -> dict[str, Any]:
    """The rows' answers as the head directory's public suffix corpus; with ``decode`` (the
    target's tokenizer, special tokens kept), their text too, which other targets draft from
    (:func:`spec.suffix_corpus.derive_corpus`)."""
    answers = [r["output_ids"] for r in rows if r["output_ids"]]
    config = write_corpus(out_dir, answers, fingerprint,
                          "the target's greedy answers to its draft head's training prompts "
                          "(written by this repository or by the target itself)")
    if decode is not None:
        write_texts(out_dir, [decode(a) for a in answers])
    return config
