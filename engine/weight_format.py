"""Which weights the linear layers multiply by: the GGUF's own 4-bit blocks or dense ones.

A model converted from a GGUF (``engine.loader``) keeps the path of its source in the cache
marker. When that file holds 4-bit layer matrices (``engine.gguf_quant``: Q4_1, Q4_0,
Q4_K), the CPU bf16 engine can run them natively (``kernels.cpu_int4``): 4.5 bits a weight
instead of 16. Whether that is faster depends on the CPU (the issue that asked for it
measured torch's int4 kernel about 3x slower on AVX2-only machines than on AVX512-BF16
ones; with torch forced to its AVX2 kernels on an AVX512-BF16 machine, auto chose dense), so
``weights="auto"`` times one decode step each way at start-up and keeps the faster;
``"int4"`` forces it (an error where it cannot run) and ``"dense"`` never uses it. The
decision and its reason go to the start-up log, ``/health`` (``"weights"``) and the
``quickdraft serve`` start-up lines. Dense weights stay loaded: the LM head and embedding
are dense in any case (SmolLM2's tied embedding is Q8_0, not a 4-bit format).
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

DERIVED_FILE_PREFIX = "q4_weights"  # files quickdraft derives beside a checkpoint
Q4_CACHE_FILE = f"{DERIVED_FILE_PREFIX}-v1.safetensors"  # bump the version on change


@dataclass(frozen=True)
class WeightChoice:
    format: str  # "int4" | "dense"
    reason: str
    int4_layers: int = 0  # linear layers running on 4-bit weights
    native_layers: int = 0  # decoder layers run in one native call each (kernels.cpu_layer)

    def describe(self) -> dict[str, Any]:
        return {"format": self.format, "int4_layers": self.int4_layers,
                "native_layers": self.native_layers, "reason": self.reason}


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


def _why_not(runner: Any, model_dir: Path | None) -> str | None:
    """Why the int4 path cannot run here (None: it can)."""
    from quickdraft.kernels import cpu_int4

    if runner.device.type != "cpu":
        return f"the model runs on {runner.device.type}, the int4 kernel is CPU-only"
    if runner.dtype != torch.bfloat16:
        return f"dtype {runner.config.dtype} (the int4 kernel computes in bfloat16)"
    if runner.backend.name != "torch":
        return f"kernel backend {runner.backend.name}"
    if not cpu_int4.available():
        return "this torch build has no CPU int4 kernel"
    if gguf_source(model_dir) is None:
        return "the model was not loaded from a GGUF file (or the file has moved)"
    return None


def choose(runner: Any, model_dir: Path | None, hf_config: Any, requested: str,
           repeats: int = 5) -> WeightChoice:
    """Apply the weight format to ``runner.model`` and say which one and why."""
    if requested == "dense":
        return WeightChoice("dense", "dense weights requested (--weights dense)")
    reason = _why_not(runner, model_dir)
    if reason is not None:
        if requested == "int4":
            raise ConfigError(f"--weights int4 cannot run here: {reason}")
        return WeightChoice("dense", f"int4 not possible: {reason}")
    source = gguf_source(model_dir)
    assert source is not None and model_dir is not None
    q4 = _q4_weights(source, Path(model_dir), hf_config)
    layers = runner.model.attach_int4_weights(q4)
    if layers == 0:
        if requested == "int4":
            raise ConfigError(f"--weights int4: {source.name} has no Q4_0/Q4_1/Q4_K layer "
                              "matrices")
        return WeightChoice("dense", f"{source.name} has no Q4_0/Q4_1/Q4_K layer matrices")
    if requested == "int4":
        runner.model.use_int4(True)
        return WeightChoice("int4", "int4 weights requested (--weights int4)", layers)
    int4_ms, dense_ms = _time_both(runner, repeats)
    faster = int4_ms < dense_ms
    runner.model.use_int4(faster)
    if not faster:
        runner.model.attach_int4_weights({})  # drop the packed copies
    why = (f"measured a batch-1 decode step: int4 {int4_ms:.2f} ms, dense bf16 "
           f"{dense_ms:.2f} ms")
    return WeightChoice("int4" if faster else "dense", why, layers if faster else 0)


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
    q4 = gguf_quant.read_q4_weights(
        source, llama_permute=model_type in ("llama", "mistral"),
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads)
    try:
        gguf_quant.save_q4_weights(cached, q4)
    except OSError as exc:  # a read-only cache still works, only slower to start
        log.warning("cannot cache the 4-bit weights in %s: %s", cached, exc)
    return q4


def _time_both(runner: Any, repeats: int) -> tuple[float, float]:
    """Median ms of a 1-token forward with int4 and with dense weights, interleaved."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for use in (True, False):  # warm-up
        runner.model.use_int4(use)
        runner.time_forward(1)
    for _ in range(repeats):
        for use in (True, False):
            runner.model.use_int4(use)
            times[use].append(runner.time_forward(1) * 1e3)
    return statistics.median(times[True]), statistics.median(times[False])
