"""Decode throughput on a CPU: quickdraft on the GGUF's own 4-bit weights and on dense bf16
weights, HF transformers ``generate``, llama.cpp on the same GGUF, and the bandwidth floor;
plus the cost of a step as its row count grows (what verification costs) and batch-1 decode
beside a busy process.

For each batch size B (default 1, 8, 32) every system generates exactly N tokens (greedy,
EOS ignored) for the same B chat prompts, interleaved, ``--repeats`` times; the median is
reported. llama.cpp (``llama-cpp-python`` in this Python, ``--llama-cpp-python PATH`` or
$QUICKDRAFT_LLAMA_CPP_PYTHON; build recipe in ../shared/PEERS.md) runs batch 1 only, 2
threads, and is skipped with a note when it is not installed. Prefill is timed separately so
that

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
import sys
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
    new_figure,
    save_figure,
    write_json,
)
from decode_extras import (
    decode_beside_busy_process,
    find_llama_cpp_python,
    row_cost_curve,
    run_llama_cpp,
)
from decode_runs import aggregate, agreement, rates, run_hf, run_ours, weight_bytes_per_step

from quickdraft.engine import weight_format
from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.engine.llm_engine import LLMEngine

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


# ---------------------------------------------------------------------- floor


def measure_bandwidth(when: str) -> dict[str, Any]:
    print(f"measuring memory bandwidth ({when} the runs) ...", file=sys.stderr)
    bw = {"when": when, **measure_memory_bandwidth()}
    print(f"  sum {bw['sum_read_gbs']:.1f} GB/s, copy {bw['copy_read_write_gbs']:.1f} GB/s "
          f"-> {bw['best_gbs']:.1f} GB/s ({bw['best_method']})", file=sys.stderr)
    return bw


# ---------------------------------------------------------------------- output

SYSTEMS = {"int4q8": "quickdraft int4-q8 (GGUF blocks, 8-bit activations)",
           "int4": "quickdraft int4 (GGUF blocks, torch kernel)", "bf16": "quickdraft bf16 (dense)",
           "hf": "HF generate bf16"}


def plot(data: dict[str, Any], path: Path, title: str) -> None:
    fig, (ax, ax2) = new_figure(width=11.0, height=4.5, ncols=2)
    results = data["results"]
    bs = [r["batch"] for r in results]
    for i, (key, label) in enumerate(SYSTEMS.items()):
        if all(key in r for r in results):
            ax.plot(bs, [r[key]["decode_tok_s"] for r in results], "o-", color=f"C{i}",
                    label=label)
    if data.get("llama_cpp", {}).get("decode_tok_s"):
        ax.plot([1], [data["llama_cpp"]["decode_tok_s"]], "D", color="C3",
                label="llama.cpp (same GGUF, batch 1)")
    ax.plot(bs, [r["floor_tok_s"] for r in results], "--", color="grey",
            label="bandwidth floor (bf16 weights)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs)
    ax.set_xticklabels([str(b) for b in bs])
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("decode tokens / s (all sequences)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for i, (key, curve) in enumerate(data["row_cost"].items()):
        ax2.plot(curve["rows"], curve["ratio"], "o-", color=f"C{i}", label=SYSTEMS[key])
    ax2.plot([1, 2, 4, 8], [1.0, 1.15, 1.3, 1.7], "k:", label="goal")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("rows in the step (1 + drafts)")
    ax2.set_ylabel("step time / 1-row step time")
    ax2.set_title("cost of verification rows, batch-1 sequence", fontsize=9)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7)
    save_figure(fig, path)


def tables(data: dict[str, Any]) -> str:
    results, present = data["results"], [k for k in SYSTEMS if k in data["results"][0]]
    q = next((k for k in ("int4q8", "int4") if k in present), "int4")  # the fastest 4-bit
    main = markdown_table(
        ["batch", *[f"{SYSTEMS[k]} tok/s" for k in present], f"{q}/bf16", f"{q}/HF", "floor"],
        [[r["batch"], *[r[k]["decode_tok_s"] for k in present],
          r[q]["decode_tok_s"] / r["bf16"]["decode_tok_s"] if q in r and "bf16" in r else None,
          r[q]["decode_tok_s"] / r["hf"]["decode_tok_s"] if q in r and "hf" in r else None,
          r["floor_tok_s"]] for r in results])
    lc = data["llama_cpp"]
    peer = (f"llama.cpp {lc['version']} (same GGUF, {lc['threads']} threads), batch 1: "
            f"{fmt(lc['decode_tok_s'])} tok/s; quickdraft {q} / llama.cpp = "
            f"{fmt(results[0][q]['decode_tok_s'] / lc['decode_tok_s'])}"
            if lc.get("decode_tok_s") and q in results[0] else
            f"llama.cpp: {lc.get('skipped', 'not run')}")
    rows = next(iter(data["row_cost"].values()))["rows"]
    curve = markdown_table(
        ["weights", *[f"{k} rows" for k in rows]],
        [[SYSTEMS[key], *[f"{ms:.2f} ms ({ratio:.2f}x)" for ms, ratio in
                          zip(c["ms"], c["ratio"], strict=True)]]
         for key, c in data["row_cost"].items()])
    cont = data["contention"]
    if not cont:
        return (f"Decode tok/s (prefill excluded):\n\n{main}\n\n{peer}\n\nStep cost by rows:"
                f"\n\n{curve}")
    busy = markdown_table(
        ["engine", "idle tok/s", "busy tok/s", "busy/idle", "longest gap busy ms",
         "TTFT idle ms", "TTFT busy ms"],
        [[name, cont["idle"][name]["decode_tok_s"], cont["busy"][name]["decode_tok_s"],
          cont["ratio"][name], cont["busy"][name]["max_gap_ms"], cont["idle"][name]["ttft_ms"],
          cont["busy"][name]["ttft_ms"]] for name in cont["idle"]])
    return (f"Decode tok/s (prefill excluded):\n\n{main}\n\n{peer}\n\nStep cost by rows:\n\n"
            f"{curve}\n\nBatch-1 decode beside `{cont['competitor']}`:\n\n{busy}")


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batch-sizes", default="1,8,32",
                   help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="a .gguf (default: the embedded one)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF generate")
    p.add_argument("--llama-cpp-python", default=None,
                   help="a Python with llama-cpp-python installed (default: "
                   "$QUICKDRAFT_LLAMA_CPP_PYTHON, then this one)")
    p.add_argument("--rows", default="1,2,4,8,16", help="row counts of the step-cost curve")
    p.add_argument("--no-contention", dest="contention", action="store_false",
                   help="skip decode beside a busy process (it loads one more engine)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be positive integers")
    if max(args.batch_sizes) > len(PROMPTS):
        p.error(f"at most {len(PROMPTS)} sequences (one per built-in prompt)")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (decode excludes the first token)")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def _engine(args: argparse.Namespace, weights: str, **kw: Any) -> LLMEngine | None:
    config = EngineConfig(model=args.model, dtype="bfloat16", speculation="off",
                          max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=2048,
                          weights=weights, measure_step_cost=False, **kw)
    try:
        return LLMEngine(config, progress=False)
    except ConfigError as exc:
        print(f"skipping --weights {weights}: {exc}", file=sys.stderr)
        return None


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

    engines = {k: e for k, e in (("int4q8", _engine(args, "int4-q8")),
                                 ("int4", _engine(args, "int4")),
                                 ("bf16", _engine(args, "dense"))) if e is not None}
    base = next(iter(engines.values()))
    model_dir = base.info.model_dir
    hf = None
    if args.hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    pad_id = base.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = min(base.eos_token_ids)
    prompts = [base.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]

    for b in tqdm(sizes, desc="warm-up", leave=False):
        for key, engine in engines.items():
            run_ours(engine, prompts[:b], 4, f"warm{key}{b}")
        if hf is not None:
            run_hf(hf, prompts[:b], 4, pad_id)

    results = []
    per_batch = len(engines) + (hf is not None)
    bar = tqdm(total=len(sizes) * args.repeats * per_batch, desc="decode", unit="run")
    for b in sizes:
        runs: dict[str, list[dict[str, float]]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(args.repeats):
            for key, engine in engines.items():
                bar.set_postfix_str(f"batch {b}, repeat {r + 1}, {key}")
                out = run_ours(engine, prompts[:b], n, f"b{b}r{r}{key}")
                runs.setdefault(key, []).append(rates(out, b, n))
                tokens.setdefault(key, out["tokens"])
                bar.update()
            if hf is not None:
                bar.set_postfix_str(f"batch {b}, repeat {r + 1}, HF")
                out = run_hf(hf, prompts[:b], n, pad_id)
                runs.setdefault("hf", []).append(rates(out, b, n))
                tokens.setdefault("hf", out["tokens"])
                bar.update()
        row: dict[str, Any] = {"batch": b, **{k: aggregate(v) for k, v in runs.items()}}
        if "int4" in tokens and "bf16" in tokens:
            row["greedy_agreement_int4_vs_bf16"] = agreement(tokens["int4"], tokens["bf16"],
                                                             base.eos_token_ids)
        results.append(row)
        bar.write(f"batch {b}: " + ", ".join(f"{k} {fmt(row[k]['decode_tok_s'])} tok/s"
                                              for k in runs))
    bar.close()

    llama: dict[str, Any] = {}
    python = find_llama_cpp_python(args.llama_cpp_python)
    source = weight_format.gguf_source(Path(model_dir))
    if python is None:
        llama["skipped"] = ("llama-cpp-python is not installed (recipe in ../shared/PEERS.md; "
                            "--llama-cpp-python PATH)")
    elif source is None:
        llama["skipped"] = "the model is not a GGUF"
    else:
        print("llama.cpp, batch 1 ...", file=sys.stderr)
        llama = run_llama_cpp(python, source, prompts[:6], n, args.repeats,
                              threads=info["usable_cores"])
    print(f"llama.cpp: {llama}", file=sys.stderr)

    print("step cost by rows ...", file=sys.stderr)
    row_cost = {key: row_cost_curve(engine, args.rows) for key, engine in engines.items()}
    contention: dict[str, Any] = {}
    if args.contention:
        print("decode beside a busy process ...", file=sys.stderr)
        key = next(k for k in ("int4q8", "int4", "bf16") if k in engines)
        fixed = _engine(args, {"int4q8": "int4-q8", "int4": "int4", "bf16": "dense"}[key],
                        num_threads=info["usable_cores"])
        assert fixed is not None
        contention = decode_beside_busy_process(
            {f"{key}, adaptive threads": engines[key], f"{key}, fixed threads": fixed},
            prompts[:3], n, repeats=args.repeats)

    bandwidth_runs.append(measure_bandwidth("after"))
    bandwidth = max(bandwidth_runs, key=lambda m: m["best_gbs"])
    weights = weight_bytes_per_step(engines.get("bf16", base))
    floor_b1 = bandwidth["best_gbs"] * 1e9 / weights["bytes_per_step"]
    for row in results:
        row["floor_tok_s"] = row["batch"] * floor_b1
    lengths = [len(p) for p in prompts]
    data = {
        "benchmark": "decode",
        "machine": info,
        "config": {
            "model": args.model, "model_dir": model_dir, "batch_sizes": sizes,
            "max_new_tokens": n, "repeats": args.repeats, "greedy": True, "ignore_eos": True,
            "weights": {k: e.runner.weights.describe() for k, e in engines.items()},
            "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                              "mean": sum(lengths) / len(lengths)},
        },
        "metrics": {
            "decode_tok_s": "(max_new_tokens - 1) * batch / (total_s - prefill_s), median",
            "row_cost": "one sequence, context 64, k new tokens all scored; median of 9",
            "contention": "batch-1 decode of 3 prompts x repeats, idle then beside a busy "
                          "process; max_gap_ms is the longest time between two tokens",
        },
        "floor": {"bandwidth": bandwidth, "bandwidth_measurements": bandwidth_runs, **weights,
                  "floor_tok_s_batch1": floor_b1,
                  "int4_bytes_per_step": weight_bytes_per_step(engines["int4"])
                  ["bytes_per_step"] if "int4" in engines else None},
        "results": results,
        "llama_cpp": llama,
        "row_cost": row_cost,
        "contention": contention,
    }
    out_dir = Path(args.out_dir)
    json_path = write_json(data, out_dir / "decode.json")
    png_path = out_dir / "decode.png"
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    plot(data, png_path, f"Decode, {name}, {n} new tokens\n{info['cpu_model']}, "
         f"{info['usable_cores']} cores, {' '.join(info.get('cpu_flags', []))}")
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    print(f"\nbandwidth {bandwidth['best_gbs']:.1f} GB/s -> floor {floor_b1:.0f} tok/s at "
          f"batch 1 with bf16 weights\n")
    print(tables(data))


if __name__ == "__main__":
    main()
