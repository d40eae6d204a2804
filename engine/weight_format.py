"""Which weights the linear layers multiply by: the GGUF's own 4-bit blocks or dense ones.

A model converted from a GGUF (``engine.loader``) keeps the path of its source in the cache
marker. When that file holds 4-bit layer matrices (``engine.gguf_quant``: Q4_1, Q4_0,
Q4_K), the CPU bf16 engine can run them natively, 4.5-5 bits a weight instead of 16, on one
of two kernels: ``"int4-q8"`` (``kernels.cpu_q4q8``: activations rounded to 8 bits per block
of 32 as llama.cpp does, exact integer block products, an extra row of a verification step
costs a fraction of a decode step) or ``"int4"`` (torch's int4 kernel, bf16 activations,
about one decode step per extra row). Which is fastest depends on the CPU (torch's int4
kernel is about 3x slower on AVX2-only machines than on AVX512-BF16 ones), so
``weights="auto"`` times a 1-row decode step plus a 4-row verification step each way at
start-up and keeps the fastest; ``"int4-q8"`` / ``"int4"`` force one (an error where it
cannot run) and ``"dense"`` never uses 4-bit weights. The
decision and its reason go to the start-up log, ``/health`` (``"weights"``) and the
``quickdraft serve`` start-up lines. Dense weights stay loaded. The embedding lookup is
dense in any case; with ``"int4-q8"`` the LM head runs on the file's own Q8_0 blocks when it
has them (SmolLM2's tied embedding is Q8_0: 30 MB read per step instead of 56 MB in bf16),
with ``"int4"`` it stays dense.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quickdraft.engine import loader
from quickdraft.engine.config import ConfigError

log = logging.getLogger(__name__)

# the 4-bit formats, fastest first on the machines measured, and their kernel
# (engine.models.llama_weights.FOUR_BIT_KERNELS)
KERNEL_OF = {"int4-q8": "q8", "int4": "torch"}
DERIVED_FILE_PREFIX = "q4_weights"  # files quickdraft derives beside a checkpoint
Q4_CACHE_FILE = f"{DERIVED_FILE_PREFIX}-v3.safetensors"  # bump the version on change


@dataclass(frozen=True)
class WeightChoice:
    format: str  # "int4-q8" | "int4" | "dense"
    reason: str
    int4_layers: int = 0  # linear layers running on 4-bit weights
    native_layers: int = 0  # decoder layers run in one native call each (kernels.cpu_layer)

    def describe(self) -> dict[str, Any]:
        described = {"format": self.format, "int4_layers": self.int4_layers,
                     "native_layers": self.native_layers, "reason": self.reason}
        if self.format == "int4-q8":
            from quickdraft.kernels import cpu_q4q8

            # from how many rows a pass runs on AMX tiles (4-bit, Q8_0); (0, 0): never
            described["amx_rows"] = list(cpu_q4q8.amx_rows())
        return described


def gguf_source(model_dir: Path | None) -> Path | None:
    """The GGUF a cached conversion was made from, if it is still there."""
    if model_dir is None:
        return None
    try:
        marker = json.loads((Path(model_dir) / loader.COMPLETE_MARKER).read_text())
        source = Path(marker["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


def _why_not(runner: Any, model_dir: Path | None, kernel: str) -> str | None:
    """Why 4-bit weights on ``kernel`` ("torch" or "q8") cannot run here (None: they can)."""
    from quickdraft.kernels import cpu_int4, cpu_q4q8

    if runner.device.type != "cpu":
        return f"the model runs on {runner.device.type}, the 4-bit kernels are CPU-only"
    if runner.dtype != torch.bfloat16:
        return f"dtype {runner.config.dtype} (the 4-bit kernels compute in bfloat16)"
    if runner.backend.name != "torch":
        return f"kernel backend {runner.backend.name}"
    if kernel == "torch" and not cpu_int4.available():
        return "this torch build has no CPU int4 kernel"
    if kernel == "q8" and not cpu_q4q8.available():
        return "the q4q8 kernel is not built here (gcc or AVX2/FMA/F16C missing)"
    if gguf_source(model_dir) is None:
        return "the model was not loaded from a GGUF file (or the file has moved)"
    return None


def choose(runner: Any, model_dir: Path | None, hf_config: Any, requested: str,
           repeats: int = 5) -> WeightChoice:
    """Apply the weight format to ``runner.model`` and say which one and why."""
    if requested == "dense":
        return WeightChoice("dense", "dense weights requested (--weights dense)")
    wanted = [requested] if requested != "auto" else list(KERNEL_OF)
    possible = {fmt: _why_not(runner, model_dir, KERNEL_OF[fmt]) for fmt in wanted}
    candidates = [fmt for fmt, reason in possible.items() if reason is None]
    if not candidates:
        whys = set(possible.values())
        reason = (whys.pop() or "") if len(whys) == 1 else "; ".join(
            f"{fmt}: {why}" for fmt, why in possible.items())
        if requested != "auto":
            raise ConfigError(f"--weights {requested} cannot run here: {reason}")
        return WeightChoice("dense", f"4-bit weights not possible: {reason}")
    source = gguf_source(model_dir)
    assert source is not None and model_dir is not None
    q4 = _q4_weights(source, Path(model_dir), hf_config)
    if requested != "auto":
        layers = runner.model.attach_int4_weights(q4, KERNEL_OF[requested])
        if layers == 0:
            raise ConfigError(f"--weights {requested}: {source.name} has no Q4_0/Q4_1/Q4_K "
                              "layer matrices")
        runner.model.use_int4(True)
        return WeightChoice(requested, f"{requested} weights requested (--weights "
                            f"{requested})", layers)
    times = {"dense": _time(runner, repeats)}
    layers = 0
    for fmt in candidates:
        layers = runner.model.attach_int4_weights(q4, KERNEL_OF[fmt])
        if layers == 0:
            return WeightChoice("dense", f"{source.name} has no Q4_0/Q4_1/Q4_K layer matrices")
        runner.model.use_int4(True)
        times[fmt] = _time(runner, repeats)
        runner.model.use_int4(False)
    best = min(times, key=times.__getitem__)
    if best == "dense":
        runner.model.attach_int4_weights({})  # drop the packed copies
    else:
        if best != candidates[-1]:  # the last one timed is still attached
            layers = runner.model.attach_int4_weights(q4, KERNEL_OF[best])
        runner.model.use_int4(True)
    why = ("measured a 1-row decode step + a 4-row verification step: "
           + ", ".join(f"{fmt} {ms:.2f} ms" for fmt, ms in times.items()))
    return WeightChoice(best, why, layers if best != "dense" else 0)


def _q4_weights(source: Path, model_dir: Path, hf_config: Any) -> dict[str, Any]:
    """The GGUF's 4-bit matrices, from the conversion's cache directory once read."""
    from quickdraft.engine import gguf_quant

    cached = model_dir / Q4_CACHE_FILE
    if cached.is_file():
        try:
            return gguf_quant.load_q4_weights(cached)
        except Exception as exc:  # a damaged cache file: read the GGUF again
            log.warning("ignoring %s (%s)", cached, exc)
    model_type = getattr(hf_config, "model_type", "llama")
    # (the Q8_0 or Q6_K head, when there is one, runs with int4-q8; the int4 path keeps it
    # dense)
    q4 = gguf_quant.read_q4_weights(
        source, llama_permute=model_type in ("llama", "mistral"),
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)))
    try:
        gguf_quant.save_q4_weights(cached, q4)
    except OSError as exc:  # a read-only cache still works, only slower to start
        log.warning("cannot cache the 4-bit weights in %s: %s", cached, exc)
    return q4


def _time(runner: Any, repeats: int) -> float:
    """Median ms of a 1-token forward plus a 4-token one (a decode step and a verification
    of 3 drafts: the 4-bit kernels differ most in what an extra row costs)."""
    runner.time_forward(1)  # warm-up
    runner.time_forward(4)
    return statistics.median(
        (runner.time_forward(1) + runner.time_forward(4)) * 1e3 for _ in range(repeats))
