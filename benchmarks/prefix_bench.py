"""Prefix-cache benchmark: TTFT with a shared ~1,000-token system prompt and in multi-turn chat.

1. Shared system prompt: ``--questions`` requests, one at a time, each the same ~1,000-token
   system prompt plus a different short question. "cold" = an engine with the prefix cache
   off (every request computes the whole prompt); "warm" = the cache on, after one priming
   request. TTFT = wall time from ``add_request`` to the step that returns the first token.
   Goal: warm <= 0.2x cold.
2. Multi-turn chat: a 5-turn conversation (fixed user turns, greedy assistant answers of at
   most ``--answer-tokens`` tokens that are appended to the history). TTFT of each turn with
   the cache on vs off. Goal: turn 5 with the cache <= 0.3x without.

Both engines are built once in the same process (same weights, same settings except the
cache); every figure is the median of ``--repeats`` runs. Writes
``benchmarks/results/prefix_bench.json`` and ``.png`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    median,
    new_figure,
    save_figure,
    write_json,
)

from quickdraft.engine.config import DTYPES, EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

SYSTEM = ("You are the support assistant of the Riverside Public Library. Policies: members "
          "may borrow up to five books for three weeks; renewals are allowed twice unless "
          "another member has reserved the item; late fees are ten cents a day, capped at the "
          "price of the item; lost cards cost two dollars to replace; the reading room is "
          "silent; laptops may use the guest network; printing costs fifteen cents a page. ")
QUESTIONS = ["How many books can I borrow?", "What does a lost card cost?",
             "Can I renew a reserved book?", "How much is printing?", "Is there wifi?",
             "What are the late fees?", "Where can I read quietly?", "How long is a loan?"]
TURNS = ["Tell me about the library's loan rules.", "And what about renewals?",
         "What happens if I return a book late?", "Can I print there?",
         "Summarise everything you told me in two sentences."]


def ttft(engine: LLMEngine, ids: list[int], rid: str, max_tokens: int = 1,
         ) -> tuple[float, list[int]]:
    """Seconds to the first token, and the tokens (running to ``max_tokens``)."""
    start = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=ids,
                       sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    first: float | None = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_ids and first is None:
                first = time.perf_counter() - start
            tokens += out.token_ids
    assert first is not None
    return first, tokens


def system_prompt(engine: LLMEngine, target_tokens: int) -> str:
    text = SYSTEM
    while len(engine.tokenizer.encode(text)) < target_tokens:
        text += SYSTEM
    return text


def shared_prompt(engines: dict[str, LLMEngine], args: argparse.Namespace) -> dict[str, Any]:
    system = system_prompt(engines["on"], args.system_tokens)
    prompts = [engines["on"].apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in QUESTIONS[:args.questions]]
    result: dict[str, Any] = {"prompt_tokens": len(prompts[0])}
    for mode, engine in engines.items():
        times = []
        for r in range(args.repeats):
            if mode == "on":  # prime: the first request of the system prompt is cold
                ttft(engine, prompts[0], f"prime-{r}")
            times.append(median([ttft(engine, p, f"{mode}-{r}-{i}")[0]
                                 for i, p in enumerate(prompts)]))
        result[mode] = {"ttft_s": median(times), "runs": times}
    result["ratio"] = result["on"]["ttft_s"] / result["off"]["ttft_s"]
    return result


def multi_turn(engines: dict[str, LLMEngine], args: argparse.Namespace) -> dict[str, Any]:
    system = system_prompt(engines["on"], args.system_tokens // 4)
    per_mode: dict[str, list[list[float]]] = {m: [] for m in engines}
    lengths: list[int] = []
    for r in range(args.repeats):
        for mode, engine in engines.items():
            # A fresh conversation: its first turn shares nothing with earlier ones.
            history = [{"role": "system", "content": f"Conversation {r}-{mode}. {system}"}]
            times = []
            for t, user in enumerate(TURNS):
                history.append({"role": "user", "content": user})
                ids = engine.apply_chat_template(history)
                seconds, tokens = ttft(engine, ids, f"mt-{mode}-{r}-{t}", args.answer_tokens)
                times.append(seconds)
                history.append({"role": "assistant",
                                "content": engine.tokenizer.decode(tokens,
                                                                   skip_special_tokens=True)})
                if r == 0 and mode == "on":
                    lengths.append(len(ids))
            per_mode[mode].append(times)
    turns = [{"turn": t + 1, "prompt_tokens": lengths[t],
              **{m: median([run[t] for run in per_mode[m]]) for m in engines}}
             for t in range(len(TURNS))]
    for row in turns:
        row["ratio"] = row["on"] / row["off"]
    return {"turns": turns, "runs": per_mode}


def plot(shared: dict[str, Any], turns: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax1 = new_figure(10.0, 4.2)
    ax1.remove()
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    bars = ax1.bar(["cache off (cold)", "cache on (warm)"],
                   [1000 * shared["off"]["ttft_s"], 1000 * shared["on"]["ttft_s"]],
                   color=["C0", "C1"])
    ax1.bar_label(bars, fmt="%.0f ms")
    ax1.set_ylabel("median TTFT (ms)")
    ax1.set_title(f"{shared['prompt_tokens']}-token shared system prompt", fontsize=9)
    xs = [row["turn"] for row in turns]
    ax2.plot(xs, [1000 * row["off"] for row in turns], "o-", label="cache off")
    ax2.plot(xs, [1000 * row["on"] for row in turns], "o-", label="cache on")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("multi-turn chat", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    info = machine_info()
    print(f"machine: {machine_summary(info)}", file=sys.stderr)
    engines = {mode: LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, speculation="off",
        enable_prefix_caching=mode == "on", max_num_batched_tokens=2048), progress=False)
        for mode in ("off", "on")}
    ttft(engines["off"], engines["off"].apply_chat_template(
        [{"role": "user", "content": "warm up"}]), "warm")
    shared = shared_prompt(engines, args)
    turns = multi_turn(engines, args)
    data = {"benchmark": "prefix_bench", "machine": info, "config": vars(args) | {
        "out_dir": str(args.out_dir)}, "shared_system_prompt": shared, "multi_turn": turns}
    json_path = write_json(data, args.out_dir / "prefix_bench.json")
    png_path = args.out_dir / "prefix_bench.png"
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    plot(shared, turns["turns"], png_path, f"prefix cache, {name} {args.dtype}, "
         f"{info['cpu_model']}, {info['usable_cores']} cores")
    print(f"wrote {json_path} and {png_path}\n", file=sys.stderr)
    print(markdown_table(["workload", "cache off TTFT ms", "cache on TTFT ms", "ratio"], [
        [f"shared {shared['prompt_tokens']}-token system prompt",
         1000 * shared["off"]["ttft_s"], 1000 * shared["on"]["ttft_s"], shared["ratio"]],
        *[[f"multi-turn, turn {row['turn']} ({row['prompt_tokens']} tokens)",
           1000 * row["off"], 1000 * row["on"], row["ratio"]] for row in turns["turns"]]]))
    print(f"\nwarm/cold: {fmt(shared['ratio'])} (goal <= 0.2); turn 5: "
          f"{fmt(turns['turns'][-1]['ratio'])} (goal <= 0.3)")


if __name__ == "__main__":
    main()
