"""Draft-head data on any torch device: transformers' batched ``generate`` and one batched
forward per group of conversations, instead of the served engine.

The engine (:mod:`spec.draft_head_data`) is what a 2-core CPU should use: it answers with
the served kernels and captures the served features. On a GPU the same work runs hundreds
of conversations at a time through transformers' model of the same checkpoint, which is
what makes tens of thousands of conversations (millions of tokens, EAGLE-scale data)
possible in minutes. What it produces is the same :class:`~spec.draft_head_data.Conversation`
(features of the residual streams after ``aux_layers`` layers, the greedy argmax and the
top-``TOP_K`` distribution at every position), kept on the device for training.

The features come from forward hooks on the decoder layers (the residual stream a layer
returns), not from ``output_hidden_states``, whose layout has changed across transformers
versions; ``tests/spec/test_draft_head_hf.py`` checks them against our own model's
``forward_with_aux``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from quickdraft.spec.draft_head_data import TOP_K, Conversation

Log = Callable[[str], None]


def load_hf_target(model_dir: Any, device: str, dtype: torch.dtype) -> Any:
    """transformers' causal LM for ``model_dir`` on ``device`` in ``dtype`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                      attn_implementation="sdpa")
    return model.to(device).eval()


def _left_padded(prompts: Sequence[list[int]], pad_id: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, W], mask [B, W])`` with each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[row, width - len(p):] = 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
    """The answer up to and including its first end-of-sequence token."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[:i + 1]
    return tokens


@torch.inference_mode()
def generate(model: Any, prompts: Sequence[list[int]], *, max_new_tokens: int,
             batch_size: int, eos_ids: frozenset[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             deadline: float = float("inf"), log: Log = print, desc: str = "generate",
             ) -> list[list[int] | None]:
    """Each prompt's answer (``None`` where its batch would have ended after ``deadline``,
    a ``time.monotonic()`` value, judged by the previous batch's time). Greedy unless
    ``temperature > 0``. Prompts are batched by length so that little of a batch is
    padding."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    sample = temperature > 0
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample,
        temperature=temperature if sample else None, top_p=top_p if sample else None,
        top_k=None, eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int] | None] = [None] * len(prompts)
    started, done, tokens, last_batch_s = time.monotonic(), 0, 0, 0.0
    for start in range(0, len(order), batch_size):
        # the next batch would overrun (>=: a zero budget starts nothing)
        if time.monotonic() + last_batch_s >= deadline:
            log(f"{desc}: time budget spent after {done} of {len(prompts)} prompts")
            break
        batch_started = time.monotonic()
        index = order[start:start + batch_size]
        ids, mask = _left_padded([prompts[i] for i in index], pad_id)
        if sample:
            torch.manual_seed(seed + start)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=gen_config)
        new = out[:, ids.shape[1]:].tolist()
        for row, i in enumerate(index):
            answers[i] = cut_at_eos(new[row], eos_ids)
            tokens += len(answers[i])  # type: ignore[arg-type]
        done += len(index)
        last_batch_s = time.monotonic() - batch_started
        elapsed = time.monotonic() - started
        log(f"{desc}: {done}/{len(prompts)} prompts, {tokens} tokens, "
            f"{tokens / max(elapsed, 1e-9):.0f} tok/s")
    return answers


