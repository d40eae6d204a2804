"""Small helpers shared by the benchmark scripts (timing, machine info, results output).

Import from a script in this folder as ``from common import ...`` (the scripts are run as
``python benchmarks/<name>.py``, which puts ``benchmarks/`` on ``sys.path``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------- timing


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes (``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` back-to-back calls (one short sample:
    on a shared machine a preemption spoils few samples rather than doubling long ones)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return median([time_call(fn) for _ in range(repeats)])


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` times ``scale`` (None when there are none)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    import numpy as np

    p = np.percentile(np.asarray(values) * scale, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the raw values of a list of measurements."""
    return {"median": median(values), "min": min(values), "max": max(values),
            "values": list(values)}


# ---------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
          "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The vector-ISA flags of this CPU that decide our kernels (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [flag for flag in _FLAGS if flag in have]


def machine_info() -> dict[str, Any]:
    """What a result depends on: CPU, cores, memory, library versions, date."""
    try:
        import transformers

        tf_version: str | None = transformers.__version__
    except ImportError:
        tf_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": affinity,
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gb": total_memory_gb(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def machine_summary(info: dict[str, Any]) -> str:
    """One line for docs: ``AMD EPYC, 2 cores, 23 GB, torch 2.13.0+cpu``."""
    parts = [info["cpu_model"], f"{info['usable_cores']} cores"]
    if info.get("memory_gb"):
        parts.append(f"{info['memory_gb']:g} GB RAM")
    if info.get("cuda"):
        parts.append(info["cuda"])
    parts.append(f"torch {info['torch']}")
    if info.get("transformers"):
        parts.append(f"transformers {info['transformers']}")
    return ", ".join(parts)


# ---------------------------------------------------------------------- memory bandwidth


def measure_memory_bandwidth(size_mb: int = 512, repeats: int = 7) -> dict[str, Any]:
    """Main-memory bandwidth in GB/s (1e9 bytes/s) from a ``size_mb`` float32 buffer.

    ``sum`` counts the bytes read; ``copy`` counts read + written bytes. ``best`` is the higher
    of the two (``best_method`` says which), a proxy for how fast weights can be streamed.
    """
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    t_sum = median_time(lambda: src.sum(), repeats=repeats)
    t_copy = median_time(lambda: dst.copy_(src), repeats=repeats)
    sum_gbs = nbytes / t_sum / 1e9
    copy_gbs = 2 * nbytes / t_copy / 1e9
    best_method = "sum" if sum_gbs >= copy_gbs else "copy"
    return {"buffer_mb": size_mb, "threads": torch.get_num_threads(),
            "sum_read_gbs": sum_gbs, "copy_read_write_gbs": copy_gbs,
            "best_gbs": max(sum_gbs, copy_gbs), "best_method": best_method}


# ---------------------------------------------------------------------- output


def write_json(data: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def save_figure(fig: Any, path: Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure (and close it)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def new_figure(width: float = 7.0, height: float = 4.5, ncols: int = 1) -> tuple[Any, Any]:
    """A headless (Agg) matplotlib figure and its axes (a tuple of them when ncols > 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height))


def speedup_bars(ax: Any, labels: Sequence[str],
                 series: Sequence[tuple[str, Sequence[float]]]) -> None:
    """Grouped bars on ``ax``: one group a label, one bar a series ``(name, values)``, a
    line at 1.0 (no speed-up) and the labels slanted below."""
    import numpy as np

    x = np.arange(len(labels))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, labels, rotation=30, ha="right")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are written with :func:`fmt`."""
    def cell(v: Any) -> str:
        return fmt(v) if isinstance(v, float) else "—" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with about ``digits`` significant digits (``-`` for None)."""
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"
