"""Self-distillation data for the draft head: the target's answers and its hidden states.

:func:`generate_answers` runs the engine (greedy, no speculation, batched) over chat prompts
and appends ``{"prompt", "prompt_ids", "output_ids"}`` lines to a JSONL file; a rerun skips
the prompts already answered (resumable). :func:`capture_features` feeds each conversation
(prompt + answer) through the target once and keeps, per position ``t``, the concatenated
aux-layer residual streams ``features[t]`` (bf16), the target's argmax ``argmax[t]`` (what
greedy verification accepts after ``tokens[:t + 1]``) and its ``TOP_K`` most likely next
tokens with their probabilities (the soft label: more signal per token than the argmax),
saved in shards.

A training example at position ``t`` is then: features ``features[t]``, input token
``tokens[t + 1]``, label ``argmax[t + 1]`` (soft: ``top_ids/top_probs[t + 1]``); losses only
on the answer's positions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.step_plan import StepPlan
from quickdraft.spec.suffix_corpus import check_corpus_target, read_tokens, tokens_file

TOP_K = 8  # soft-label tokens kept per position


@dataclass
class Conversation:
    """One captured example (tensors on the host)."""

    tokens: torch.Tensor  # [n] int64: prompt then answer
    features: torch.Tensor  # [n, 3h] bf16
    argmax: torch.Tensor  # [n] int64: the target's greedy next token after tokens[:t+1]
    prompt_len: int
    top_ids: torch.Tensor | None = None  # [n, TOP_K] int64: its most likely next tokens
    top_probs: torch.Tensor | None = None  # [n, TOP_K] float: their probabilities


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash: dropped, redone
                continue
    return rows


def generate_answers(engine: Any, prompts: list[str], out_path: Path, max_tokens: int,
                     concurrency: int = 16, desc: str = "generate") -> list[dict[str, Any]]:
    """Answer every prompt not already in ``out_path`` (greedy, speculation off) and return
    all rows of the file. ``engine``: an :class:`engine.llm_engine.LLMEngine`."""
    from quickdraft.engine.sampling_params import SamplingParams
    from quickdraft.spec.params import SpeculationParams

    done = {row["prompt"] for row in read_jsonl(out_path)}
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    off = SpeculationParams(method="off")
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", dynamic_ncols=True)
    pending = iter(enumerate(todo))
    running: dict[str, tuple[str, list[int]]] = {}
    outputs: dict[str, list[int]] = {}
    with out_path.open("a") as sink:
        def submit() -> None:
            for index, prompt in pending:
                ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
                rid = f"gen-{index}"
                engine.add_request(rid, sampling_params=params, prompt_token_ids=ids,
                                   speculation=off, cache_salt=rid)
                running[rid] = (prompt, ids)
                outputs[rid] = []
                if len(running) >= concurrency:
                    return
        submit()
        while running:
            for out in engine.step():
                outputs[out.request_id].extend(out.token_ids)
                if out.finished:
                    prompt, ids = running.pop(out.request_id)
                    if out.error is None:
                        sink.write(json.dumps({"prompt": prompt, "prompt_ids": ids,
                                               "output_ids": outputs.pop(out.request_id)})
                                   + "\n")
                        sink.flush()
                    bar.update(1)
            submit()
    bar.close()
    return read_jsonl(out_path)


@torch.inference_mode()
def capture_one(model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                tokens: list[int], aux_layers: tuple[int, ...], chunk: int = 512,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features [n, 3h] bf16, argmax [n], top_ids [n, TOP_K], top_probs [n, TOP_K] fp16)``
    of one sequence, prefilled in chunks into ``kv_caches`` from block 0 (no request may be
    using them)."""
    n = len(tokens)
    table = list(range(-(-n // block_size)))
    feats: list[torch.Tensor] = []
    argmax: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    top_probs: list[torch.Tensor] = []
    for start in range(0, n, chunk):
        feed = tokens[start:start + chunk]
        plan = StepPlan.from_feeds([feed], [start], [table])
        meta = plan.attention_metadata(block_size, model.embed_tokens.device)
        ids = torch.tensor(plan.input_ids, dtype=torch.int64)
        pos = torch.tensor(plan.positions, dtype=torch.int64)
        hidden, aux = model.forward_with_aux(ids, pos, kv_caches, meta, aux_layers)
        assert aux is not None
        feats.append(aux.to(torch.bfloat16).cpu())
        for rows in hidden.split(128):
            logits = model.compute_logits(rows).float()  # [rows, vocab]
            argmax.append(logits.argmax(-1).cpu())
            top = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
            top_ids.append(top.indices.cpu())
            top_probs.append(top.values.to(torch.float16).cpu())
    return torch.cat(feats), torch.cat(argmax), torch.cat(top_ids), torch.cat(top_probs)


def capture_features(model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                     rows: list[dict[str, Any]], aux_layers: tuple[int, ...], out_dir: Path,
                     shard_size: int = 200, desc: str = "capture") -> list[Path]:
    """Capture every row into shards ``out_dir/shard-00000-<digest>.pt`` ...; shards already
    written are kept (resumable). A shard's name carries a digest of its rows' tokens, so a
    rerun whose rows changed (e.g. with ``reuse_corpus`` added) captures them again instead
    of taking a stale shard. Returns the shard paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    max_len = kv_caches[0].shape[1] * block_size
    paths: list[Path] = []
    shards = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]
    bar = tqdm(total=sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows),
               desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True)
    for index, shard in enumerate(shards):
        digest = hashlib.sha256(json.dumps(
            [r["prompt_ids"] + r["output_ids"] for r in shard]).encode()).hexdigest()[:12]
        path = out_dir / f"shard-{index:05d}-{digest}.pt"
        paths.append(path)
        size = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in shard)
        if path.exists():
            bar.update(size)
            continue
        items = []
        for row in shard:
            tokens = (row["prompt_ids"] + row["output_ids"])[:max_len]
            features, argmax, top_ids, top_probs = capture_one(model, kv_caches, block_size,
                                                               tokens, aux_layers)
            items.append({"tokens": torch.tensor(tokens, dtype=torch.int32),
                          "features": features, "argmax": argmax.to(torch.int32),
                          "top_ids": top_ids.to(torch.int32), "top_probs": top_probs,
                          "prompt_len": len(row["prompt_ids"])})
            bar.update(len(row["prompt_ids"]) + len(row["output_ids"]))
        tmp = path.with_suffix(".tmp")
        torch.save(items, tmp)
        tmp.replace(path)
    bar.close()
    return paths


def load_conversations(paths: list[Path]) -> Iterator[Conversation]:
    for path in paths:
        for item in torch.load(path, weights_only=True):
            top_ids = item.get("top_ids")  # absent from shards of older captures
            yield Conversation(item["tokens"].long(), item["features"],
                               item["argmax"].long(), int(item["prompt_len"]),
                               None if top_ids is None else top_ids.long(),
                               item.get("top_probs"))


def token_counts(rows: list[dict[str, Any]], vocab_size: int,
                 key: Callable[[dict[str, Any]], list[int]] = lambda r: r["output_ids"],
                 ) -> torch.Tensor:
    """How often each token id occurs in the rows' answers: ``[vocab_size]`` int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row in rows:
        ids = torch.tensor(key(row), dtype=torch.int64)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def corpus_rows(head_dir: Path, fingerprint: str, prompt_ids: list[int],
                ) -> list[dict[str, Any]]:
    """The answers of ``head_dir``'s suffix corpus (an earlier head's training answers: the
    target's own greedy text) as training rows, each after ``prompt_ids``: the corpus keeps
    no prompts, so a reused answer is fed after a stand-in user turn. The target's features
    and next-token labels are recomputed over it, so a row is still exact self-distillation,
    only of text whose opening does not follow from its context. ValueError if the corpus
    is another target's."""
    check_corpus_target(head_dir, fingerprint)
    flat = read_tokens(tokens_file(head_dir))  # [n] int32, -1 between answers
    ends = (flat == -1).nonzero()[0].tolist()
    rows, start = [], 0
    for index, end in enumerate(ends):
        if end > start:
            rows.append({"prompt": f"corpus:{head_dir.name}/{index}",
                         "prompt_ids": list(prompt_ids),
                         "output_ids": flat[start:end].tolist()})
        start = end + 1
    return rows


def add_new_answers(rows: list[dict[str, Any]], extra: list[dict[str, Any]],
                    ) -> list[dict[str, Any]]:
    """``rows`` then the ``extra`` rows whose answer none of ``rows`` (or an earlier extra
    row) has: a reused answer that was answered again keeps its real prompt."""
    seen = {tuple(r["output_ids"]) for r in rows}
    out = list(rows)
    for row in extra:
        key = tuple(row["output_ids"])
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out
