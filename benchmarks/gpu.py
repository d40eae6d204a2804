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

This file holds the CLI and the run over models and variants; beside it ``gpu_models.py``
(model configs, the bytes a step reads, the floor), ``gpu_measure.py`` (timing, bandwidth,
the quickdraft and HF measurements, the device's description) and ``gpu_report.py`` (goals,
table, plot).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common`, also under `python -m`

from common import RESULTS_DIR, fmt, machine_info, write_json
from gpu_measure import (
    build_hf,
    engine_config,
    free_memory,
    gpu_info,
    measure_bandwidth,
    measure_hf,
    measure_quickdraft,
    variant_label,
    variants,
)
from gpu_models import MODEL_NAMES, model_config, weight_bytes_per_step
from gpu_report import goals, goals_text, plot, table

from quickdraft.engine.backend import select_backend
from quickdraft.engine.config import DTYPES, KERNEL_BACKENDS, ConfigError
from quickdraft.engine.models.llama_layers import ModelShape

MAX_WIDTH = 17  # EngineConfig allows at most 16 speculative tokens


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