@torch.inference_mode()
def capture(model: Any, sequences: Sequence[tuple[list[int], int]],
            aux_layers: tuple[int, ...], *, max_batch_tokens: int = 65536,
            store_device: torch.device | str | None = None, log: Log = print,
            desc: str = "capture") -> list[Conversation]:
    """One :class:`Conversation` per ``(tokens, prompt_len)``: the residual streams after
    ``aux_layers`` layers (0 = the embeddings) concatenated ``[n, 3h]`` bf16, the argmax
    and the top-``TOP_K`` next tokens at every position; tensors on ``store_device``
    (default: the model's). Sequences run right-padded, in groups of similar length."""
    device = next(model.parameters()).device
    store = torch.device(store_device) if store_device is not None else device
    base = model.model
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [base.embed_tokens.register_forward_hook(keep(0))] if 0 in aux_layers else []
    handles += [base.layers[i - 1].register_forward_hook(keep(i)) for i in aux_layers if i]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    out: list[Conversation | None] = [None] * len(sequences)
    started, done = time.monotonic(), 0
    try:
        start = 0
        while start < len(order):
            longest = len(sequences[order[start]][0])
            end = start + 1
            while end < len(order) and (end - start + 1) * len(sequences[order[end]][0]) \
                    <= max(max_batch_tokens, longest):
                end += 1
            index = order[start:end]
            width = max(len(sequences[i][0]) for i in index)
            ids = torch.zeros((len(index), width), dtype=torch.int64)
            mask = torch.zeros((len(index), width), dtype=torch.int64)
            for row, i in enumerate(index):
                toks = sequences[i][0]
                ids[row, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
                mask[row, :len(toks)] = 1
            captured.clear()
            mask = mask.to(device)
            hidden = base(input_ids=ids.to(device), attention_mask=mask,
                          use_cache=False).last_hidden_state  # [B, W, h], final norm applied
            feats = torch.cat([captured[i] for i in aux_layers], dim=-1)  # [B, W, 3h]
            valid = mask.bool()
            rows = hidden[valid]  # [N, h]: the batch's real positions, row-major
            argmax, top_ids, top_probs = [], [], []
            for chunk in rows.split(8192):
                logits = model.lm_head(chunk).float()  # [chunk, vocab]
                argmax.append(logits.argmax(-1))
                top = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
                top_ids.append(top.indices)
                top_probs.append(top.values.to(torch.float16))
            flat_feats = feats[valid].to(torch.bfloat16).to(store)  # [N, 3h]
            flat = [torch.cat(x).to(store) for x in (argmax, top_ids, top_probs)]
            offset = 0
            for i in index:
                toks, prompt_len = sequences[i]
                n = len(toks)
                part = slice(offset, offset + n)
                out[i] = Conversation(
                    torch.tensor(toks, dtype=torch.int64, device=store), flat_feats[part],
                    flat[0][part], prompt_len, flat[1][part], flat[2][part])
                offset += n
            done += len(index)
            log(f"{desc}: {done}/{len(sequences)} conversations "
                f"({time.monotonic() - started:.0f} s)")
            start = end
    finally:
        for handle in handles:
            handle.remove()
    return [c for c in out if c is not None]


def _logger() -> Log:
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {message}", flush=True)
    return log


def run_on_device(config: Any) -> dict[str, Any]:
    """``quickdraft draft-head train --device DEV``: the stages of
    :func:`spec.draft_head_train.run` with the data made by transformers on ``config.device``
    (sized for a GPU), plus prompts the target writes itself and second user turns.
    Answers are appended to JSONL files in the work directory (a rerun answers only the
    missing prompts); features are recomputed (seconds on a GPU) and kept on the device."""
    import json

    from quickdraft.engine import loader
    from quickdraft.engine.models.llama_layers import ModelShape
    from quickdraft.engine.models.rope import RotaryEmbedding
    from quickdraft.spec.draft_head import DraftHeadConfig, model_fingerprint
    from quickdraft.spec.draft_head_data import add_new_answers, corpus_rows, read_jsonl
    from quickdraft.spec.draft_head_fit import TargetParts, evaluate, train
    from quickdraft.spec.draft_head_prompts import (
        clean_written_prompt,
        first_stage_prompts,
        follow_up_turns,
        second_stage_prompts,
        self_prompt_requests,
    )
    from quickdraft.spec.draft_head_train import choose_draft_vocab, finish, load_target_head

    started, log = time.perf_counter(), _logger()
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = loader.resolve_model(config.model)
    hf_config = loader.load_config(model_dir)
    tokenizer = loader.load_tokenizer(model_dir)
    eos = loader.eos_token_ids(model_dir, hf_config, tokenizer)
    shape = ModelShape.from_config(hf_config)
    fingerprint = model_fingerprint(model_dir)
    head_config = DraftHeadConfig.for_target(shape, fingerprint, config.draft_vocab_size)
    model = load_hf_target(model_dir, str(device), torch.bfloat16)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    log(f"target {model_dir} ({fingerprint}) on {device}")
    compared = (None if config.compare_head is None
                else load_target_head(config.compare_head, shape, fingerprint, device))
    # 0 minutes: no new answers, train on what the work directory holds (e.g. answers
    # merged from earlier runs); the held-apart answers are still made if missing
    budget_end = (time.monotonic() + 60 * config.max_generate_minutes
                  if config.max_generate_minutes is not None else float("inf"))
    timings: dict[str, float] = {}

    def chat(messages: list[dict[str, str]]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))

    def answer(conversations: list[list[dict[str, str]]], name: str,
               budget_share: float | None) -> list[dict[str, Any]]:
        """Greedy answers, appended to ``work/name``, within ``budget_share`` of what is
        left of the answering budget (None: no limit); returns every row of the file."""
        deadline = float("inf") if budget_share is None else (
            time.monotonic() + budget_share * max(budget_end - time.monotonic(), 0.0))
        path = work / name
        done = {row["prompt"] for row in read_jsonl(path)}
        keys = [c[0]["content"] if len(c) == 1 else json.dumps(c) for c in conversations]
        todo = [(k, c) for k, c in dict(zip(keys, conversations, strict=True)).items()
                if k not in done]
        ids = [chat(c) for _k, c in todo]
        outs = generate(model, ids, max_new_tokens=config.max_new_tokens,
                        batch_size=config.generate_batch, eos_ids=eos, pad_id=pad,
                        deadline=deadline, log=log, desc=name)
        with path.open("a") as sink:
            for (key, _c), prompt_ids, out in zip(todo, ids, outs, strict=True):
                if out is not None:
                    sink.write(json.dumps({"prompt": key, "prompt_ids": prompt_ids,
                                           "output_ids": out}) + "\n")
        return read_jsonl(path)

    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    reused = [] if config.reuse_corpus is None else corpus_rows(
        config.reuse_corpus, fingerprint, chat(user("")))

    # 1. prompts and answers
    t0 = time.perf_counter()
    train_prompts, eval_prompts = first_stage_prompts(config.num_prompts, config.seed)
    written_path = work / "self-prompts.json"
    if config.num_self_prompts and not written_path.exists() \
            and config.max_generate_minutes != 0:
        requests = self_prompt_requests(config.num_self_prompts, config.seed)
        outs = generate(model, [chat(user(r)) for r in requests], max_new_tokens=64,
                        batch_size=config.generate_batch, eos_ids=eos, pad_id=pad,
                        temperature=0.8, top_p=0.95, seed=config.seed, log=log,
                        desc="self-prompts")
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs if o]
        written = list(dict.fromkeys(p for t in texts if (p := clean_written_prompt(t))))
        written_path.write_text(json.dumps(written))
    written = json.loads(written_path.read_text()) if written_path.exists() else []
    log(f"{len(written)} prompts written by the target")

    # the answering stages share the budget: each takes its part of what is left
    later = bool(config.num_second_stage) + bool(config.num_follow_ups)
    first = answer([user(p) for p in train_prompts + written], "answers-1.jsonl",
                   1 / (1 + later))
    pairs = [(r["prompt"], tokenizer.decode(r["output_ids"], skip_special_tokens=True))
             for r in first]
    second = answer([user(p) for p in second_stage_prompts(pairs, config.num_second_stage,
                                                           config.seed)],
                    "answers-2.jsonl", 1 / (1 + bool(config.num_follow_ups)))
    turns = answer(follow_up_turns(pairs, config.num_follow_ups, config.seed),
                   "answers-turns.jsonl", 1.0) if config.num_follow_ups else []
    held = answer([user(p) for p in eval_prompts[:config.num_eval_prompts]],
                  "answers-eval.jsonl", None)  # the held-apart answers are always made
    timings["answers_s"] = time.perf_counter() - t0

    # the reused answers come after the stages that build on first-stage answers
    train_rows = add_new_answers(first + second + turns, reused)
    if reused:
        log(f"{len(train_rows)} training conversations, with {config.reuse_corpus}'s corpus")

    # 2. features, on the device
    t0 = time.perf_counter()
    limit = max(config.max_seq_len, 1024)

    def sequences(rows: list[dict[str, Any]]) -> list[tuple[list[int], int]]:
        return [((r["prompt_ids"] + r["output_ids"])[:limit], len(r["prompt_ids"]))
                for r in rows]
    train_data = capture(model, sequences(train_rows), head_config.aux_layers, log=log,
                         desc="features (train)")
    eval_data = capture(model, sequences(held), head_config.aux_layers, log=log,
                        desc="features (held apart)")
    timings["features_s"] = time.perf_counter() - t0

    # 3. training, 4. evaluation, 5. files
    t0 = time.perf_counter()
    draft_vocab, coverage = choose_draft_vocab(train_rows, shape.vocab_size,
                                               head_config.draft_vocab_size)
    rotary = RotaryEmbedding(hf_config, shape.head_dim, max(limit, 4096), torch.bfloat16)
    base = model.model
    parts = TargetParts(base.embed_tokens.weight.detach().float(),
                        model.lm_head.weight.detach().float(),
                        base.norm.weight.detach().float(),
                        rotary.cos.float().to(device), rotary.sin.float().to(device))
    head, steps_done, losses = train(head_config, parts, draft_vocab, train_data, config,
                                     work, fit_to_time=True, log=log)
    timings["train_s"] = time.perf_counter() - t0
    acceptance = evaluate(head, parts, eval_data, config.eval_depth)
    log(f"held apart: {acceptance}")
    if compared is not None:
        acceptance["compared"] = {"head": str(config.compare_head),
                                  **evaluate(compared, parts, eval_data, config.eval_depth)}
        log(f"held apart, {config.compare_head}: {acceptance['compared']}")
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else str(device))
    return finish(config, head, str(model_dir), fingerprint, train_rows, len(eval_data),
                  steps_done, losses, coverage, acceptance, timings, started, name,
                  lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
