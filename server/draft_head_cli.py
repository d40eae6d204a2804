"""``quickdraft draft-head train``: self-distil an EAGLE-3-style draft head for a target.

The stages and their files are described in :mod:`spec.draft_head_train`; a rerun with the
same ``--work-dir`` resumes where a crash left off. The head is written to ``--out``; pass
that directory to ``serve --draft-head`` (the default model's head ships with quickdraft and
is loaded on its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_draft_head_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    head = sub.add_parser("draft-head", help="train a draft head (EAGLE-3 style) for a model")
    hsub = head.add_subparsers(dest="draft_head_command", required=True)
    train = hsub.add_parser(
        "train", help="generate answers with the target, capture its hidden states, train "
        "and evaluate a head (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    train.add_argument("--model", default=None,
                       help="target model (directory, .gguf or name; default: the default "
                       "model)")
    train.add_argument("--out", type=Path, required=True, help="where to write the head")
    train.add_argument("--work-dir", type=Path, default=None,
                       help="answers, features and checkpoints (default: OUT/work)")
    train.add_argument("--prompts", type=int, default=1600, help="first-stage prompts")
    train.add_argument("--second-stage", type=int, default=600,
                       help="prompts built from the target's own answers")
    train.add_argument("--eval-prompts", type=int, default=48, help="held-apart prompts")
    train.add_argument("--max-new-tokens", type=int, default=256,
                       help="longest target answer in tokens")
    train.add_argument("--concurrency", type=int, default=16,
                       help="answers generated at once")
    train.add_argument("--draft-vocab", type=int, default=4096,
                       help="draft vocabulary: the most frequent answer tokens")
    train.add_argument("--epochs", type=float, default=2.0, help="passes over the data")
    train.add_argument("--batch-size", type=int, default=4,
                       help="conversations per optimiser step")
    train.add_argument("--ttt-steps", type=int, default=3,
                       help="training-time-test unroll steps")
    train.add_argument("--hard-labels", action="store_true",
                       help="train on the target's argmax only (default: its top-8 "
                            "distribution)")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    train.add_argument("--seed", type=int, default=0,
                       help="prompt order, data order and initialisation")
    train.add_argument("--max-train-minutes", type=float, default=None,
                       help="stop training after this long (the result then depends on speed)")
    train.add_argument("--threads", type=int, default=None, help="CPU threads")
    train.add_argument("--device", default="cpu",
                       help="where data and training run: cpu (the served engine makes the "
                            "data) or a torch device such as cuda (transformers' batched "
                            "generate makes it, hundreds of answers at a time)")
    train.add_argument("--data", default="auto", choices=("auto", "engine", "transformers"),
                       help="who makes the data: the served engine (CPU) or transformers' "
                            "batched generate on --device (auto: engine on the CPU)")
    train.add_argument("--self-prompts", type=int, default=0,
                       help="device runs: requests for the target to write user prompts "
                            "itself (sampled; the usable ones are answered)")
    train.add_argument("--follow-ups", type=int, default=0,
                       help="device runs: second user turns on earlier conversations")
    train.add_argument("--generate-batch", type=int, default=512,
                       help="device runs: answers generated at once")
    train.add_argument("--max-generate-minutes", type=float, default=None,
                       help="device runs: start no new answers after this long (0: "
                            "train on the work directory's answers only)")
    train.add_argument("--checkpoint-every", type=int, default=25,
                       help="optimiser steps between checkpoints")
    train.add_argument("--max-seq-len", type=int, default=768,
                       help="longest training sequence in tokens")
    train.add_argument("--reuse-corpus", type=Path, default=None, metavar="HEAD_DIR",
                       help="also train on the answers in this head directory's suffix "
                            "corpus (an earlier run's answers; their prompts are not kept, "
                            "so each follows an empty user turn)")
    train.add_argument("--compare-head", type=Path, default=None, metavar="HEAD_DIR",
                       help="evaluate this head on the same held-apart data too")
    train.set_defaults(func=run_train)
    corpus = hsub.add_parser(
        "corpus", help="write the suffix corpus (the target's answers in a training work "
        "directory, which every request may draft from) into a head directory",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    corpus.add_argument("--model", default=None,
                        help="the target the answers came from (default: the default model)")
    corpus.add_argument("--work-dir", type=Path, required=True,
                        help="a `draft-head train` work directory (its answers-1/2.jsonl)")
    corpus.add_argument("--out", type=Path, required=True, help="the head directory")
    corpus.set_defaults(func=run_corpus)


def run_train(args: argparse.Namespace) -> int:
    from quickdraft.spec.draft_head_train import TrainConfig, run

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = TrainConfig(
        out_dir=args.out, work_dir=args.work_dir or args.out / "work", model=args.model,
        num_prompts=args.prompts, num_second_stage=args.second_stage,
        num_eval_prompts=args.eval_prompts, max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency, draft_vocab_size=args.draft_vocab, epochs=args.epochs,
        batch_size=args.batch_size, ttt_steps=args.ttt_steps,
        soft_labels=not args.hard_labels, lr=args.lr, seed=args.seed,
        max_train_minutes=args.max_train_minutes, device=args.device, data=args.data,
        num_self_prompts=args.self_prompts, num_follow_ups=args.follow_ups,
        generate_batch=args.generate_batch, max_generate_minutes=args.max_generate_minutes,
        max_seq_len=args.max_seq_len, checkpoint_every=args.checkpoint_every,
        reuse_corpus=args.reuse_corpus, compare_head=args.compare_head)
    report = run(config)
    print(json.dumps({"head": str(args.out), "eval": report["eval"],
                      "timings_s": report["timings_s"]}, indent=2))
    return 0


def run_corpus(args: argparse.Namespace) -> int:
    from quickdraft.engine import loader
    from quickdraft.spec.draft_head import model_fingerprint
    from quickdraft.spec.draft_head_data import read_jsonl
    from quickdraft.spec.draft_head_train import write_training_corpus

    rows = [row for name in ("answers-1.jsonl", "answers-2.jsonl")
            for row in read_jsonl(args.work_dir / name)]
    if not rows:
        print(f"no answers in {args.work_dir}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = loader.resolve_model(args.model)
    tokenizer = loader.load_tokenizer(model_dir)
    print(json.dumps(write_training_corpus(
        args.out, rows, model_fingerprint(model_dir),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False)), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m quickdraft.server.draft_head_cli train ...``: the same command without
    the server's imports (for a training machine that has torch and transformers only)."""
    parser = argparse.ArgumentParser(prog="quickdraft")
    add_draft_head_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["draft-head", *(argv if argv is not None else sys.argv[1:])])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
