"""The draft head in the engine, on a tiny random target with a head trained by the training
pipeline in seconds: greedy output with ``head`` and ``combined`` equals output without
speculation, token for token, at batch 1 (fp32 and bf16) and in a staggered batch of 8 with
preemption and the prefix cache on; sampled requests verify the head's chains with its own
q; no KV block leaks; the invariants hold after every step (tests/conftest.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from quickdraft.engine.config import ConfigError, EngineConfig
from quickdraft.engine.llm_engine import InvalidRequestError, LLMEngine
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.draft_head_train import TrainConfig, run
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.step_cost import StepCost
from tests.conftest import make_tiny_model
from tests.spec.test_spec_engine import GREEDY, PROMPTS, run_staggered

if TYPE_CHECKING:
    from quickdraft.spec.draft_head_runner import DraftHeadRunner


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("head-engine"), default_model_dir,
                           num_layers=4, seed=3)


@pytest.fixture(scope="module")
def head_dir(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("head")
    run(TrainConfig(out_dir=out, work_dir=out / "work", model=str(target), num_prompts=16,
                    num_second_stage=4, num_eval_prompts=2, max_new_tokens=24,
                    draft_vocab_size=2048, epochs=6, batch_size=4, ttt_steps=2,
                    warmup_steps=2))
    return out


def make_engine(target: Path, head: Path | None, speculation: str = "auto",
                dtype: str = "float32", num_kv_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(model=str(target), dtype=dtype, speculation=speculation,
                          draft_head=str(head) if head else None, measure_step_cost=False,
                          num_kv_blocks=num_kv_blocks, block_size=4)
    return LLMEngine(config, progress=False)


def test_auto_speculation_is_combined_with_a_head(target: Path, head_dir: Path) -> None:
    assert make_engine(target, head_dir).speculation == "combined"
    plain = make_engine(target, None)
    assert plain.speculation == "suffix"
    with pytest.raises(InvalidRequestError) as err:
        plain.add_request("x", "hi", speculation=SpeculationParams(method="head"))
    assert err.value.param == "speculation.method"
    with pytest.raises(ConfigError):
        EngineConfig(speculation="head", draft_head=None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["head", "combined"])
def test_greedy_batch1_equal_with_the_head(target: Path, head_dir: Path, dtype: str,
                                           method: str) -> None:
    plain = make_engine(target, None, "off", dtype)
    spec = make_engine(target, head_dir, method, dtype)
    for prompt in PROMPTS:
        want = plain.generate([prompt], GREEDY)[0].token_ids
        free = spec.kv.num_free_blocks
        assert spec.generate([prompt], GREEDY)[0].token_ids == want
        assert spec.kv.num_free_blocks == free
    by_source = spec.speculator.stats.by_source
    assert by_source.get("head", [0])[0] > 0  # the head drafted and was verified
    if method == "head":
        assert spec.speculator.stats.num_tree_steps > 0  # as trees


@pytest.mark.parametrize("method", ["head", "combined"])
def test_greedy_staggered_batch_with_preemption_equal(target: Path, head_dir: Path,
                                                      method: str) -> None:
    want, _ = run_staggered(make_engine(target, None, "off"), PROMPTS, GREEDY)
    spec = make_engine(target, head_dir, method, num_kv_blocks=48)  # too small for all 8
    free = spec.kv.num_free_blocks
    for _ in range(2):  # prefix cache cold, then warm
        got, _ = run_staggered(spec, PROMPTS, GREEDY)
        assert got == want
        assert spec.kv.num_free_blocks == free
    assert spec.scheduler.num_preemptions > 0
    assert spec.speculator.stats.by_source.get("head", [0])[0] > 0


def test_each_head_proposal_is_timed_for_the_policy(target: Path, head_dir: Path) -> None:
    """With measured costs the policy prices the head's proposals from their observed times
    (spec/draft_cost.py): each proposal the speculator makes is one observation."""
    config = EngineConfig(model=str(target), dtype="float32", speculation="head",
                          draft_head=str(head_dir), measure_step_cost=True,
                          num_kv_blocks=256, block_size=4)
    spec = LLMEngine(config, progress=False)
    cost = spec.speculator.draft_cost
    assert cost is not None
    assert spec.speculator.policy.draft_cost == cost.per_draft
    assert spec.speculator.policy.draft_fixed_cost == cost.fixed
    spec.speculator.policy.cost = StepCost.memory_bound()  # rows nearly free: it drafts
    proposals = []
    draft = spec.speculator.draft

    def counted(requests: list) -> None:
        proposals.append(len(requests))
        draft(requests)

    spec.speculator.draft = counted  # type: ignore[method-assign]
    free = spec.kv.num_free_blocks
    spec.generate(PROMPTS[:2], GREEDY)
    assert proposals and cost.num_samples == min(len(proposals), 16)
    assert spec.kv.num_free_blocks == free


def test_sampled_requests_verify_head_chains(target: Path, head_dir: Path) -> None:
    spec = make_engine(target, head_dir, "head")
    free = spec.kv.num_free_blocks
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i,
                             ignore_eos=True) for i in range(4)]
    outs = [spec.generate([p], s)[0] for p, s in zip(PROMPTS, params, strict=False)]
    assert all(len(o.token_ids) == 30 for o in outs)
    again = [spec.generate([p], s)[0] for p, s in zip(PROMPTS, params, strict=False)]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded
    assert spec.speculator.stats.by_source.get("head", [0])[0] > 0
    assert spec.kv.num_free_blocks == free


def _random_head_engines(out: Path, default_model_dir: Path, weights: str,
                         ) -> tuple[LLMEngine, LLMEngine]:
    """An untrained head for the default model saved in ``out``, and two bf16 engines on
    ``weights``: speculation off, and ``head`` with that head."""
    import torch

    from quickdraft.engine import loader
    from quickdraft.engine.models.llama_layers import ModelShape
    from quickdraft.spec.draft_head import (
        DraftHead,
        DraftHeadConfig,
        model_fingerprint,
        save_head,
    )

    shape = ModelShape.from_config(loader.load_config(default_model_dir))
    torch.manual_seed(0)
    save_head(DraftHead(DraftHeadConfig.for_target(shape, model_fingerprint(default_model_dir),
                                                   512)), out)

    def engine(speculation: str, draft_head: str | None) -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="bfloat16", weights=weights, draft_head=draft_head,
                                      speculation=speculation, measure_step_cost=False),
                         progress=False)

    return engine("off", None), engine("head", str(out))


def _native_head_engines(out: Path, default_model_dir: Path,
                         ) -> tuple[LLMEngine, LLMEngine, DraftHeadRunner]:
    """:func:`_random_head_engines` on q4q8 weights and the head's runner, whose layer runs
    natively (skips where the q4q8 kernel or the native layer is not built here)."""
    from quickdraft.kernels import cpu_layer, cpu_q4q8

    if not cpu_q4q8.available() or not cpu_layer.available():
        pytest.skip("no q4q8 kernel or native layer here")
    plain, spec = _random_head_engines(out, default_model_dir, "int4-q8")
    runner = spec.head
    assert runner is not None and runner.native is not None
    return plain, spec, runner

def _assert_head_serves_losslessly(plain: LLMEngine, spec: LLMEngine, prompts: list[str],
                                   max_tokens: int) -> None:
    """Greedy output with the head equals output without speculation; blocks come back; the
    head drafted."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    free = spec.kv.num_free_blocks
    for prompt in prompts:
        want = plain.generate([prompt], params)[0].token_ids
        assert spec.generate([prompt], params)[0].token_ids == want
    assert spec.kv.num_free_blocks == free
    assert spec.speculator.stats.by_source.get("head", [0])[0] > 0


