"""Parts of ``benchmarks/decode.py`` beside the main throughput table: llama.cpp on the same
GGUF, the cost of a step as its row count grows, and decode beside a busy process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import median, summarize
from decode_runs import rates, run_ours

from quickdraft.engine.llm_engine import LLMEngine

# Runs inside the peer's own Python (llama-cpp-python lives in its own venv, see
# ../shared/PEERS.md): greedy decode of each prompt at batch 1, timed per token.
_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
model, n, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.stdin.read())
llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
            verbose=False)
runs = []
for r in range(repeats + 1):  # the first pass warms up
    for ids in prompts:
        llm.reset()
        start = time.perf_counter(); first = None; got = 0
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got += 1
            now = time.perf_counter()
            if first is None:
                first = now - start
            if got == n:
                break
        total = time.perf_counter() - start
        if r:
            runs.append({"prefill_s": first, "total_s": total, "tokens": got})
print(json.dumps({"runs": runs, "version": __import__("llama_cpp").__version__}))
"""


def find_llama_cpp_python(explicit: str | None) -> str | None:
    """A Python that imports llama_cpp: ``--llama-cpp-python``, $QUICKDRAFT_LLAMA_CPP_PYTHON,
    or this one; None when none does."""
    for candidate in (explicit, os.environ.get("QUICKDRAFT_LLAMA_CPP_PYTHON"), sys.executable):
        if (candidate and shutil.which(candidate)) or (candidate and Path(candidate).is_file()):
            ok = subprocess.run([candidate, "-c", "import llama_cpp"], capture_output=True,
                                timeout=120)
            if ok.returncode == 0:
                return candidate
    return None


def run_llama_cpp(python: str, gguf: Path, prompts: list[list[int]], n: int, repeats: int,
                  threads: int) -> dict[str, Any]:
    """llama.cpp's decode tok/s at batch 1 on ``prompts`` (median over prompts and repeats)."""
    out = subprocess.run([python, "-c", _LLAMA_CPP_SCRIPT, str(gguf), str(n), str(repeats),
                          str(threads)], input=json.dumps(prompts), capture_output=True,
                         text=True, timeout=1800, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    per_run = [rates({"prefill_s": r["prefill_s"], "total_s": r["total_s"]}, 1, r["tokens"])
               for r in data["runs"]]
    return {"decode_tok_s": median([r["decode_tok_s"] for r in per_run]),
            "prefill_s": median([r["prefill_s"] for r in per_run]),
            "runs": summarize([r["decode_tok_s"] for r in per_run]),
            "version": data["version"], "threads": threads}


def row_cost_curve(engine: LLMEngine, rows: list[int], repeats: int = 9,
                   context: int = 64) -> dict[str, Any]:
    """Median ms of one step with ``k`` new tokens of one sequence (a verification step of
    k - 1 drafts) after ``context`` cached ones, every row scored, and its ratio to k = 1."""
    runner = engine.runner
    for k in rows:  # warm-up
        runner.time_decode(1, context, k)
    ms = {k: median([runner.time_decode(1, context, k) * 1e3 for _ in range(repeats)])
          for k in rows}
    return {"rows": rows, "ms": [ms[k] for k in rows],
            "ratio": [ms[k] / ms[rows[0]] for k in rows], "context": context}


def decode_beside_busy_process(engines: dict[str, LLMEngine], prompts: list[list[int]], n: int,
                               repeats: int) -> dict[str, Any]:
    """Batch-1 decode idle, then beside ``python -c "while True: pass"``, for each engine;
    tok/s and the longest gap between two tokens, medians over prompts x repeats."""
    def measure(tag: str) -> dict[str, dict[str, Any]]:
        out = {}
        for name, engine in engines.items():
            runs = [rates(run_ours(engine, [p], n, f"{tag}{name}{i}{r}"), 1, n)
                    for r in range(repeats) for i, p in enumerate(prompts)]
            out[name] = {"decode_tok_s": median([r["decode_tok_s"] for r in runs]),
                         "max_gap_ms": max(r["max_gap_ms"] for r in runs),
                         "ttft_ms": median([r["prefill_s"] * 1e3 for r in runs]),
                         "threads": engine.threads.describe()}
        return out

    idle = measure("idle")
    busy_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        busy = measure("busy")
    finally:
        busy_proc.kill()
        busy_proc.wait()
    return {"idle": idle, "busy": busy,
            "ratio": {k: busy[k]["decode_tok_s"] / idle[k]["decode_tok_s"] for k in idle},
            "competitor": 'python -c "while True: pass"'}
