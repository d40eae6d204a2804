"""Runs behind ``benchmarks/decode.py``: our engine and HF ``generate`` on one batch of chat
prompts, their rates, greedy agreement, and the weight bytes a decode step reads."""

from __future__ import annotations

import time
from typing import Any

import torch
from common import median, summarize

from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams


def run_ours(engine: LLMEngine, prompts: list[list[int]], n: int, tag: str) -> dict[str, Any]:
    """One batch through our engine: all requests added at once, stepped to completion."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    steps = 0
    first: float | None = None
    last_step, max_gap = 0.0, 0.0
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        engine.add_request(rid, sampling_params=params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens[out.request_id].extend(out.token_ids)
        steps += 1
        now = time.perf_counter()
        if first is not None:
            max_gap = max(max_gap, now - last_step)
        last_step = now
        if first is None and all(tokens[r] for r in rids):
            first = now - start
    total = time.perf_counter() - start
    counts = {len(t) for t in tokens.values()}
    if counts != {n}:
        raise RuntimeError(f"ours generated {sorted(counts)} tokens per request, expected {n}")
    assert first is not None
    return {"prefill_s": first, "total_s": total, "steps": steps, "max_gap_s": max_gap,
            "tokens": [tokens[r] for r in rids]}


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def run_hf(model: Any, prompts: list[list[int]], n: int, pad_id: int) -> dict[str, Any]:
    """One static batch through HF ``generate``: a 1-token run (prefill), then the N-token run."""
    ids, mask = left_pad(prompts, pad_id)
    common = {"attention_mask": mask, "do_sample": False, "pad_token_id": pad_id}
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **common)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **common)
    total = time.perf_counter() - start
    new = out[:, ids.shape[1]:]
    if new.shape[1] != n:
        raise RuntimeError(f"HF generated {new.shape[1]} tokens, expected {n}")
    return {"prefill_s": prefill, "total_s": total, "tokens": new.tolist()}


def rates(run: dict[str, Any], batch: int, n: int) -> dict[str, float]:
    decode_time = run["total_s"] - run["prefill_s"]
    gap = {"max_gap_ms": run["max_gap_s"] * 1e3} if "max_gap_s" in run else {}
    return {
        **gap,
        "prefill_s": run["prefill_s"],
        "total_s": run["total_s"],
        "decode_tok_s": (n - 1) * batch / decode_time if n > 1 and decode_time > 0 else 0.0,
        "e2e_tok_s": n * batch / run["total_s"],
    }


def aggregate(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {key: median([r[key] for r in runs]) for key in runs[0]}
    out["runs"] = {key: summarize([r[key] for r in runs]) for key in runs[0]}
    return out


def agreement(ours: list[list[int]], hf: list[list[int]], eos: frozenset[int]) -> dict[str, Any]:
    """How far the greedy outputs agree (bf16 may legitimately diverge after a while).

    The two differ by design once a sequence reaches EOS: HF's ``min_new_tokens`` masks EOS
    (the runner-up token is taken), ``ignore_eos`` emits EOS and carries on. So a sequence
    also counts as agreeing when both match up to and including ours' first EOS.
    """
    identical = until_eos = 0
    prefix = []
    for a, b in zip(ours, hf, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        first_eos = next((i for i, t in enumerate(a) if t in eos), len(a))
        identical += k == len(a)
        until_eos += k >= first_eos
        prefix.append(k)
    return {"identical_sequences": identical, "identical_until_eos": until_eos,
            "sequences": len(ours), "mean_common_prefix": sum(prefix) / len(prefix)}


def weight_bytes_per_step(engine: LLMEngine) -> dict[str, Any]:
    """Bytes of weights one decode step reads: every parameter except an untied embedding;
    layers running on 4-bit weights count their packed bytes instead of the dense ones."""
    from quickdraft.engine.models.llama_layers import Linear

    model = engine.runner.model
    params = dict(model.named_parameters())  # a tied lm_head is the same tensor: counted once
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.embed_tokens.numel() * model.embed_tokens.element_size()
    tied = model.shape.tie_word_embeddings
    per_step = total if tied else total - embed
    for module in model.modules():
        if isinstance(module, Linear) and module.use_int4 and module.int4 is not None:
            w = module.int4
            per_step += (w.packed.numel() * w.packed.element_size()
                         + w.scales_and_zeros.numel() * w.scales_and_zeros.element_size()
                         - module.weight.numel() * module.weight.element_size())
    return {"parameter_bytes": total, "bytes_per_step": per_step, "tied_embedding": tied,
            "num_parameters": sum(p.numel() for p in params.values())}