def test_int4_head_on_the_default_model_is_lossless(tmp_path: Path,
                                                    default_model_dir: Path) -> None:
    """Where the target runs on 4-bit weights (the default model in bf16), the head's
    matrices are rounded to 4 bits too; greedy output still equals no speculation. The head
    is untrained (random drafts, nearly all rejected): exactness cannot lean on good drafts."""
    from quickdraft.kernels import cpu_int4

    if not cpu_int4.available():
        pytest.skip("no CPU int4 ops in this torch")
    plain, spec = _random_head_engines(tmp_path, default_model_dir, "int4")
    assert spec.head is not None and spec.head.kernel == "int4"
    _assert_head_serves_losslessly(plain, spec, PROMPTS[:3], max_tokens=24)


def test_native_head_layer_drafts_what_the_python_layer_drafts(tmp_path: Path,
                                                               default_model_dir: Path) -> None:
    """On q4q8 weights (the default model in bf16) the head's whole forward runs in one
    native call (kernels.cpu_layer.run_head_stack: fc, the gathers, the layer, the LM head),
    else its layer alone (kernels.cpu_layer.head_layer): the same kernels in the same order
    as the Python forward, so the same trees and chains with the same scores, bit for bit,
    at batch 1 and 2, also with the q4q8 matmuls on the AVX2-only kind's loop; and greedy
    serving with it equals no speculation."""
    import torch

    from quickdraft.engine import loader
    from quickdraft.engine.models.llama_layers import ModelShape
    from quickdraft.kernels import cpu_layer
    from quickdraft.spec.draft_head_runner import HeadInput

    plain, spec, runner = _native_head_engines(tmp_path, default_model_dir)
    shape = ModelShape.from_config(loader.load_config(default_model_dir))
    g = torch.Generator().manual_seed(1)
    width = len(runner.aux_layers) * shape.hidden_size
    feats = torch.randn(30, width, generator=g)
    tokens = torch.randint(0, shape.vocab_size, (31,), generator=g).tolist()
    inputs = [HeadInput(feats, tokens[1:], 0, 8, tuple(range(4)),
                        SamplingParams(temperature=0.0), None, max_depth=4),
              HeadInput(feats[:20], tokens[1:21], 0, 4, tuple(range(4, 8)),
                        SamplingParams(temperature=0.0), None, tree=False)]  # 3 rounds
    assert runner.native_stack is not None  # the whole forward in one call
    for batch in (inputs[:1], inputs):
        whole = runner.propose(batch)
        stack, runner.native_stack = runner.native_stack, None
        try:
            native = runner.propose(batch)  # the layer alone native
            weights, runner.native = runner.native, None
            try:
                python = runner.propose(batch)
            finally:
                runner.native = weights
        finally:
            runner.native_stack = stack
        cpu_layer.use_q4q8_loop(False)  # the AVX2-only kind's loop (the same on either)
        try:
            avx2 = runner.propose(batch)
        finally:
            cpu_layer.use_q4q8_loop(None)
        for w, a, b, c in zip(whole, native, python, avx2, strict=True):
            assert w.tree == a.tree == b.tree == c.tree
            assert w.scores == a.scores == b.scores == c.scores
            assert len(a.tree) > 1
    assert native[1].tree.max_depth == 4  # (this untrained head's tree is flat)
    # a step the attention kernel rejects (a block id out of range): None, nothing written
    from quickdraft.kernels.attention_metadata import build_metadata, pack_step

    kv = torch.zeros(2, 4, 16, runner.kv_heads, runner.head_dim, dtype=torch.bfloat16)
    meta = build_metadata([0, 2], [2], [[7]], 16)
    rows = torch.randn(2, shape.hidden_size).bfloat16()
    with torch.inference_mode():
        out = cpu_layer.head_layer(rows, rows, runner.native,
                                   runner.rotary.cos_sin(torch.arange(2)), kv, meta,
                                   runner.heads, runner.kv_heads, shape.rms_norm_eps,
                                   runner.scale)
    assert out is None and not kv.any()
    # the whole forward likewise, and for a token id, a position, a logit row, a round's
    # row or a tree mask out of range
    def whole_forward(ids: list[int], positions: list[int], block: int = 0,
                      picked: list[int] | None = None, fed: list[int] | None = None,
                      masks: list[int] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        layout, packed = pack_step([0, 2], [2], [[block]], 16)
        with torch.inference_mode():
            return cpu_layer.run_head_stack(runner.native_stack, ids, positions, rows, kv,
                                            layout, packed, masks, fed, picked)

    for bad in ({"block": 7}, {"ids": [1, shape.vocab_size]}, {"positions": [0, 1 << 40]},
                {"picked": [2]}, {"fed": [1, 0]}, {"fed": [0, 2]}, {"masks": [1]}):
        args = {"ids": [1, 2], "positions": [0, 1], **bad}
        assert whole_forward(**args) is None and not kv.any(), bad  # type: ignore[arg-type]
    done = whole_forward([1, 2], [0, 1])  # the same step in range: computed, K/V written
    assert done is not None and kv.any()
    vocab = runner.head.config.draft_vocab_size
    assert done[1].dtype == torch.float32 and done[1].shape == (2, vocab)
    _assert_head_serves_losslessly(plain, spec, PROMPTS[:2], max_tokens=16)


def test_native_head_layer_on_some_rows_equals_it_on_all(tmp_path: Path,
                                                         default_model_dir: Path) -> None:
    """``head_layer(..., rows)`` (a drafting round's new nodes among every node fed so far)
    gives those rows the bits of the call over every row and writes only their K/V; the
    other rows' cached K/V are read, never written. Also with the q4q8 matmuls on the
    AVX2-only kind's loop (on a VNNI machine: the other kind's; the same bits)."""
    import torch

    from quickdraft.kernels import cpu_layer
    from quickdraft.kernels.attention_metadata import build_metadata

    _, _, runner = _native_head_engines(tmp_path, default_model_dir)
    g = torch.Generator().manual_seed(3)
    h, base, nodes = runner.embed.shape[1], 21, 4
    emb = torch.randn(nodes, h, generator=g).bfloat16()
    hidden = torch.randn(nodes, h, generator=g).bfloat16()
    # a tree over the cached positions [0, base]: 0 and 1 children of the root, 2 of 0, 3 of 2
    masks, depths = [0b1, 0b10, 0b101, 0b1101], [1, 1, 2, 3]
    meta = build_metadata([0, nodes], [base + 1 + nodes], [[0, 1]], 16, tree_mask=masks)
    cos, sin = runner.rotary.cos_sin(torch.tensor([base + d for d in depths]))
    kv0 = torch.randn(2, 2, 16, runner.kv_heads, runner.head_dim, generator=g).bfloat16()
    weights = runner.native

    def layer(idx: torch.Tensor, cache: torch.Tensor,
              rows: torch.Tensor | None = None) -> torch.Tensor | None:
        return cpu_layer.head_layer(emb[idx], hidden[idx], weights, (cos[idx], sin[idx]), cache,
                                    meta, runner.heads, runner.kv_heads, 1e-5, runner.scale,
                                    rows)

    with torch.inference_mode():
        every = kv0.clone()
        want = layer(torch.arange(nodes), every)
        assert want is not None
        for avx2_loop, rows in itertools.product((False, True), ([2, 3], [3], [0, 1, 2, 3])):
            cache = every.clone()  # the other rows' K/V cached as the full call left them
            slots = (base + 1 + torch.tensor(rows)).tolist()
            cache.flatten(1, 2)[:, slots] = kv0.flatten(1, 2)[:, slots]  # theirs not yet
            idx = torch.tensor(rows)
            cpu_layer.use_q4q8_loop(False if avx2_loop else None)
            try:
                got = layer(idx, cache, rows=idx)
            finally:
                cpu_layer.use_q4q8_loop(None)
            assert got is not None and torch.equal(got, want[idx]), (avx2_loop, rows)
            assert torch.equal(cache, every), (avx2_loop, rows)
        untouched = kv0.clone()  # a row past the step's: declined, nothing written
        assert layer(torch.tensor([0]), untouched, rows=torch.tensor([nodes])) is None
        assert torch.equal(untouched, kv0)


def test_native_head_forward_at_logit_rows_equals_it_at_every_row(
        tmp_path: Path, default_model_dir: Path) -> None:
    """``run_head_stack(..., logit_rows)`` (a catch-up: only each request's last row goes past
    the attention) gives those rows' outputs and logits the bits of the call over every row
    and writes every row's K/V alike, on either CPU kind's q4q8 loop."""
    import torch

    from quickdraft.kernels import cpu_layer
    from quickdraft.kernels.attention_metadata import pack_step

    _, _, runner = _native_head_engines(tmp_path, default_model_dir)
    assert runner.native_stack is not None
    g = torch.Generator().manual_seed(5)
    width = len(runner.aux_layers) * runner.embed.shape[1]
    feats = torch.randn(9, width, generator=g).bfloat16()  # two requests: 6 and 3 pairs
    ids = torch.randint(0, runner.embed.shape[0], (9,), generator=g).tolist()
    positions = [10, 11, 12, 13, 14, 15, 3, 4, 5]
    layout, packed = pack_step([0, 6, 9], [16, 6], [[0], [1]], 16)
    kv0 = torch.randn(2, 2, 16, runner.kv_heads, runner.head_dim, generator=g).bfloat16()

    def forward(cache: torch.Tensor, picked: list[int] | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            out = cpu_layer.run_head_stack(runner.native_stack, ids, positions, feats, cache,
                                           layout, packed, logit_rows=picked)
        assert out is not None
        return out

    every = kv0.clone()
    want_out, want_logits = forward(every, None)  # [9, h], [9, V_d]
    for avx2_loop, rows in itertools.product((False, True), ([5, 8], [0], [2, 3, 8])):
        cache = kv0.clone()
        cpu_layer.use_q4q8_loop(False if avx2_loop else None)
        try:
            out, logits = forward(cache, rows)
        finally:
            cpu_layer.use_q4q8_loop(None)
        assert torch.equal(out, want_out[rows]) and torch.equal(logits, want_logits[rows])
        assert torch.equal(cache, every), (avx2_loop, rows)


@pytest.mark.parametrize("method", ["head", "combined"])
def test_head_trees_on_the_triton_backend_equal_no_speculation(target: Path, head_dir: Path,
                                                               method: str) -> None:
    """The path a GPU runs: Triton kernels (the interpreter on a CPU, compiled on a GPU) with
    graphs on; the head's steps (features wanted, tree masks) run eagerly beside graph
    replays. fp32 greedy equals the torch path without speculation."""
    from dataclasses import replace

    import torch

    from quickdraft.engine.backend import select_backend
    from quickdraft.kernels import triton_common

    if not torch.cuda.is_available() and not triton_common.INTERPRET:
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = EngineConfig(model=str(target), dtype="float32", device=device,
                          speculation=method, draft_head=str(head_dir),
                          measure_step_cost=False, num_kv_blocks=96, block_size=5,
                          max_model_len=512, cuda_graph_max_tokens=8, num_threads=1,
                          batch_invariant=False)  # (the batch-invariant mode drafts chains)
    backend = replace(select_backend(replace(config, kernel_backend="triton")),
                      cuda_graphs=True)
    spec = LLMEngine(config, progress=False, backend=backend)
    plain = LLMEngine(replace(config, speculation="off", draft_head=None), progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    free = spec.kv.num_free_blocks
    for prompt in PROMPTS[:2]:
        assert spec.generate([prompt], params)[0].token_ids == \
            plain.generate([prompt], params)[0].token_ids
    assert spec.kv.num_free_blocks == free
    assert spec.speculator.stats.by_source.get("head", [0])[0] > 0
    assert spec.speculator.stats.num_tree_steps > 0 or method == "combined"
