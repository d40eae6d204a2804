"""The 4-bit x 8-bit kernel's loops on a whole SmolLM2-135M step's matrices: the 30 layers'
120 4-bit matrices (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and the Q8_0
LM head (49152x576), random codes, called in model order so that the weights stream from
DRAM as in serving (96 MB a step). Arms, alternating sample by sample in one process:

- ``vnni16``: 4-bit column groups stored in pairs, 16 columns a 512-bit vector (the
  default where the CPU has AVX512-VNNI);
- ``vnni8``: unpaired 4-bit weights on the 8-column VNNI loop (the layout before
  2026-11-27);
- ``avx2``: unpaired weights on the AVX2 loop (what an AVX2-only CPU runs);
- ``amx`` (where the CPU has AMX-INT8): paired weights, every pass on the AMX loops
  (``amx_rows=1``; the VNNI arms run none: ``amx_rows=0``). By default a process uses AMX
  from the row count it measures at load, where this arm's curve crosses ``vnni16``'s.

The Q8_0 head is never paired: its time differs between ``avx2``, ``amx`` and the VNNI arms
only.

Every arm gives the same bits (checked). Times include ``cpu_q4q8.linear``'s Python call
(the same in every arm).

    python benchmarks/q4q8_loops.py [--samples 21] [--rows 1,2,3,4,5,8,12,16] [--tag TAG]
        [--arms vnni16,vnni8,avx2,amx]

writes ``benchmarks/results/q4q8_loops[_TAG].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
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
    save_figure,
    write_json,
)

from quickdraft.kernels import cpu_q4q8

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # per layer: out, in
VOCAB, HIDDEN = 49152, 576
RATIOS = [("vnni16", "vnni8"), ("amx", "vnni16")]  # the table's ratio columns, where both ran
# arm: (paired, vnni, amx_rows)
ARMS = {"vnni16": (True, True, 0), "vnni8": (False, True, 0), "avx2": (False, False, 0),
        "amx": (True, True, 1)}


def random_matrices(paired: bool) -> tuple[list[cpu_q4q8.Q4Q8Weight], cpu_q4q8.Q8Q8Weight]:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for out, k in SHAPES:
            q = torch.randint(0, 16, (out, k), generator=g)
            d = torch.rand(out, k // 32, generator=g) * 0.02
            m = -torch.rand(out, k // 32, generator=g) * 0.1
            layers.append(cpu_q4q8.pack(q, d, m, paired=paired))
    head = cpu_q4q8.pack_q8(torch.randint(-128, 128, (VOCAB, HIDDEN), generator=g),
                            torch.rand(VOCAB, HIDDEN // 32, generator=g) * 0.02)
    return layers, head


def step(layers: list[cpu_q4q8.Q4Q8Weight], head: cpu_q4q8.Q8Q8Weight,
         xs: dict[int, torch.Tensor], vnni: bool,
         amx_rows: int) -> tuple[float, float, torch.Tensor]:
    """Seconds for the layers' matrices and for the head; the head's output."""
    start = time.perf_counter()
    for w in layers:
        cpu_q4q8.linear(xs[w.in_features], w, vnni=vnni, amx_rows=amx_rows)
    middle = time.perf_counter()
    y = cpu_q4q8.linear(xs[HIDDEN], head, vnni=vnni, amx_rows=amx_rows)
    return middle - start, time.perf_counter() - middle, y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=21)
    p.add_argument("--rows", default="1,2,3,4,5,8,12,16")
    p.add_argument("--tag", default="")
    p.add_argument("--arms", default=",".join(ARMS), help="of " + ", ".join(ARMS))
    args = p.parse_args()
    if not cpu_q4q8.available():
        p.error("the q4q8 kernel is not available here (gcc, AVX2/FMA/F16C)")
    arms = {a: v for a, v in ARMS.items() if a in args.arms.split(",")
            and (cpu_q4q8.uses_vnni() or not v[1]) and (cpu_q4q8.uses_amx() or not v[2])}
    weights = {paired: random_matrices(paired) for paired in {v[0] for v in arms.values()}}
    data: list[dict[str, object]] = []
    table: list[list[object]] = []
    curves: list[tuple[int, dict[str, dict[str, float]]]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator().manual_seed(rows)
        xs = {k: (torch.randn(rows, k, generator=g) * 2).bfloat16() for k in (576, 1536)}
        outs = [step(*weights[paired], xs, vnni, amx)[2] for paired, vnni, amx in arms.values()]
        assert all(torch.equal(y, outs[0]) for y in outs), "the loops differ"
        times: dict[str, dict[str, list[float]]] = {a: {"layers": [], "head": []} for a in arms}
        names = list(arms)
        for i in range(args.samples):
            for a in names if i % 2 == 0 else names[::-1]:
                paired, vnni, amx = arms[a]
                t_layers, t_head, _ = step(*weights[paired], xs, vnni, amx)
                times[a]["layers"].append(t_layers)
                times[a]["head"].append(t_head)
        ms = {a: {part: 1e3 * median(times[a][part]) for part in ("layers", "head")}
              for a in names}
        cells: list[object] = [rows]
        for a in names:
            cells += [fmt(ms[a]["layers"], 2), fmt(ms[a]["head"], 2)]
        entry: dict[str, object] = {"rows": rows, "ms": ms}
        for num, den in RATIOS:
            if num in arms and den in arms:
                ratio = {part: ms[num][part] / ms[den][part] for part in ("layers", "head")}
                entry[f"{num}_over_{den}"] = ratio
                cells += [fmt(ratio["layers"]), fmt(ratio["head"])]
        data.append(entry)
        table.append(cells)
        curves.append((rows, ms))
        print(f"{rows} rows: " + ", ".join(
            f"{a} {ms[a]['layers']:.2f} + {ms[a]['head']:.2f} ms" for a in names), flush=True)
    info = machine_info()
    suffix = f"_{args.tag}" if args.tag else ""
    write_json({"machine": info, "threads": torch.get_num_threads(), "samples": args.samples,
                "arms": list(arms), "results": data}, RESULTS_DIR / f"q4q8_loops{suffix}.json")
    fig, (ax_l, ax_h) = new_figure(10.0, 4.2, ncols=2)
    for a in arms:
        for ax, part in ((ax_l, "layers"), (ax_h, "head")):
            ax.plot([r for r, _ in curves], [m[a][part] for _, m in curves], marker="o",
                    label=a)
    ax_l.set_title("120 layer matrices (4-bit)", fontsize=9)
    ax_h.set_title("LM head (Q8_0)", fontsize=9)
    for ax in (ax_l, ax_h):
        ax.set_xlabel("rows")
        ax.set_ylabel("ms a step (median)")
        ax.legend(fontsize=8)
    fig.suptitle(f"q4q8 loops, SmolLM2-135M shapes\n{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"q4q8_loops{suffix}.png")
    headers = ["rows"] + [f"{a} {part} ms" for a in arms for part in ("layers", "head")]
    for num, den in RATIOS:
        if num in arms and den in arms:
            headers += [f"{num} / {den} layers", f"{num} / {den} head"]
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
