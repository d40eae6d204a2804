"""Measurements behind ``benchmarks/gpu.py``, all on the device: timing and memory bandwidth,
quickdraft's ``ModelRunner`` per kernel-backend variant, HF ``generate``, freeing memory
between runs, and the device's description for the results."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import fmt, median, summarize
from gpu_models import floor_seconds, kv_bytes_per_step

from quickdraft.engine.backend import KernelBackend
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.hf_model_dir import dtype_kwarg
from quickdraft.engine.model_runner import ModelRunner
from quickdraft.engine.models.llama_layers import ModelShape

BLOCK_SIZE = 16


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

