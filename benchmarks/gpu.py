"""GPU decode benchmark: per-step time and tok/s of our runner vs HF ``generate`` vs the floor.

For every model (``--models``: ``default`` = SmolLM2-135M-Instruct with its real weights;
``llama-1b`` / ``llama-8b`` = the Llama 3.2 1B / Llama 3.1 8B shapes with random weights,
speed only; ``tiny`` = a 2-layer Llama for CPU smoke runs), batch size B (``--batch-sizes``)
and step width W (``--widths``: 1 = plain decode, 1 + k = a verification step of k drafts):

- **quickdraft**: one :class:`engine.model_runner.ModelRunner` per kernel-backend variant
  (``--kernel-backend``; with ``--compare-backends`` also triton with and without CUDA graphs
  and torch). A step is ``runner.time_decode(B, context, W)``: B sequences, each with
  ``--context`` cached positions in its own KV blocks, feed W tokens and every row is scored
  (LM head included; host-side metadata and the device sync included, sampling not). The
  median of ``--repeats`` steps after ``--warmup`` is reported. tok/s = B * W / step for W = 1;
  for W > 1 the same figure is verification *rows*/s (the tokens a step yields depend on the
  acceptance rate).
- **HF**: ``transformers`` ``generate`` (greedy, ``min_new_tokens = max_new_tokens``) of the
  same model on the same device and dtype, from a prompt of ``--context`` random token ids per
  sequence. decode tok/s = (N - 1) * B / (t(generate N) - t(generate 1)) with N =
  ``--hf-new-tokens`` (prefill excluded), medians of ``--hf-repeats``.
- **floor**: the memory-bandwidth limit on a step: (weight bytes a step reads + KV bytes a
  step reads) / measured bandwidth. Weight bytes = every parameter except an untied input
  embedding (a decode step reads one embedding row per token; the LM head is read whole; a
  tied embedding is counted once, as the LM head). KV bytes = B * (context + W) * layers * 2
  * kv_heads * head_dim * dtype size. Bandwidth = the better of a device-to-device ``copy_``
  (bytes read + written) and a read-only ``sum`` over a ``--bandwidth-mb`` buffer, best of 10
  each (the JSON says which won).

Goals checked and printed: single-stream decode (B = 1, W = 1) of the default model >= 10x HF
``generate``; B = 1 step time of the 1B and 8B shapes within 2x of the floor.

On a GPU::

    python benchmarks/gpu.py --models default,llama-1b,llama-8b --batch-sizes 1,8,32,128 \
        --compare-backends --plot

CPU smoke run (checks the script, no GPU figures)::

    python benchmarks/gpu.py --device cpu --models tiny --quick --kernel-backend torch --plot

Writes ``benchmarks/results/gpu[-TAG].json`` (and ``.png`` with ``--plot``) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`

from common import (
    RESULTS_DIR,
    fmt,
    machine_info,
    markdown_table,
    median,
    save_figure,
    summarize,
    write_json,
)

from quickdraft.engine import loader
from quickdraft.engine.backend import KernelBackend, select_backend
from quickdraft.engine.config import DTYPES, KERNEL_BACKENDS, ConfigError, EngineConfig
from quickdraft.engine.hf_model_dir import dtype_kwarg
from quickdraft.engine.model_runner import ModelRunner
from quickdraft.engine.models.llama_layers import ModelShape

MODEL_NAMES = ("default", "llama-1b", "llama-8b", "tiny")
GOAL_VS_HF = 10.0  # default model, batch 1: quickdraft tok/s >= 10x HF generate
GOAL_VS_FLOOR = 2.0  # llama-1b / llama-8b, batch 1: step time <= 2x the bandwidth floor
GOAL_HF_MODELS = ("default",)
GOAL_FLOOR_MODELS = ("llama-1b", "llama-8b")
BLOCK_SIZE = 16
MAX_WIDTH = 17  # EngineConfig allows at most 16 speculative tokens


# ---------------------------------------------------------------------- models


def llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def model_config(name: str) -> tuple[Any, Path | None]:
    """``(hf_config, model_dir)``; ``model_dir`` None means random weights."""
    if name == "default":
        model_dir = loader.resolve_model(None)
        return loader.load_config(model_dir), model_dir
    if name == "llama-1b":  # Llama 3.2 1B
        return llama_config(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=_llama3_rope(32.0),
            max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
            eos_token_id=128001), None
    if name == "llama-8b":  # Llama 3.1 8B
        return llama_config(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=_llama3_rope(8.0),
            max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
            eos_token_id=128001), None
    if name == "tiny":  # CPU smoke runs
        return llama_config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2), None
    raise ValueError(f"unknown model {name!r}; known: {list(MODEL_NAMES)}")


# ---------------------------------------------------------------------- bytes and floor


def weight_bytes_per_step(shape: ModelShape, itemsize: int) -> dict[str, Any]:
    """Parameters of the model and the bytes of them one decode step reads.

    Every linear layer, norm and bias is read once per step; the LM head is read whole; the
    input embedding only one row per token, so an untied embedding table is left out (a tied
    one is the LM head, counted once)."""
    h, inter, layers = shape.hidden_size, shape.intermediate_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = ((q + 2 * kv) * h + (q + 2 * kv if shape.qkv_bias else 0)  # qkv
                 + q * h + (h if shape.o_bias else 0)  # o
                 + 2 * inter * h + inter * h + (3 * inter + h if shape.mlp_bias else 0)  # mlp
                 + 2 * h)  # two RMSNorms
    lm_head = shape.vocab_size * h
    read = layers * per_layer + h + lm_head  # + final norm
    num_parameters = read + (0 if shape.tie_word_embeddings else shape.vocab_size * h)
    return {"num_parameters": num_parameters, "parameter_bytes": num_parameters * itemsize,
            "num_parameters_per_step": read, "bytes_per_step": read * itemsize,
            "tied_embedding": shape.tie_word_embeddings, "itemsize": itemsize}


def kv_bytes_per_step(shape: ModelShape, batch: int, context: int, width: int,
                      itemsize: int) -> int:
    """K and V bytes a step reads: every sequence's ``context + width`` positions, all
    layers."""
    return (batch * (context + width) * shape.num_layers * 2 * shape.num_kv_heads
            * shape.head_dim * itemsize)


def floor_seconds(weight_bytes: int, kv_bytes: int, bandwidth_gbs: float) -> float:
    return (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)


# ---------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call (CUDA events on a GPU, ``perf_counter`` elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


@torch.inference_mode()
def measure_bandwidth(device: torch.device, size_mb: int, dtype: torch.dtype,
                      repeats: int = 10) -> dict[str, Any]:
    """Device memory bandwidth in GB/s (1e9 B/s): ``copy_`` counts bytes read + written,
    ``sum`` bytes read; best of ``repeats`` each after two warm-up calls."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = size_mb * 2**20 // itemsize
    nbytes = n * itemsize

    def best(fn: Callable[[], Any]) -> float:
        fn()
        fn()
        _sync(device)
        return min(timed(fn, device) for _ in range(repeats))

    def run() -> tuple[float, float]:  # the buffers are freed when it returns
        src = torch.ones(n, dtype=dtype, device=device)
        dst = torch.empty_like(src)
        return (2 * nbytes / best(lambda: dst.copy_(src)) / 1e9,
                nbytes / best(lambda: src.sum()) / 1e9)

    copy_gbs, sum_gbs = run()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    method = "copy" if copy_gbs >= sum_gbs else "sum"
    return {"buffer_mb": size_mb, "dtype": str(dtype).removeprefix("torch."),
            "repeats": repeats, "copy_read_write_gbs": copy_gbs, "sum_read_gbs": sum_gbs,
            "gbs": max(copy_gbs, sum_gbs), "method": method,
            "method_description": "device-to-device copy_, (read + written bytes) / time"
            if method == "copy" else "read-only sum, bytes read / time"}


