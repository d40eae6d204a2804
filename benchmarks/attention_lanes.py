"""The CPU attention kernel's lanes per call: the fp32 lane (K/V converted to fp32, fp32
FMAs; every CPU with AVX2) against the dot lane (bf16 pair dot products, ``vdpbf16ps``; CPUs
with AVX512-BF16) and, where the CPU has AMX-BF16 (the default there), the AMX lane (tile
multiplies, ``tdpbf16ps``), in one process, lanes rotating sample by sample, at SmolLM2-135M
shapes (9 q + 3 kv heads of 64, blocks of 16). Cases are ``(sequences, cached positions,
rows each)``: decode rows (1), verification rows (1 + drafts) and a prefill chunk.

    python benchmarks/attention_lanes.py [--samples 201] [--calls 10] [--tag TAG]

writes ``benchmarks/results/attention_lanes[_TAG].{json,png}`` and prints a markdown table
(with the largest difference between each lane's outputs and the fp32 lane's).
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
    lanes = list(cpu_attention.runnable_lanes())
    if len(lanes) < 2:
        p.error("this CPU has no AVX512-BF16: only the fp32 lane runs here")
    torch.manual_seed(0)
    start_lane = cpu_attention.lane()
    scale = HEAD_DIM ** -0.5
    data, rows_out = [], []
    for seqs, context, rows in CASES:
        q, kv, tables, lens, qsl = make_case(seqs, context, rows)

        def call(q=q, kv=kv, tables=tables, lens=lens, qsl=qsl) -> torch.Tensor | None:
            return cpu_attention.ragged_attention(q, kv, tables, lens, qsl, scale)

        outs, times = {}, {lane: [] for lane in lanes}
        for lane in lanes:
            cpu_attention.set_lane(lane)
            outs[lane] = call()
        for i in range(args.samples):
            for lane in lanes[i % len(lanes):] + lanes[:i % len(lanes)]:
                cpu_attention.set_lane(lane)
                times[lane].append(per_call_us(call, args.calls))
        fp32 = outs["fp32"]
        assert all(out is not None for out in outs.values()) and fp32 is not None
        entry: dict[str, float | int] = {"sequences": seqs, "context": context, "rows": rows}
        row: list[object] = [seqs, context, rows]
        for lane in lanes:
            entry[f"{lane}_us"] = median(times[lane])
            row.append(fmt(entry[f"{lane}_us"], 1))
        for lane in lanes[1:]:
            got = outs[lane]
            assert got is not None
            entry[f"{lane}_ratio"] = entry[f"{lane}_us"] / entry["fp32_us"]
            entry[f"{lane}_max_abs_diff"] = (fp32.float() - got.float()).abs().max().item()
            row += [fmt(entry[f"{lane}_ratio"]), f"{entry[f'{lane}_max_abs_diff']:.2g}"]
        if "amx" in lanes:
            entry["amx_over_dot"] = entry["amx_us"] / entry["dot_us"]
            row.append(fmt(entry["amx_over_dot"]))
        data.append(entry)
        rows_out.append(row)
        print(" | ".join(str(x) for x in row), flush=True)
    cpu_attention.set_lane(start_lane)
    info = machine_info()
    suffix = f"_{args.tag}" if args.tag else ""
    write_json({"machine": info, "threads": torch.get_num_threads(), "samples": args.samples,
                "calls": args.calls, "cases": data},
               RESULTS_DIR / f"attention_lanes{suffix}.json")
    fig, ax = new_figure(8.0, 4.5)
    labels = [f"{e['sequences']}x{e['context']}\n{e['rows']} row(s)" for e in data]
    width = 0.8 / (len(lanes) - 1)
    for k, (lane, color) in enumerate(zip(lanes[1:], ("tab:green", "tab:purple"), strict=False)):
        ax.bar([i + (k - (len(lanes) - 2) / 2) * width for i in range(len(data))],
               [e[f"{lane}_ratio"] for e in data], width, color=color, label=lane)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.legend(fontsize=8)
    ax.set_xticks(range(len(data)), labels, fontsize=8)
    ax.set_ylabel("time per call / the fp32 lane's (median)")
    ax.set_title("CPU attention lanes: sequences x cached positions, rows each\n"
                 f"{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"attention_lanes{suffix}.png")
    header = ["sequences", "cached positions", "rows each"] + [f"{lane} µs" for lane in lanes]
    for lane in lanes[1:]:
        header += [f"{lane} / fp32", f"{lane} max abs diff"]
    print(markdown_table(header + (["amx / dot"] if "amx" in lanes else []), rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
