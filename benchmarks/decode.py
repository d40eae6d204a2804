"""Decode throughput: our engine vs HF transformers ``generate`` vs the memory-bandwidth floor.

For each batch size B (default 1, 4, 16, 32) both engines generate exactly N tokens
(greedy, EOS ignored) for the same B chat prompts, one after the other, ``--repeats`` times;
the median is reported. Prefill is timed separately so that

    decode tok/s     = (N - 1) * B / (total - prefill)
    end-to-end tok/s = N * B / total

Ours: prefill = time until every request has produced its first token (one step when all
prompts fit in ``max_num_batched_tokens``). HF: prefill = a ``generate`` with
``max_new_tokens=1`` on the same padded batch (static batching, left padding).

The floor (a floor on step time, so a ceiling on tok/s): a decode step must stream every
weight it uses from memory once (the linear layers and the LM head; the embedding lookup
reads one row, a tied embedding is counted once as the LM head):
``floor tok/s = B * bandwidth / bytes_per_step``; KV-cache reads are left out.
Bandwidth is the median of 7 ``sum`` (read) and ``copy`` (read + write) passes over a 512 MB
buffer, measured before and after the runs; the best method of the better measurement is used.

Run: ``python benchmarks/decode.py`` (a few minutes on a small CPU); writes
``benchmarks/results/decode.json`` and ``decode.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    measure_memory_bandwidth,
    median,
    new_figure,
    save_figure,
    summarize,
    write_json,
)

from engine.config import DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one paragraph.",
    "Give me three tips for better sleep.",
    "What is a prime number?",
    "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "List five fruits that are red.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop.",
    "How do I boil an egg?",
    "What does a compiler do?",
    "Tell me a fun fact about octopuses.",
    "Explain gravity to a five-year-old.",
    "What is the tallest mountain in the world?",
    "Write a limerick about a programmer.",
    "How many continents are there?",
    "What is machine learning?",
    "Give me a recipe for pancakes.",
    "Why do leaves change color in the fall?",
    "What is the speed of light?",
    "Describe the water cycle.",
    "Write a two-sentence horror story.",
    "What are the primary colors?",
    "How do vaccines work?",
    "Name three famous painters.",
    "What is the Pythagorean theorem?",
]


# ---------------------------------------------------------------------- runs


def run_ours(engine: LLMEngine, prompts: list[list[int]], n: int, tag: str) -> dict[str, Any]:
    """One batch through our engine: all requests added at once, stepped to completion."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    steps = 0
    first: float | None = None
    start = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        engine.add_request(rid, sampling_params=params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens[out.request_id].extend(out.token_ids)
        steps += 1
        if first is None and all(tokens[r] for r in rids):
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    counts = {len(t) for t in tokens.values()}
    if counts != {n}:
        raise RuntimeError(f"ours generated {sorted(counts)} tokens per request, expected {n}")
    assert first is not None
    return {"prefill_s": first, "total_s": total, "steps": steps,
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
    return {
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


# ---------------------------------------------------------------------- floor


def weight_bytes_per_step(engine: LLMEngine) -> dict[str, Any]:
    """Bytes of weights one decode step reads: all parameters except an untied embedding."""
    model = engine.runner.model
    params = dict(model.named_parameters())  # a tied lm_head is the same tensor: counted once
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.embed_tokens.numel() * model.embed_tokens.element_size()
    tied = model.shape.tie_word_embeddings
    per_step = total if tied else total - embed
    return {"parameter_bytes": total, "bytes_per_step": per_step, "tied_embedding": tied,
            "num_parameters": sum(p.numel() for p in params.values())}


def measure_bandwidth(when: str) -> dict[str, Any]:
    print(f"measuring memory bandwidth ({when} the runs) ...", file=sys.stderr)
    bw = {"when": when, **measure_memory_bandwidth()}
    print(f"  sum {bw['sum_read_gbs']:.1f} GB/s, copy {bw['copy_read_write_gbs']:.1f} GB/s "
          f"-> {bw['best_gbs']:.1f} GB/s ({bw['best_method']})", file=sys.stderr)
    return bw


# ---------------------------------------------------------------------- output


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = new_figure()
    bs = [r["batch"] for r in results]
    ax.plot(bs, [r["ours"]["decode_tok_s"] for r in results], "o-", color="C0",
            label="quickdraft (decode)")
    ax.plot(bs, [r["hf"]["decode_tok_s"] for r in results], "s-", color="C1",
            label="HF generate, static batch (decode)")
    ax.plot(bs, [r["ours"]["e2e_tok_s"] for r in results], "o:", color="C0", alpha=0.5,
            label="quickdraft (end-to-end)")
    ax.plot(bs, [r["hf"]["e2e_tok_s"] for r in results], "s:", color="C1", alpha=0.5,
            label="HF (end-to-end)")
    ax.plot(bs, [r["floor_tok_s"] for r in results], "--", color="grey",
            label="memory-bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs)
    ax.set_xticklabels([str(b) for b in bs])
    ax.set_xlabel("concurrent sequences (batch size)")
    ax.set_ylabel("generated tokens / s (all sequences)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def tables(results: list[dict[str, Any]]) -> str:
    main = markdown_table(
        ["batch", "ours tok/s", "HF tok/s", "ours/HF", "floor", "ours/floor"],
        [[r["batch"], r["ours"]["decode_tok_s"], r["hf"]["decode_tok_s"],
          r["ours"]["decode_tok_s"] / r["hf"]["decode_tok_s"], r["floor_tok_s"],
          r["ours"]["decode_tok_s"] / r["floor_tok_s"]] for r in results])
    extra = markdown_table(
        ["batch", "ours TTFT s", "HF TTFT s", "ours e2e tok/s", "HF e2e tok/s", "ours/HF e2e"],
        [[r["batch"], r["ours"]["prefill_s"], r["hf"]["prefill_s"], r["ours"]["e2e_tok_s"],
          r["hf"]["e2e_tok_s"], r["ours"]["e2e_tok_s"] / r["hf"]["e2e_tok_s"]]
         for r in results])
    return f"Decode tok/s (prefill excluded):\n\n{main}\n\nPrefill and end-to-end:\n\n{extra}"


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batch-sizes", default="1,4,16,32",
                   help="comma-separated batch sizes (default 1,4,16,32)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded)")
    p.add_argument("--speculation", default="off", choices=["off", "ngram"],
                   help="our engine's speculation (default off: plain decoding vs plain HF)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be positive integers")
    if max(args.batch_sizes) > len(PROMPTS):
        p.error(f"at most {len(PROMPTS)} sequences (one per built-in prompt)")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (decode excludes the first token)")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    n, sizes = args.max_new_tokens, args.batch_sizes
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)

    bandwidth_runs = [measure_bandwidth("before")]

    extra = {}
    if "speculation" in {f.name for f in dataclasses.fields(EngineConfig)}:
        extra["speculation"] = args.speculation
    elif args.speculation != "off":
        raise SystemExit("this engine build has no speculation setting")
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(sizes),
                          max_num_batched_tokens=2048, **extra)
    start = time.perf_counter()
    engine = LLMEngine(config, progress=False)
    ours_load = time.perf_counter() - start
    model_dir = engine.info.model_dir
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype])
    hf.eval()
    hf_load = time.perf_counter() - start
    pad_id = engine.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = min(engine.eos_token_ids)
    print(f"loaded {model_dir} ({args.dtype}): ours {ours_load:.1f}s, HF {hf_load:.1f}s",
          file=sys.stderr)

    weights = weight_bytes_per_step(engine)
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]

    # warm up both (allocator, oneDNN kernels) at every batch size with a short run
    for b in tqdm(sizes, desc="warm-up", leave=False):
        run_ours(engine, prompts[:b], 4, f"warm{b}")
        run_hf(hf, prompts[:b], 4, pad_id)

    results = []
    bar = tqdm(total=len(sizes) * args.repeats * 2, desc="decode benchmark", unit="run")
    for b in sizes:
        ours_runs, hf_runs = [], []
        check: dict[str, Any] = {}
        for r in range(args.repeats):
            bar.set_postfix_str(f"batch {b}, repeat {r + 1}, ours")
            ours = run_ours(engine, prompts[:b], n, f"b{b}r{r}")
            ours_runs.append(rates(ours, b, n))
            bar.update()
            bar.set_postfix_str(f"batch {b}, repeat {r + 1}, HF")
            hfr = run_hf(hf, prompts[:b], n, pad_id)
            hf_runs.append(rates(hfr, b, n))
            bar.update()
            if r == 0:
                check = agreement(ours["tokens"], hfr["tokens"], engine.eos_token_ids)
                check["ours_steps"] = ours["steps"]
        paired = [o["decode_tok_s"] / h["decode_tok_s"] for o, h in zip(ours_runs, hf_runs,
                                                                          strict=True)]
        row = {"batch": b, "ours": aggregate(ours_runs), "hf": aggregate(hf_runs),
               "greedy_agreement": check, "paired_decode_ratio": summarize(paired)}
        results.append(row)
        bar.write(f"batch {b}: ours {fmt(row['ours']['decode_tok_s'])} tok/s, "
                  f"HF {fmt(row['hf']['decode_tok_s'])} tok/s")
    bar.close()

    # a second measurement after the runs: on a shared machine the load drifts; the higher
    # of the two medians is the better estimate of what the memory system can deliver
    bandwidth_runs.append(measure_bandwidth("after"))
    bandwidth = max(bandwidth_runs, key=lambda m: m["best_gbs"])
    floor_b1 = bandwidth["best_gbs"] * 1e9 / weights["bytes_per_step"]
    for row in results:
        row["floor_tok_s"] = row["batch"] * floor_b1

    lengths = [len(p) for p in prompts]
    data = {
        "benchmark": "decode",
        "machine": info,
        "config": {
            "model": args.model, "model_dir": model_dir, "architecture": engine.info.architecture,
            "dtype": args.dtype, "speculation": args.speculation,
            "batch_sizes": sizes, "max_new_tokens": n,
            "repeats": args.repeats, "greedy": True, "ignore_eos": True,
            "engine": {"max_num_seqs": config.max_num_seqs,
                       "max_num_batched_tokens": config.max_num_batched_tokens,
                       "block_size": config.block_size, "attention_backend": "torch reference"},
            "hf": {"generate": "static batch, left padding", "attention":
                   getattr(hf.config, "_attn_implementation", None)},
            "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                              "mean": sum(lengths) / len(lengths)},
            "load_s": {"ours": ours_load, "hf": hf_load},
        },
        "metrics": {
            "decode_tok_s": "(max_new_tokens - 1) * batch / (total_s - prefill_s)",
            "e2e_tok_s": "max_new_tokens * batch / total_s",
            "prefill_s": "ours: until every request has its first token; "
                         "HF: generate(max_new_tokens=1)",
            "aggregation": f"median of {args.repeats} repeats",
            "paired_decode_ratio": "ours/HF decode tok/s of each repeat (run back to back), "
                                   "less sensitive to machine load drifting between repeats",
        },
        "floor": {"bandwidth": bandwidth, "bandwidth_measurements": bandwidth_runs, **weights,
                  "floor_tok_s_batch1": floor_b1,
                  "note": "batch B floor = B * floor_tok_s_batch1; weights read once per step, "
                          "KV-cache reads ignored"},
        "results": results,
    }
    out_dir = Path(args.out_dir)
    json_path = write_json(data, out_dir / "decode.json")
    png_path = out_dir / "decode.png"
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    plot(results, png_path, f"Decode throughput, {name} {args.dtype}, "
         f"{n} new tokens\n{info['cpu_model']}, {info['usable_cores']} cores")
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    print(f"\nbandwidth {bandwidth['best_gbs']:.1f} GB/s ({bandwidth['best_method']}, "
          f"{bandwidth['when']} the runs), "
          f"{weights['bytes_per_step'] / 1e6:.1f} MB of weights per step -> "
          f"floor {floor_b1:.0f} tok/s at batch 1\n")
    print(tables(results))


if __name__ == "__main__":
    main()
