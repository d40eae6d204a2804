"""The triton backend and its graph runner give the torch path's tokens.

Without a GPU the Triton kernels run under the interpreter on CPU tensors, and "graphs" are
:func:`engine.cuda_graphs.eager_capture` (replay re-runs the captured step function over the
same static buffers), which exercises the bucketing, padding and buffer plumbing. With a
GPU, every test runs on it: compiled kernels and real CUDA graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quickdraft.engine.backend import select_backend
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.cuda_graphs import token_buckets
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.sampling_params import SamplingParams

triton = pytest.importorskip("triton")

# On a GPU machine the same tests run the compiled kernels and real graphs (conftest sets
# TRITON_INTERPRET=1 only where there is no GPU, and the interpreter needs CPU tensors)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

PROMPTS = ["Hello there, how are you?", "The capital of France is", "def f(x):\n    return x",
           "One two three four one two three four one two"]


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert token_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def generate(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[int]]:
    """Staggered arrivals: later requests join while earlier ones decode or verify."""
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params[i])
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return out


def run(config: EngineConfig, graphs: bool | None, params: list[SamplingParams]):
    backend = None
    if graphs is not None:
        if not torch.cuda.is_available() and not triton_interpreting():
            pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
        backend = replace(select_backend(replace(config, kernel_backend="triton")),
                          cuda_graphs=graphs)
    engine = LLMEngine(config, progress=False, backend=backend)
    free = engine.kv.num_free_blocks
    out = generate(engine, params)
    assert engine.kv.num_free_blocks == free  # every block came back
    return out, engine


def triton_interpreting() -> bool:
    from quickdraft.kernels import triton_common

    return triton_common.INTERPRET


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> EngineConfig:
    # max_model_len 512: the graphs use 2 KV splits (split-KV path, without batch
    # invariance); block size 5 is odd
    return EngineConfig(model=str(tiny_model_dir), dtype="float32", device=DEVICE,
                        num_kv_blocks=96, block_size=5, max_model_len=512,
                        cuda_graph_max_tokens=8, measure_step_cost=False, num_threads=1,
                        batch_invariant=False)


def test_triton_backend_and_graphs_equal_the_torch_path(config):
    params = [SamplingParams(temperature=0, max_tokens=10)] * 3 + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)]
    want, _ = run(config, None, params)
    eager, engine = run(config, False, params)
    assert engine.runner.graphs is None and eager == want
    graphed, engine = run(config, True, params)
    assert graphed == want
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0  # decode and verification steps
    assert sorted(graphs.graphs) == [1, 2, 4, 8]


def test_batch_invariant_speculation_equals_plain_decoding_in_bf16(config):
    """The GPU path's promise in its default dtype: with the batch-invariant kernels, greedy
    bf16 output with suffix speculation (chains only: no tree step) equals plain decoding
    on the same backend, 4 staggered requests, graphs on. (Under the interpreter the dots are
    numpy's; on a GPU this runs the compiled kernels, where it is the real check.)"""
    config = replace(config, dtype="bfloat16", batch_invariant=True, speculation="suffix")
    params = [SamplingParams(temperature=0, max_tokens=12)] * len(PROMPTS)
    spec, engine = run(config, True, params)
    plain, _ = run(replace(config, speculation="off"), True, params)
    assert spec == plain
    stats = engine.speculator.stats
    assert stats.num_tree_steps == 0 and not engine.speculator.verify_trees
    assert stats.by_source.get("suffix", [0])[0] > 0  # drafts were verified


def test_graphs_without_speculation(config):
    config = replace(config, speculation="off")
    params = [SamplingParams(temperature=0, max_tokens=6)] * len(PROMPTS)
    want, _ = run(config, None, params)
    graphed, engine = run(config, True, params)
    assert graphed == want and engine.runner.graphs.max_query_len == 1


@pytest.mark.slow
def test_default_model_fast_path_equals_reference_path(default_model_dir):
    """The embedded default model (fp32 greedy): prefill through the Triton kernels, decode by
    graph replay, against the torch reference path. Under the interpreter one SmolLM2 decode
    step takes ~2.5 s, so the prompt and the answer are short."""
    # (the batch-invariant GEMM would run the 49152-row LM head through the interpreter)
    config = EngineConfig(model=str(default_model_dir), dtype="float32", device=DEVICE,
                          num_kv_blocks=32, max_model_len=128, speculation="off",
                          cuda_graph_max_tokens=1, measure_step_cost=False, num_threads=1,
                          batch_invariant=torch.cuda.is_available())
    params = SamplingParams(temperature=0, max_tokens=6)

    def answer(engine: LLMEngine) -> list[int]:
        engine.add_request("0", "The capital of France is", params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for d in engine.step() for t in d.token_ids]
        return tokens

    want = answer(LLMEngine(config, progress=False))
    if not torch.cuda.is_available() and not triton_interpreting():
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    backend = replace(select_backend(replace(config, kernel_backend="triton")),
                      cuda_graphs=True)
    engine = LLMEngine(config, progress=False, backend=backend)
    assert answer(engine) == want and len(want) == 6
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays == 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_graphs_equal_the_torch_path(default_model_dir):
    """On a GPU: the default model, fp32 greedy, compiled Triton kernels + CUDA graphs vs the
    torch reference path on the same GPU."""
    config = EngineConfig(model=str(default_model_dir), dtype="float32", device="cuda",
                          num_kv_blocks=256, measure_step_cost=False)
    params = [SamplingParams(temperature=0, max_tokens=32)] * len(PROMPTS)
    want = generate(LLMEngine(replace(config, kernel_backend="torch"), progress=False), params)
    engine = LLMEngine(replace(config, kernel_backend="triton"), progress=False)
    assert engine.backend.cuda_graphs
    assert generate(engine, params) == want
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("invariant", [False, True], ids=["tuned", "batch-invariant"])
def test_triton_model_runs_the_backends_kernels(config, invariant):
    """bf16 on the triton backend: the layer ops are Triton's (never the fused CPU ops, also
    under the interpreter on a CPU), and every linear layer multiplies with the backend's
    GEMM (the batch-invariant one) or F.linear (tuned)."""
    from quickdraft.engine.models.llama_layers import Linear
    from quickdraft.kernels import triton_matmul

    if not torch.cuda.is_available() and not triton_interpreting():
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    config = replace(config, dtype="bfloat16", batch_invariant=invariant, cuda_graphs=False,
                     kernel_backend="triton")
    engine = LLMEngine(config, progress=False)
    model = engine.runner.model
    assert model.ops is engine.runner.backend.layer_ops
    want = triton_matmul.linear if invariant else None
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.gemv is want for m in linears)
