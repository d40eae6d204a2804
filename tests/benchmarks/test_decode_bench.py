"""benchmarks/decode.py: its report (tables, plot) from a result, and its peer lookup, without
running the (minutes-long) measurements; the row-cost curve on a tiny engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import decode  # noqa: E402
import decode_extras  # noqa: E402


def _result(llama: dict, contention: bool = True) -> dict:
    rows = [{"batch": b, "int4": {"decode_tok_s": 100.0 * b}, "bf16": {"decode_tok_s": 80.0 * b},
             "hf": {"decode_tok_s": 30.0 * b}, "floor_tok_s": 200.0 * b} for b in (1, 8)]
    curve = {"rows": [1, 2, 4], "ms": [9.0, 10.0, 12.0], "ratio": [1.0, 1.11, 1.33]}
    engine = {"decode_tok_s": 90.0, "max_gap_ms": 20.0, "ttft_ms": 30.0, "threads": {}}
    cont = {"idle": {"a": engine}, "busy": {"a": {**engine, "decode_tok_s": 60.0}},
            "ratio": {"a": 0.667}, "competitor": "busy loop"} if contention else {}
    return {"results": rows, "llama_cpp": llama, "row_cost": {"int4": curve, "bf16": curve},
            "contention": cont}


def test_tables_and_plot(tmp_path):
    data = _result({"decode_tok_s": 50.0, "version": "0.3.36", "threads": 2})
    text = decode.tables(data)
    assert "| 1 | 100 | 80 | 30 | 1.25 | 3.33 | 200 |" in text
    assert "quickdraft int4 / llama.cpp = 2" in text
    assert "1.33x" in text and "0.667" in text
    decode.plot(data, tmp_path / "d.png", "title")
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_a_missing_peer_is_said_not_failed():
    text = decode.tables(_result({"skipped": "llama-cpp-python is not installed"},
                                 contention=False))
    assert "llama.cpp: llama-cpp-python is not installed" in text
    assert "busy" not in text


def test_find_llama_cpp_python(monkeypatch):
    monkeypatch.delenv("QUICKDRAFT_LLAMA_CPP_PYTHON", raising=False)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert decode_extras.find_llama_cpp_python(None) is None
    assert decode_extras.find_llama_cpp_python("/nonexistent/python") in (None, sys.executable)


@pytest.mark.parametrize("weights", ["dense"])
def test_row_cost_curve_on_a_tiny_engine(tiny_model_dir, weights):
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine

    llm = LLMEngine(EngineConfig(model=str(tiny_model_dir), weights=weights,
                                 speculation="off", num_kv_blocks=32), progress=False)
    curve = decode_extras.row_cost_curve(llm, [1, 2, 4], repeats=3, context=16)
    assert curve["rows"] == [1, 2, 4] and curve["ratio"][0] == 1.0
    assert all(ms > 0 for ms in curve["ms"])
