"""In-engine A/B of the CPU attention kernel: this checkout's ``kernels/cpu_attention.c``
against the same file at another git revision, inside one engine, on whole target steps.

Both versions are built with the kernel's own flags; the native decoder layer's attention is
switched between them before every timing (``kernels.cpu_layer.use_attention_kernel``), the
two alternate within each repeat, and a case's figure is the median over repeats of the
per-repeat ratio new / old. So machine drift (this 2-core VM's memory bandwidth moves by
10-20 % between minutes) hits both alike. Cases are ``(sequences, cached positions, rows
each)``: decode steps (1 row), verification steps (1 + drafts rows) and prefill chunks
(0 cached positions).

    python benchmarks/attention_ab.py --baseline 1b26f57 [--repeats 15] [--tag attn]
        [--cases 1x100x1,8x768x2]   (sequences x cached positions x rows; default CASES)

writes ``benchmarks/results/attention_ab[_TAG].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

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
from quickdraft.kernels import cbuild, cpu_attention, cpu_layer

ROOT = Path(__file__).resolve().parents[1]
CASES = [(1, 256, 1), (1, 768, 1), (1, 2048, 1), (8, 64, 1), (8, 768, 1),  # decode
         (1, 768, 5), (1, 2048, 4), (8, 300, 3), (8, 768, 2), (8, 768, 4),  # verification
         (1, 0, 256), (1, 512, 256)]                                    # prefill chunks


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``"1x256x1,8x64x1"`` -> ``[(1, 256, 1), (8, 64, 1)]``."""
    cases = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1 \
                or int(parts[2]) < 1:
            raise argparse.ArgumentTypeError(f"not SEQUENCESxPOSITIONSxROWS: {item!r}")
        cases.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return cases


def build_baseline(rev: str) -> ctypes.CDLL:
    """``kernels/cpu_attention.c`` (and the headers beside it) as of ``rev``, built and
    loaded under its own cache name."""
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name.endswith((".c", ".h")):
                text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True,
                                      capture_output=True).stdout
                (Path(tmp) / Path(name).name).write_bytes(text)
        source = cbuild.read_source(Path(tmp) / "cpu_attention.c")
    path = cbuild.build("cpu_attention_ab", source, cpu_attention._CFLAGS, "gcc")
    return ctypes.CDLL(str(path))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="git revision of the old kernel")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tag", default="")
    p.add_argument("--cases", type=parse_cases, default=CASES,
                   help="comma-separated SEQUENCESxPOSITIONSxROWS (default: the built-in set)")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(max_num_seqs=8, measure_step_cost=False))
    if not cpu_layer.available():
        p.error("the native decoder layer is not available here")
    old_lib = build_baseline(args.baseline)
    old = ctypes.cast(old_lib.qd_write_kv_attention_bf16, ctypes.c_void_p).value
    kernels = {"old": old, "new": None}
    runner = engine.runner
    rows, data = [], []
    for batch, context, width in args.cases:
        times: dict[str, list[float]] = {"old": [], "new": []}
        for rep in range(args.repeats + 2):  # the first two warm up
            order = ("old", "new") if rep % 2 == 0 else ("new", "old")
            for name in order:
                cpu_layer.use_attention_kernel(kernels[name])
                seconds = runner.time_decode(batch, context, width)
                if rep >= 2:
                    times[name].append(seconds)
        cpu_layer.use_attention_kernel(None)
        ratio = median([n / o for o, n in zip(times["old"], times["new"], strict=True)])
        entry = {"sequences": batch, "context": context, "rows": width,
                 "old_ms": median(times["old"]) * 1e3, "new_ms": median(times["new"]) * 1e3,
                 "ratio": ratio}
        data.append(entry)
        rows.append([batch, context, width, fmt(entry["old_ms"], 2), fmt(entry["new_ms"], 2),
                     fmt(ratio)])
        print(f"{batch} x {context} x {width}: {entry['old_ms']:.2f} -> "
              f"{entry['new_ms']:.2f} ms ({ratio:.3f})", flush=True)
    info = machine_info()
    suffix = f"_{args.tag}" if args.tag else ""
    write_json({"machine": info, "baseline": args.baseline, "repeats": args.repeats,
                "cases": data}, RESULTS_DIR / f"attention_ab{suffix}.json")
    fig, ax = new_figure(8.0, 4.5)
    labels = [f"{e['sequences']}x{e['context']}\n{e['rows']} row(s)" for e in data]
    ax.bar(range(len(data)), [e["ratio"] for e in data], color="tab:blue")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(data)), labels, fontsize=8)
    ax.set_ylabel("step time, new / old kernel (median)")
    ax.set_title(f"CPU attention vs {args.baseline}: sequences x cached positions, rows each\n"
                 f"{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"attention_ab{suffix}.png")
    print(markdown_table(["sequences", "cached positions", "rows each", "old ms", "new ms",
                          "new / old"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
