"""The default model on its GGUF's own 4-bit weights (``--weights int4`` on torch's kernel,
``--weights int4-q8`` with 8-bit activations): chosen and reported, close to the fp32 oracle,
clear errors where it cannot run. (Batch invariance of the 4-bit and dense bf16 paths:
test_batch_invariance.py.)"""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.step_plan import StepPlan
from quickdraft.kernels import cpu_attention, cpu_int4, cpu_q4q8

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (cpu_int4.available() and cpu_attention.available()),
                                 reason="needs torch's CPU int4 ops and the C kernels")]

PROMPT = ("Summarise: the quick brown fox jumps over the lazy dog. The dog sleeps on. The fox "
          "runs home.")


def _engine(**kw) -> LLMEngine:
    kw.setdefault("speculation", "off")
    return LLMEngine(EngineConfig(measure_step_cost=False, **kw), progress=False)


@pytest.fixture(scope="module", params=["int4", "int4-q8"])
def int4_engine(request) -> LLMEngine:
    if request.param == "int4-q8" and not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    return _engine(weights=request.param)


def test_int4_is_chosen_and_reported(int4_engine):
    w = int4_engine.runner.weights.describe()
    assert w["format"] == int4_engine.config.weights
    assert w["int4_layers"] == 4 * 30  # qkv, o, gate_up, down
    assert w["native_layers"] == 30
    # int4-q8 says from how many rows its passes run on AMX tiles ([0, 0]: never, no AMX)
    assert ("amx_rows" in w) == (w["format"] == "int4-q8")
    if "amx_rows" in w:
        assert w["amx_rows"] == list(cpu_q4q8.amx_rows())
        assert cpu_q4q8.uses_amx() or w["amx_rows"] == [0, 0]
    # int4-q8 also runs the LM head on the file's Q8_0 blocks (the tied embedding)
    head = int4_engine.runner.model.lm_head
    assert isinstance(head.int4, cpu_q4q8.Q8Q8Weight) == (w["format"] == "int4-q8")
    assert head.use_int4 == (w["format"] == "int4-q8")


def _prompt_logits(llm: LLMEngine, ids: list[int]) -> torch.Tensor:  # [len, vocab] fp32
    n, bs = len(ids), llm.config.block_size
    plan = StepPlan(ids, list(range(n)), [0, n], [n], [list(range(-(-n // bs)))],
                    list(range(n)), [])
    return llm.runner.forward_logits(plan).float()


def test_logits_close_to_the_fp32_dequantized_model(int4_engine):
    """Stated tolerance, in units of each position's logit standard deviation against the
    fp32 model on the same (dequantized) weights, and measured on the AVX512-BF16 machine
    (the dense bf16 engine: mean 0.039, worst 0.39, same argmax at 98 % of the positions):
    - int4 (bf16 activations, bf16-rounded block scales): mean at most 1.5x bf16's (0.053),
      worst under 0.5 (0.37), argmax >= 90 % (96 %);
    - int4-q8 (activations rounded to 8 bits per block of 32, as llama.cpp does on the same
      GGUF): mean at most 3x bf16's (0.095), worst under 1.2 (0.88), argmax >= 90 % (96 %).
    """
    fp32 = _engine(dtype="float32")
    ids = fp32.apply_chat_template([{"role": "user", "content": PROMPT}])
    want = _prompt_logits(fp32, ids)
    spread = want.std(dim=-1, keepdim=True)
    got = _prompt_logits(int4_engine, ids)
    err = (got - want).abs() / spread
    bf16_err = (_prompt_logits(_engine(weights="dense"), ids) - want).abs() / spread
    mean_factor, worst = (3.0, 1.2) if int4_engine.config.weights == "int4-q8" else (1.5, 0.5)
    assert float(err.mean()) <= mean_factor * float(bf16_err.mean())
    assert float(err.max()) < worst
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)


def test_int4_where_it_cannot_run_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="not loaded from a GGUF"):
        _engine(model=str(tiny_model_dir), weights="int4")
    with pytest.raises(ConfigError, match="bfloat16"):
        _engine(dtype="float32", weights="int4")
    llm = _engine(model=str(tiny_model_dir))  # auto: dense, with the reason
    assert llm.runner.weights.format == "dense"
    assert "GGUF" in llm.runner.weights.reason
