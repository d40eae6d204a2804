"""The 4-bit x 8-bit kernel's loops on a whole SmolLM2-135M step's matrices: the 30 layers'
120 4-bit matrices (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and the Q8_0
LM head (49152x576), random codes, called in model order so that the weights stream from
DRAM as in serving (96 MB a step). With ``--shapes qwen-q6``, Qwen2.5-1.5B's 29 Q6_K
matrices instead (14 layers' down 1536x8960 and v 256x1536, the head 151936x1536; 195 MB).
Arms, alternating sample by sample in one process:

- ``vnni16``: 4-bit column groups stored in pairs, 16 columns a 512-bit vector (the
  default where the CPU has AVX512-VNNI);
- ``vnni8``: unpaired 4-bit weights on the 8-column VNNI loop (the layout before
  2026-11-27);
- ``avx2``: unpaired weights on the AVX2 loop (what an AVX2-only CPU runs);
- ``amx`` (where the CPU has AMX-INT8): paired weights, every pass on the AMX loops
  (``amx_rows=1``; the VNNI arms run none: ``amx_rows=0``). By default a process uses AMX
  from the row count it measures at load, where this arm's curve crosses ``vnni16``'s.

The Q8_0 head is never paired: its time differs between ``avx2``, ``amx`` and the VNNI arms
only. Q6_K matrices pair as 4-bit ones do and have no AMX loop.

Every arm gives the same bits (checked). Times include ``cpu_q4q8.linear``'s Python call
(the same in every arm).

    python benchmarks/q4q8_loops.py [--samples 21] [--rows 1,2,3,4,5,8,12,16] [--tag TAG]
        [--arms vnni16,vnni8,avx2,amx] [--shapes smollm2|qwen-q6]

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

# --shapes: layers, each layer's (out, in), the head's (vocab, hidden), and their formats
MODELS = {"smollm2": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576),
                      "4-bit", "Q8_0"),
          "qwen-q6": (14, [(1536, 8960), (256, 1536)], (151936, 1536), "Q6_K", "Q6_K")}
RATIOS = [("vnni16", "vnni8"), ("vnni8", "avx2"), ("amx", "vnni16")]  # ratio columns
# arm: (paired, vnni, amx_rows)
ARMS = {"vnni16": (True, True, 0), "vnni8": (False, True, 0), "avx2": (False, False, 0),
        "amx": (True, True, 1)}


Weight = cpu_q4q8.Q4Q8Weight | cpu_q4q8.Q8Q8Weight | cpu_q4q8.Q6Q8Weight


def random_q6(out: int, k: int, g: torch.Generator,
              layouts: list[bool]) -> list[cpu_q4q8.Q6Q8Weight]:
    q = torch.randint(-32, 32, (out, k), generator=g)
    d = torch.rand(out, -(-k // 256), generator=g) * 1e-3
    sc = torch.randint(-128, 128, (out, k // 16), generator=g)
    return [cpu_q4q8.pack_q6(q, d, sc, paired=paired) for paired in layouts]


def random_matrices(layouts: list[bool], shapes: str) -> dict[bool, tuple[list[Weight], Weight]]:
    """Per layout (paired or not), the step's matrices, random codes; each matrix packed in
    every layout one after the other, so that no arm's weights sit in memory allocated
    apart from the others' (arms packed one after the other read 1.2-1.3x apart at 1 row on
    the AMX Xeon VM for the same loop)."""
    layer_count, layer_shapes, (vocab, hidden), _, head_format = MODELS[shapes]
    g = torch.Generator().manual_seed(0)
    layers: dict[bool, list[Weight]] = {paired: [] for paired in layouts}
    for _ in range(layer_count):
        for out, k in layer_shapes:
            if shapes == "qwen-q6":
                packed: list[Weight] = list(random_q6(out, k, g, layouts))
            else:
                q = torch.randint(0, 16, (out, k), generator=g)
                d = torch.rand(out, k // 32, generator=g) * 0.02
                m = -torch.rand(out, k // 32, generator=g) * 0.1
                packed = [cpu_q4q8.pack(q, d, m, paired=paired) for paired in layouts]
            for paired, w in zip(layouts, packed, strict=True):
                layers[paired].append(w)
    if head_format == "Q6_K":
        heads: list[Weight] = list(random_q6(vocab, hidden, g, layouts))
    else:
        q8 = cpu_q4q8.pack_q8(torch.randint(-128, 128, (vocab, hidden), generator=g),
                              torch.rand(vocab, hidden // 32, generator=g) * 0.02)
        heads = [q8 if i == 0 else _copy_q8(q8) for i in range(len(layouts))]
    return {paired: (layers[paired], head) for paired, head in zip(layouts, heads, strict=True)}


def _copy_q8(w: cpu_q4q8.Q8Q8Weight) -> cpu_q4q8.Q8Q8Weight:
    return cpu_q4q8.Q8Q8Weight(w.codes.clone(), w.d.clone(), w.out_features, w.in_features)


def step(layers: list[Weight], head: Weight, xs: dict[int, torch.Tensor], vnni: bool,
         amx_rows: int) -> tuple[float, float, torch.Tensor]:
    """Seconds for the layers' matrices and for the head; the head's output."""
    start = time.perf_counter()
    for w in layers:
        cpu_q4q8.linear(xs[w.in_features], w, vnni=vnni, amx_rows=amx_rows)
    middle = time.perf_counter()
    y = cpu_q4q8.linear(xs[head.in_features], head, vnni=vnni, amx_rows=amx_rows)
    return middle - start, time.perf_counter() - middle, y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=21)
    p.add_argument("--rows", default="1,2,3,4,5,8,12,16")
    p.add_argument("--tag", default="")
    p.add_argument("--arms", default=",".join(ARMS), help="of " + ", ".join(ARMS))
    p.add_argument("--shapes", default="smollm2", choices=list(MODELS))
    args = p.parse_args()
    if not cpu_q4q8.available():
        p.error("the q4q8 kernel is not available here (gcc, AVX2/FMA/F16C)")
    layer_count, layer_shapes, _, layer_format, head_format = MODELS[args.shapes]
    arms = {a: v for a, v in ARMS.items() if a in args.arms.split(",")
            and (cpu_q4q8.uses_vnni() or not v[1])
            and ((cpu_q4q8.uses_amx() and args.shapes == "smollm2") or not v[2])}
    weights = random_matrices(sorted({v[0] for v in arms.values()}), args.shapes)
    ins = sorted({k for _, k in layer_shapes} | {MODELS[args.shapes][2][1]})
    data: list[dict[str, object]] = []
    table: list[list[object]] = []
    curves: list[tuple[int, dict[str, dict[str, float]]]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator().manual_seed(rows)
        xs = {k: (torch.randn(rows, k, generator=g) * 2).bfloat16() for k in ins}
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
                "shapes": args.shapes, "arms": list(arms), "results": data},
               RESULTS_DIR / f"q4q8_loops{suffix}.json")
    fig, (ax_l, ax_h) = new_figure(10.0, 4.2, ncols=2)
    for a in arms:
        for ax, part in ((ax_l, "layers"), (ax_h, "head")):
            ax.plot([r for r, _ in curves], [m[a][part] for _, m in curves], marker="o",
                    label=a)
    ax_l.set_title(f"{layer_count * len(layer_shapes)} layer matrices ({layer_format})",
                   fontsize=9)
    ax_h.set_title(f"LM head ({head_format})", fontsize=9)
    for ax in (ax_l, ax_h):
        ax.set_xlabel("rows")
        ax.set_ylabel("ms a step (median)")
        ax.legend(fontsize=8)
    fig.suptitle(f"q4q8 loops, {args.shapes} shapes\n{machine_summary(info)}", fontsize=9)
    save_figure(fig, RESULTS_DIR / f"q4q8_loops{suffix}.png")
    headers = ["rows"] + [f"{a} {part} ms" for a in arms for part in ("layers", "head")]
    for num, den in RATIOS:
        if num in arms and den in arms:
            headers += [f"{num} / {den} layers", f"{num} / {den} head"]
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
