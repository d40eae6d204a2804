"""The CPU attention kernel's two lanes per call: the fp32 lane (K/V converted to fp32, fp32
FMAs; every CPU with AVX2) against the dot lane (bf16 pair dot products, ``vdpbf16ps``; CPUs
with AVX512-BF16, where it is the default), in one process, lanes alternating sample by
sample, at SmolLM2-135M shapes (9 q + 3 kv heads of 64, blocks of 16). Cases are
``(sequences, cached positions, rows each)``: decode rows (1), verification rows (1 +
drafts) and a prefill chunk.

    python benchmarks/attention_lanes.py [--samples 201] [--calls 10] [--tag TAG]

writes ``benchmarks/results/attention_lanes[_TAG].{json,png}`` and prints a markdown table
(with the largest difference between the lanes' outputs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    machine_summary,
    markdown_table,
    median,
    new_figure,
    per_call_us,
    save_figure,
    write_json,
)

from quickdraft.kernels import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BF16 = torch.bfloat16
CASES = [(1, 256, 1), (1, 256, 4), (1, 256, 8), (1, 1024, 1), (1, 1024, 4), (1, 1024, 8),
         (8, 256, 1), (8, 256, 4), (1, 0, 128)]


def make_case(seqs: int, context: int, rows: int) -> tuple[torch.Tensor, ...]:
    """q for ``rows`` new tokens per sequence after ``context`` cached ones (their K/V in
    the cache too), each sequence's blocks shuffled."""
    per = -(-(context + rows) // BLOCK_SIZE)
    kv = torch.randn(2, seqs * per, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(BF16)
    tables = torch.randperm(seqs * per).to(torch.int32).view(seqs, per).contiguous()
    q = torch.randn(seqs * rows, HEADS, HEAD_DIM).to(BF16)
    lens = torch.full((seqs,), context + rows, dtype=torch.int32)
    qsl = torch.arange(0, seqs * rows + 1, rows, dtype=torch.int32)
    return q, kv, tables, lens, qsl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=201)
    p.add_argument("--calls", type=int, default=10, help="calls per timed sample")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if not cpu_attention.available():
        p.error("the CPU attention kernel is not available here (gcc, AVX2/FMA)")
    if not cpu_attention.dot_supported():
        p.error("this CPU has no AVX512-BF16: only the fp32 lane runs here")
    torch.manual_seed(0)
    start_lane = cpu_attention.lane()
    scale = HEAD_DIM ** -0.5
    data, rows_out = [], []
    for seqs, context, rows in CASES:
        q, kv, tables, lens, qsl = make_case(seqs, context, rows)

        def call(q=q, kv=kv, tables=tables, lens=lens, qsl=qsl) -> torch.Tensor | None:
            return cpu_attention.ragged_attention(q, kv, tables, lens, qsl, scale)

        outs, times = {}, {lane: [] for lane in cpu_attention.LANES}
        for lane in cpu_attention.LANES:
            cpu_attention.set_lane(lane)
            outs[lane] = call()
        for i in range(args.samples):
            for lane in cpu_attention.LANES if i % 2 == 0 else cpu_attention.LANES[::-1]:
                cpu_attention.set_lane(lane)
                times[lane].append(per_call_us(call, args.calls))
        fp32, dot = outs["fp32"], outs["dot"]
        assert fp32 is not None and dot is not None
        diff = (fp32.float() - dot.float()).abs().max().item()
        t32, tdot = median(times["fp32"]), median(times["dot"])
        entry = {"sequences": seqs, "context": context, "rows": rows, "fp32_us": t32,
                 "dot_us": tdot, "ratio": tdot / t32, "max_abs_diff": diff}
        data.append(entry)
        rows_out.append([seqs, context, rows, fmt(t32, 1), fmt(tdot, 1), fmt(tdot / t32),
                         f"{diff:.2g}"])
        print(f"{seqs} x {context} x {rows}: fp32 {t32:.1f} us, dot {tdot:.1f} us "
              f"({tdot / t32:.3f}), max|diff| {diff:.2g}", flush=True)
    cpu_attention.set_lane(start_lane)
    info = machine_info()
    suffix = f"_{args.tag}" if args.tag else ""
    write_json({"machine": info, "threads": torch.get_num_threads(), "samples": args.samples,
                "calls": args.calls, "cases": data},
               RESULTS_DIR / f"attention_lanes{suffix}.json")
    fig, ax = new_figure(8.0, 4.5)
    labels = [f"{e['sequences']}x{e['context']}\n{e['rows']} row(s)" for e in data]
    ax.bar(range(len(data)), [e["ratio"] for e in data], color="tab:green")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(data)), labels, fontsize=8)
    ax.set_ylabel("time per call, dot / fp32 lane (median)")
    ax.set_title("CPU attention lanes: sequences x cached positions, rows each\n"
                 f"{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"attention_lanes{suffix}.png")
    print(markdown_table(["sequences", "cached positions", "rows each", "fp32 µs", "dot µs",
                          "dot / fp32", "max abs diff"], rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
