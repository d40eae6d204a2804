"""benchmarks/gpu.py: the byte counts behind its bandwidth floor (gpu_models.py), a CPU smoke
run of the whole script (tiny model, torch backend, HF baseline, JSON + PNG), and on a real GPU
the default model with the triton backend and CUDA graphs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from quickdraft.engine.models.llama_layers import ModelShape

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCH / "gpu.py"
sys.path.insert(0, str(BENCH))

import gpu_models  # noqa: E402


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickdraft_gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu = _load_script()


def test_weight_bytes_llama_8b_shape():
    shape = ModelShape.from_config(gpu_models.model_config("llama-8b")[0])
    w = gpu_models.weight_bytes_per_step(shape, 2)
    assert w["num_parameters"] == 8_030_261_248  # Llama 3.1 8B
    assert w["parameter_bytes"] == pytest.approx(16.06e9, rel=1e-3)
    embedding = 128256 * 4096
    # untied: the LM head is read every step, the embedding table only one row per token
    assert w["num_parameters_per_step"] == w["num_parameters"] - embedding
    assert w["bytes_per_step"] == 2 * (8_030_261_248 - embedding)
    assert w["bytes_per_step"] == pytest.approx(15.01e9, rel=1e-3)
    assert not w["tied_embedding"]


def test_weight_bytes_tied_counts_the_matrix_once():
    shape = ModelShape.from_config(gpu_models.model_config("llama-1b")[0])
    w = gpu_models.weight_bytes_per_step(shape, 2)
    assert w["tied_embedding"]
    assert w["num_parameters"] == w["num_parameters_per_step"] == 1_235_814_400  # Llama 3.2 1B
    assert gpu_models.weight_bytes_per_step(shape, 4)["bytes_per_step"] == 2 * w["bytes_per_step"]


def test_kv_bytes_and_floor():
    shape = ModelShape.from_config(gpu_models.model_config("llama-8b")[0])
    # batch x (context + width) x layers x (K and V) x kv_heads x head_dim x 2 bytes
    assert gpu_models.kv_bytes_per_step(shape, 1, 512, 1, 2) == 513 * 32 * 2 * 8 * 128 * 2
    assert gpu_models.kv_bytes_per_step(shape, 8, 512, 5, 2) == 8 * 517 * 32 * 2 * 8 * 128 * 2
    assert gpu_models.floor_seconds(2_000_000_000, 1_000_000_000, 3000.0) == pytest.approx(1e-3)


def test_cpu_smoke_run(tmp_path: Path):
    data = gpu.main(["--device", "cpu", "--models", "tiny", "--quick", "--kernel-backend",
                     "torch", "--plot", "--out-dir", str(tmp_path)])
    assert not data["errors"]
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert saved["machine"]["command"].startswith("python benchmarks/gpu.py --device cpu")
    assert saved["bandwidth"]["gbs"] > 0 and saved["bandwidth"]["method"] in ("copy", "sum")
    rows = saved["results"]
    sizes = saved["config"]["batch_sizes"]
    ours = [r for r in rows if r["impl"] == "quickdraft"]
    hf = [r for r in rows if r["impl"] == "hf"]
    assert sorted(r["batch"] for r in ours) == sorted(sizes)
    assert sorted(r["batch"] for r in hf) == sorted(sizes)
    for r in ours:
        assert r["variant"] == "torch" and r["width"] == 1
        assert r["step_ms"] > 0 and r["tok_s"] > 0 and r["floor_ms"] > 0
        assert r["floor_ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
    for r in hf:  # (HF's step is a difference of two single timings with --quick: on a
        # loaded machine it can come out <= 0, which the benchmark reports as "-")
        assert (r["tok_s"] is None) == (r["step_ms"] is None)
        assert r["step_ms"] is None or (r["tok_s"] > 0 and r["step_ms"] > 0)
    assert any(r["step_ms"] is not None for r in hf)
    model = saved["models"]["tiny"]
    assert model["bytes_per_step"] > 0 and model["runners"][0]["parameters_match"]
    [goal] = saved["goals"]
    assert goal["model"] == "tiny" and goal["met"] is None
    assert goal["vs_hf"] is None or goal["vs_hf"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_model_on_gpu(tmp_path: Path):
    pytest.importorskip("triton")
    data = gpu.main(["--device", "cuda", "--models", "default", "--batch-sizes", "1",
                     "--kernel-backend", "triton", "--repeats", "5", "--warmup", "2",
                     "--hf-new-tokens", "8", "--hf-repeats", "1", "--out-dir", str(tmp_path)])
    assert not data["errors"]
    [ours] = [r for r in data["results"] if r["impl"] == "quickdraft"]
    assert ours["variant"] == "triton+graphs" and ours["cuda_graph_step"]
    assert ours["tok_s"] > 0 and ours["floor_ratio"] > 0
    assert data["goals"][0]["vs_hf"] is not None
