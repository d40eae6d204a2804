"""A fetched model's Q6_K matrices on the 6-bit x 8-bit loop against bf16, one engine, one
process: which of the matrices a GGUF stores as Q6_K run on the file's own 6-bit blocks
(``kernels/cpu_q4q8_six.h``: AVX2, or VNNI where the CPU has it) and which on their dense
bf16 copies. Arms, alternating sample by sample:

- ``dense``: the LM head, the Q6_K ``down`` matrices and the fused qkv whose ``v`` part is
  Q6_K all in bf16 (before 2026-11-29);
- ``head``: the head on the 6-bit loop;
- ``head+down``: and the ``down`` matrices;
- ``all``: and the stacked qkv (q, k on the 4-bit loop, v on the 6-bit one): what
  ``--weights int4-q8`` serves.

Every other matrix runs on the 4-bit loop in every arm. A step is
``ModelRunner.time_decode(1, context, rows)`` (``rows`` tokens of one sequence: a decode
step for 1, a verification of ``rows - 1`` drafts otherwise). Then each arm's greedy tokens
on three prompts must equal the ``dense`` arm's (the kernels round activations to int8, so
this is a check, not a guarantee: a differing prompt is reported, not hidden).

    python benchmarks/q6_matrices.py [--model qwen2.5-coder-1.5b] [--rows 1,2,4,8]
        [--context 256] [--samples 7] [--tag TAG]

needs the model fetched (``quickdraft models fetch qwen2.5-coder-1.5b``) and the q4q8 kernel;
writes ``benchmarks/results/q6_matrices[_TAG].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
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

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.models.llama_weights import StackedWeight
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels import cpu_q4q8

ARMS = ("dense", "head", "head+down", "all")
PROMPTS = ("Write a Python function that checks whether a string is a palindrome.",
           "Explain what a hash map is in two sentences.",
           "Translate to French: The weather is nice today and we will go to the park.")


class SixBitSwitch:
    """Which of the model's Q6_K matrices run on the 6-bit loop (the others on bf16)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.head = model.lm_head
        self.downs = [layer.mlp.down for layer in model.layers
                      if isinstance(layer.mlp.down.int4, cpu_q4q8.Q6Q8Weight)]
        self.qkvs = [layer.self_attn.qkv for layer in model.layers
                     if isinstance(layer.self_attn.qkv.int4, StackedWeight)]
        self.head_six_bit = isinstance(self.head.int4, cpu_q4q8.Q6Q8Weight)

    def describe(self) -> str:
        return (f"head {'Q6_K' if self.head_six_bit else 'not Q6_K'}, {len(self.downs)} Q6_K "
                f"down, {len(self.qkvs)} qkv with a Q6_K v")

    def set(self, arm: str) -> None:
        self.head.use_int4 = self.head_six_bit and arm != "dense"
        for down in self.downs:
            down.use_int4 = arm in ("head+down", "all")
        for qkv in self.qkvs:
            qkv.use_int4 = arm == "all"
        self.model.use_native_layers(True)  # rebinds: a layer with a dense matrix runs in Python


def greedy_tokens(engine: LLMEngine, tag: str, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs: list[list[int]] = []
    for i, prompt in enumerate(PROMPTS):
        ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request(f"{tag}-{i}", sampling_params=params, prompt_token_ids=ids)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.token_ids
        outputs.append(tokens)
    return outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not cpu_q4q8.available():
        p.error("the q4q8 kernel is not available here (gcc, AVX2/FMA/F16C)")
    engine = LLMEngine(EngineConfig(model=args.model, speculation="off", weights="int4-q8"))
    switch = SixBitSwitch(engine.runner.model)
    print(f"{args.model}: {switch.describe()}", flush=True)
    if not switch.head_six_bit and not switch.downs and not switch.qkvs:
        p.error(f"{args.model} has no Q6_K matrices")
    rows_list = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, int], list[float]] = {(a, r): [] for a in ARMS for r in rows_list}
    for sample in range(args.samples):
        for arm in ARMS if sample % 2 == 0 else ARMS[::-1]:
            switch.set(arm)
            for rows in rows_list:
                times[arm, rows].append(engine.runner.time_decode(1, args.context, rows))
        print(f"sample {sample + 1}/{args.samples}", flush=True)
    ms = {key: 1e3 * median(values) for key, values in times.items()}
    greedy = {}
    for arm in ARMS:
        switch.set(arm)
        greedy[arm] = greedy_tokens(engine, arm, args.max_tokens)
    same = {arm: [a == b for a, b in zip(greedy[arm], greedy["dense"], strict=True)]
            for arm in ARMS}
    table = [[rows, fmt(ms["dense", rows], 1)]
             + [fmt(ms[arm, rows] / ms["dense", rows]) for arm in ARMS[1:]]
             for rows in rows_list]
    info = machine_info()
    suffix = f"_{args.tag}" if args.tag else ""
    write_json({"machine": info, "model": args.model, "matrices": switch.describe(),
                "context": args.context, "samples": args.samples, "arms": list(ARMS),
                "ms": [{"arm": a, "rows": r, "ms": ms[a, r]} for a, r in ms],
                "greedy_equal_to_dense": same}, RESULTS_DIR / f"q6_matrices{suffix}.json")
    fig, ax = new_figure()
    for arm in ARMS:
        ax.plot(rows_list, [ms[arm, r] for r in rows_list], marker="o", label=arm)
    ax.set_xlabel(f"rows (one sequence, after {args.context} positions)")
    ax.set_ylabel("ms a step (median)")
    ax.legend(fontsize=8)
    ax.set_title(f"{args.model}: Q6_K matrices on the 6-bit loop or bf16\n"
                 f"{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"q6_matrices{suffix}.png")
    print(markdown_table(["rows", "dense ms"] + [f"{a} / dense" for a in ARMS[1:]], table))
    for arm in ARMS[1:]:
        print(f"greedy {arm} == dense: {sum(same[arm])}/{len(PROMPTS)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
