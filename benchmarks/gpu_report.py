"""Output of ``benchmarks/gpu.py``: the goals (batch 1 against HF ``generate`` and against the
bandwidth floor), the markdown table, the goals' text and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import fmt, markdown_table, save_figure

GOAL_VS_HF = 10.0  # default model, batch 1: quickdraft tok/s >= 10x HF generate
GOAL_VS_FLOOR = 2.0  # llama-1b / llama-8b, batch 1: step time <= 2x the bandwidth floor
GOAL_HF_MODELS = ("default",)
GOAL_FLOOR_MODELS = ("llama-1b", "llama-8b")


# ---------------------------------------------------------------------- goals


def goals(rows: list[dict[str, Any]], primary: dict[str, str]) -> list[dict[str, Any]]:
    """Batch 1, width 1 of each model (primary variant): ours vs HF and vs the floor, and the
    goals that apply to it (``met`` None when a figure is missing)."""
    out = []
    for name, label in primary.items():
        ours = _find(rows, name, "quickdraft", label, 1, 1)
        hf = _find(rows, name, "hf", "HF generate", 1, 1)
        vs_hf = (ours["tok_s"] / hf["tok_s"]) if ours and hf and hf["tok_s"] else None
        vs_floor = ours["floor_ratio"] if ours else None
        goal: dict[str, Any] = {"model": name, "variant": label,
                                "tok_s": ours["tok_s"] if ours else None,
                                "hf_tok_s": hf["tok_s"] if hf else None,
                                "step_ms": ours["step_ms"] if ours else None,
                                "floor_ms": ours["floor_ms"] if ours else None,
                                "vs_hf": vs_hf, "step_over_floor": vs_floor}
        if name in GOAL_HF_MODELS:
            goal["goal"] = f"tok/s >= {GOAL_VS_HF:g}x HF generate"
            goal["met"] = None if vs_hf is None else vs_hf >= GOAL_VS_HF
        elif name in GOAL_FLOOR_MODELS:
            goal["goal"] = f"step <= {GOAL_VS_FLOOR:g}x floor"
            goal["met"] = None if vs_floor is None else vs_floor <= GOAL_VS_FLOOR
        else:
            goal["goal"], goal["met"] = None, None
        out.append(goal)
    return out


def _find(rows: list[dict[str, Any]], model: str, impl: str, variant: str, batch: int,
          width: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["model"] == model and r["impl"] == impl
                 and r["variant"] == variant and r["batch"] == batch and r["width"] == width),
                None)


# ---------------------------------------------------------------------- output


def table(rows: list[dict[str, Any]]) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))  # in the order measured

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (models.index(r["model"]), r["width"], r["batch"], r["impl"] == "hf")

    out = []
    for r in sorted(rows, key=key):
        hf = _find(rows, r["model"], "hf", "HF generate", r["batch"], 1)
        vs_hf = (r["tok_s"] / hf["tok_s"] if r["impl"] == "quickdraft" and r["tok_s"]
                 and hf and hf["tok_s"] else None)
        graph = "-" if r["impl"] == "hf" else ("yes" if r["cuda_graph_step"] else "no")
        cells = [r["step_ms"], r["rows_per_s"], r["floor_ms"], r["floor_ratio"], vs_hf]
        out.append([r["model"], r["batch"], r["width"], r["variant"], graph,
                    *("-" if v is None else v for v in cells)])
    return markdown_table(["model", "batch", "width", "impl", "graph", "step ms",
                           "tok/s*", "floor ms", "step/floor", "x HF"], out)


def goals_text(items: list[dict[str, Any]]) -> str:
    lines = []
    for g in items:
        vs_hf = "-" if g["vs_hf"] is None else f"{g['vs_hf']:.2f}x"
        vs_floor = "-" if g["step_over_floor"] is None else f"{g['step_over_floor']:.2f}x"
        verdict = ("no goal" if g["goal"] is None else
                   f"goal {g['goal']}: " + {True: "MET", False: "NOT MET",
                                            None: "not measured"}[g["met"]])
        lines.append(f"- {g['model']} ({g['variant']}, batch 1): {fmt(g['tok_s'])} tok/s, "
                     f"HF {fmt(g['hf_tok_s'])} tok/s -> {vs_hf} HF; step "
                     f"{fmt(g['step_ms'])} ms, floor {fmt(g['floor_ms'])} ms -> {vs_floor} "
                     f"floor; {verdict}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    rows = data["results"]
    names = list(data["models"])
    width = min(data["config"]["widths"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(1, len(names), figsize=(5.0 * len(names), 4.5), squeeze=False)
    for ax, name in zip(grid[0], names, strict=True):
        mine = [r for r in rows if r["model"] == name and r["width"] == width
                and r["rows_per_s"]]
        labels = list(dict.fromkeys(r["variant"] for r in mine))
        for i, label in enumerate(labels):
            pts = sorted((r["batch"], r["rows_per_s"]) for r in mine if r["variant"] == label)
            style = "s-" if label == "HF generate" else "o-"
            ax.plot([b for b, _ in pts], [v for _, v in pts], style, color=f"C{i}",
                    label=label if label == "HF generate" else f"quickdraft {label}")
        floor = sorted({(r["batch"], r["floor_tok_s"]) for r in mine
                        if r["impl"] == "quickdraft"})
        if floor:
            ax.plot([b for b, _ in floor], [v for _, v in floor], "--", color="grey",
                    label="bandwidth floor (tok/s ceiling)")
        batches = sorted({r["batch"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if batches:
            ax.set_xticks(batches)
            ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("batch size (sequences)")
        ax.set_ylabel("decode tok/s (all sequences)" if width == 1
                      else f"verification rows/s (width {width})")
        ax.set_title(f"{name}, context {data['config']['context']}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    gpu = data["machine"]["gpu"].get("name") or data["machine"]["cpu_model"]
    fig.suptitle(f"quickdraft vs HF generate, {data['config']['dtype']}, {gpu}", fontsize=10)
    save_figure(fig, path)