# ---------------------------------------------------------------------- quickdraft


@dataclass(frozen=True)
class Variant:
    kernel_backend: str
    cuda_graphs: bool


def variants(args: argparse.Namespace) -> list[Variant]:
    """The primary variant (the flags) first; with ``--compare-backends`` the others."""
    out = [Variant(args.kernel_backend, args.cuda_graphs)]
    if args.compare_backends:
        for v in (Variant("triton", True), Variant("triton", False), Variant("torch", False)):
            if v not in out:
                out.append(v)
    return out


def variant_label(backend_name: str, cuda_graphs: bool) -> str:
    if backend_name == "triton":
        return "triton+graphs" if cuda_graphs else "triton eager"
    return backend_name


def engine_config(args: argparse.Namespace, variant: Variant) -> EngineConfig:
    max_batch, max_width = max(args.batch_sizes), max(args.widths)
    per_seq = -(-(args.context + max_width) // BLOCK_SIZE)
    tokens = max_batch * max_width
    return EngineConfig(
        device=args.device, dtype=args.dtype, kernel_backend=variant.kernel_backend,
        cuda_graphs=variant.cuda_graphs,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens or min(tokens, 4096),
        block_size=BLOCK_SIZE, num_kv_blocks=max_batch * per_seq + 2, max_num_seqs=max_batch,
        max_num_batched_tokens=tokens,
        speculation="off" if max_width == 1 else "ngram",
        num_speculative_tokens=max(max_width - 1, 1),
        measure_step_cost=False, enable_prefix_caching=False, seed=args.seed)


def measure_quickdraft(args: argparse.Namespace, name: str, hf_config: Any,
                       model_dir: Path | None, config: EngineConfig, backend: KernelBackend,
                       shape: ModelShape, weights: dict[str, Any], bandwidth: dict[str, Any],
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Build one runner and time every (batch, width): ``(runner info, rows)``."""
    label = variant_label(backend.name, backend.cuda_graphs)
    max_model_len = args.context + max(args.widths)
    start = time.perf_counter()
    runner = ModelRunner(config, model_dir, hf_config, max_model_len, backend=backend)
    _sync(runner.device)
    load_s = time.perf_counter() - start
    try:
        params = sum(p.numel() for p in runner.model.parameters())  # shared: counted once
        info = {"label": label, "backend": backend.describe(), "load_s": load_s,
                "num_kv_blocks": runner.num_blocks, "max_model_len": max_model_len,
                "cuda_graph_buckets": runner.graphs.buckets if runner.graphs else None,
                "runner_num_parameters": params,
                "parameters_match": params == weights["num_parameters"],
                "engine_config": {"cuda_graph_max_tokens": config.cuda_graph_max_tokens,
                                  "max_num_seqs": config.max_num_seqs,
                                  "max_num_batched_tokens": config.max_num_batched_tokens,
                                  "speculation": config.speculation,
                                  "num_speculative_tokens": config.num_speculative_tokens,
                                  "block_size": config.block_size}}
        print(f"  {name} / {label}: runner ready in {load_s:.1f}s ({backend.reason})",
              file=sys.stderr)
        rows = []
        for width in args.widths:
            for batch in args.batch_sizes:
                times = time_decode_steps(runner, batch, args.context, width, args.repeats,
                                          args.warmup)
                graph = bool(runner.graphs is not None and runner.graphs.eligible(
                    batch * width, batch, width, True))
                rows.append(quickdraft_row(name, label, backend.name, graph, batch, width,
                                           args.context, times, shape, weights, bandwidth))
                r = rows[-1]
                print(f"    batch {batch:>4} width {width}: {r['step_ms']:.3f} ms/step, "
                      f"{fmt(r['rows_per_s'])} {'tok' if width == 1 else 'rows'}/s, "
                      f"{r['floor_ratio']:.2f}x floor", file=sys.stderr)
        return info, rows
    finally:
        del runner
        free_memory()


def time_decode_steps(runner: ModelRunner, batch: int, context: int, width: int,
                      repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        runner.time_decode(batch, context, width)
    times = [runner.time_decode(batch, context, width) for _ in range(repeats)]
    if any(t != t for t in times):  # NaN: the KV pool is too small
        raise RuntimeError(f"time_decode({batch}, {context}, {width}) returned NaN: the pool "
                           f"of {runner.num_blocks} blocks is too small")
    return times


def quickdraft_row(name: str, label: str, backend: str, graph: bool, batch: int, width: int,
                   context: int, times: list[float], shape: ModelShape,
                   weights: dict[str, Any], bandwidth: dict[str, Any]) -> dict[str, Any]:
    step = median(times)
    kv = kv_bytes_per_step(shape, batch, context, width, weights["itemsize"])
    floor = floor_seconds(weights["bytes_per_step"], kv, bandwidth["gbs"])
    rate = batch * width / step
    return {"model": name, "impl": "quickdraft", "variant": label, "backend": backend,
            "cuda_graph_step": graph, "batch": batch, "width": width, "context": context,
            "step_ms": step * 1e3, "step_s": summarize(times),
            "tok_s": rate if width == 1 else None, "rows_per_s": rate,
            "kv_bytes": kv, "weight_bytes": weights["bytes_per_step"],
            "floor_ms": floor * 1e3, "floor_ratio": step / floor,
            "floor_tok_s": batch * width / floor}


# ---------------------------------------------------------------------- HF


def build_hf(hf_config: Any, model_dir: Path | None, device: torch.device,
             dtype: torch.dtype) -> Any:
    """The HF model: from the checkpoint, or randomly initialised directly on ``device`` (no
    slow CPU initialisation of an 8B model)."""
    from transformers import AutoModelForCausalLM

    kw = {dtype_kwarg(): dtype}
    if model_dir is not None:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
        model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, **kw)
    return model.eval()


@torch.inference_mode()
def measure_hf(model: Any, name: str, batch: int, args: argparse.Namespace, shape: ModelShape,
               weights: dict[str, Any], bandwidth: dict[str, Any]) -> dict[str, Any]:
    device, n, context = torch.device(args.device), args.hf_new_tokens, args.context
    gen = torch.Generator().manual_seed(args.seed + batch)
    ids = torch.randint(3, shape.vocab_size, (batch, context), generator=gen).to(device)
    mask = torch.ones_like(ids)
    pad = getattr(model.generation_config, "pad_token_id", None)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if pad is None:
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": pad}

    def generate(tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        _sync(device)
        seconds = time.perf_counter() - start
        if out.shape[1] - context != tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - context} tokens, not {tokens}")
        return seconds

    generate(min(n, 4))  # warm-up: allocator, kernels (cuBLAS handles, SDPA)
    one, full = [], []
    for _ in range(args.hf_repeats):
        one.append(generate(1))
        full.append(generate(n))
    decode_s = median(full) - median(one)
    step = decode_s / (n - 1)
    kv = kv_bytes_per_step(shape, batch, context, 1, weights["itemsize"])
    floor = floor_seconds(weights["bytes_per_step"], kv, bandwidth["gbs"])
    ok = step > 0
    return {"model": name, "impl": "hf", "variant": "HF generate", "batch": batch, "width": 1,
            "context": context, "new_tokens": n,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "generate_1_s": summarize(one), "generate_n_s": summarize(full),
            "step_ms": step * 1e3 if ok else None,
            "tok_s": (n - 1) * batch / decode_s if ok else None,
            "rows_per_s": (n - 1) * batch / decode_s if ok else None,
            "kv_bytes": kv, "weight_bytes": weights["bytes_per_step"],
            "floor_ms": floor * 1e3, "floor_ratio": step / floor if ok else None,
            "floor_tok_s": batch / floor}


# ---------------------------------------------------------------------- memory


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


# ---------------------------------------------------------------------- machine


def gpu_info(device: torch.device) -> dict[str, Any]:
    try:
        triton_version: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    info: dict[str, Any] = {"device": str(device), "torch_cuda": torch.version.cuda,
                            "triton": triton_version, "name": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device),
                    capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count,
                    driver=_nvidia_smi("driver_version"))
    return info


def _nvidia_smi(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


# ---------------------------------------------------------------------- main


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{what} must be comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"{what} must be positive integers")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--models", default="default,llama-1b,llama-8b",
                   help=f"comma-separated, of {', '.join(MODEL_NAMES)} "
                        "(default: default,llama-1b,llama-8b)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated (default 1,8,32,128; --quick 1,2,4)")
    p.add_argument("--context", type=int, default=None,
                   help="cached positions per sequence (default 512; --quick 32)")
    p.add_argument("--widths", default="1",
                   help="tokens per sequence per step, comma-separated: 1 = decode, "
                        "1+k = verification of k drafts (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--kernel-backend", default="auto", choices=list(KERNEL_BACKENDS))
    p.add_argument("--compare-backends", action="store_true",
                   help="also run triton with and without CUDA graphs, and torch")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                   help="largest captured step (default: max batch x max width, <= 4096)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    p.add_argument("--hf-batch-sizes", default=None,
                   help="HF generate batch sizes (default: --batch-sizes)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--hf-new-tokens", type=int, default=None,
                   help="N of generate(N) (default 64; --quick 4)")
    p.add_argument("--hf-repeats", type=int, default=None, help="(default 3; --quick 1)")
    p.add_argument("--bandwidth-mb", type=int, default=None,
                   help="bandwidth buffer size (default 2048 on CUDA, 256 on CPU; --quick 16)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repeats (CPU smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", action="store_true", help="also write the PNG")
    p.add_argument("--tag", default=None, help="results file suffix: gpu-<tag>.json")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    q = args.quick
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODEL_NAMES))
    if unknown or not args.models:
        p.error(f"--models: unknown {unknown}; known: {list(MODEL_NAMES)}")
    args.batch_sizes = _ints(args.batch_sizes or ("1,2,4" if q else "1,8,32,128"),
                             "--batch-sizes", p)
    args.hf_batch_sizes = ([] if args.no_hf else
                           _ints(args.hf_batch_sizes, "--hf-batch-sizes", p)
                           if args.hf_batch_sizes else list(args.batch_sizes))
    args.widths = _ints(args.widths, "--widths", p)
    if max(args.widths) > MAX_WIDTH:
        p.error(f"--widths: at most {MAX_WIDTH} (1 + 16 drafts)")
    defaults = {"context": (32, 512), "repeats": (3, 20), "warmup": (1, 5),
                "hf_new_tokens": (4, 64), "hf_repeats": (1, 3)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.context < 1 or args.repeats < 1 or args.warmup < 0 or args.hf_repeats < 1:
        p.error("--context and --repeats, --hf-repeats must be >= 1, --warmup >= 0")
    if args.hf_new_tokens < 2:
        p.error("--hf-new-tokens must be >= 2 (decode excludes the first token)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device: not a device: {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is visible to torch (CPU smoke run: --device cpu "
                "--models tiny --quick --kernel-backend torch)")
    if args.bandwidth_mb is None:
        args.bandwidth_mb = 16 if q else (2048 if device.type == "cuda" else 256)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    info = {**machine_info(), "gpu": gpu_info(device),
            "command": shlex.join(["python", "benchmarks/gpu.py", *args.argv])}
    print(f"device: {info['gpu']['name'] or device}, torch {info['torch']} (CUDA "
          f"{info['gpu']['torch_cuda']}), triton {info['gpu']['triton']}", file=sys.stderr)

    bandwidth = measure_bandwidth(device, args.bandwidth_mb, dtype)
    print(f"bandwidth: copy {bandwidth['copy_read_write_gbs']:.1f} GB/s, sum "
          f"{bandwidth['sum_read_gbs']:.1f} GB/s -> {bandwidth['gbs']:.1f} GB/s "
          f"({bandwidth['method']})", file=sys.stderr)

    data: dict[str, Any] = {
        "benchmark": "gpu",
        "machine": info,
        "config": {"models": args.models, "batch_sizes": args.batch_sizes,
                   "hf_batch_sizes": args.hf_batch_sizes, "widths": args.widths,
                   "context": args.context, "dtype": args.dtype, "device": args.device,
                   "kernel_backend": args.kernel_backend, "cuda_graphs": args.cuda_graphs,
                   "compare_backends": args.compare_backends, "repeats": args.repeats,
                   "warmup": args.warmup, "hf_new_tokens": args.hf_new_tokens,
                   "hf_repeats": args.hf_repeats, "quick": args.quick, "seed": args.seed},
        "metrics": {
            "step_ms": "quickdraft: median of `repeats` ModelRunner.time_decode(batch, context, "
                       "width) calls after `warmup` (host metadata + forward + LM head, synced);"
                       " HF: (t(generate N) - t(generate 1)) / (N - 1), medians of hf_repeats",
            "tok_s": "batch * width / step for width 1 (HF: (N - 1) * batch / decode time)",
            "rows_per_s": "batch * width / step; for width > 1 verification rows/s, not "
                          "accepted tokens",
            "floor_ms": "(weight bytes per step + KV bytes per step) / bandwidth; HF rows use "
                        "the KV at `context` (its KV grows to context + N during the run)",
            "floor_ratio": "step_ms / floor_ms",
        },
        "bandwidth": bandwidth,
        "models": {},
        "results": [],
        "skipped": [],
        "errors": [],
        "goals": [],
    }
    primary: dict[str, str] = {}
    out_dir = Path(args.out_dir)
    stem = f"gpu-{args.tag}" if args.tag else "gpu"
    json_path = out_dir / f"{stem}.json"

    for name in args.models:
        hf_config, model_dir = model_config(name)
        shape = ModelShape.from_config(hf_config)
        weights = weight_bytes_per_step(shape, itemsize)
        model_info: dict[str, Any] = {
            "model_dir": str(model_dir) if model_dir else None,
            "weights": "checkpoint" if model_dir else "random", "shape": vars(shape),
            **weights, "runners": []}
        data["models"][name] = model_info
        print(f"{name}: {weights['num_parameters'] / 1e6:,.1f}M parameters, "
              f"{weights['bytes_per_step'] / 1e6:,.1f} MB of weights per step", file=sys.stderr)
        for variant in variants(args):
            config = engine_config(args, variant)
            try:
                backend = select_backend(config)
            except ConfigError as exc:  # e.g. triton on a CPU without the interpreter
                data["skipped"].append({"model": name, "variant": vars(variant),
                                        "reason": str(exc)})
                print(f"  {name} / {variant}: skipped ({exc})", file=sys.stderr)
                continue
            label = variant_label(backend.name, backend.cuda_graphs)
            if any(r["label"] == label for r in model_info["runners"]):
                continue  # e.g. auto is triton+graphs on a GPU: measured already
            try:
                runner_info, rows = measure_quickdraft(
                    args, name, hf_config, model_dir, config, backend, shape, weights,
                    bandwidth)
            except Exception as exc:
                _record_error(data, name, f"quickdraft {label}", exc)
                continue
            model_info["runners"].append(runner_info)
            data["results"] += rows
            primary.setdefault(name, label)
        if args.hf_batch_sizes:
            hf = None
            try:
                start = time.perf_counter()
                hf = build_hf(hf_config, model_dir, device, dtype)
                model_info["hf_load_s"] = time.perf_counter() - start
                for batch in args.hf_batch_sizes:
                    try:
                        row = measure_hf(hf, name, batch, args, shape, weights, bandwidth)
                    except Exception as exc:
                        _record_error(data, name, f"hf batch {batch}", exc)
                        free_memory()
                        continue
                    data["results"].append(row)
                    print(f"  {name} / HF generate batch {batch:>4}: "
                          f"{fmt(row['step_ms'])} ms/step, {fmt(row['tok_s'])} tok/s",
                          file=sys.stderr)
            except Exception as exc:
                _record_error(data, name, "hf load", exc)
            finally:
                del hf
                free_memory()
        data["goals"] = goals(data["results"], primary)
        write_json(data, json_path)  # after every model: a long run can be cut short

    print(f"wrote {json_path}", file=sys.stderr)
    if args.plot:
        png_path = out_dir / f"{stem}.png"
        plot(data, png_path)
        print(f"wrote {png_path}", file=sys.stderr)
    print(f"\nbandwidth {bandwidth['gbs']:.1f} GB/s ({bandwidth['method_description']}); "
          f"device {info['gpu']['name'] or device}; context {args.context}\n")
    print(table(data["results"]))
    print("\n* tok/s: batch x width / step; for width > 1 verification rows/s (the tokens a "
          "step yields depend on the acceptance rate).\n")
    print("Goals (batch 1, width 1):\n")
    print(goals_text(data["goals"]))
    if data["errors"]:
        print(f"\n{len(data['errors'])} measurement(s) failed: see 'errors' in {json_path}")
    return data


def _record_error(data: dict[str, Any], model: str, what: str, exc: BaseException) -> None:
    print(f"  {model} / {what}: FAILED: {exc!r}", file=sys.stderr)
    traceback.print_exc(file=sys.stderr)
    data["errors"].append({"model": model, "what": what, "error": repr(exc),
                           "traceback": traceback.format_exc()})
    free_memory()


if __name__ == "__main__":
    main()
