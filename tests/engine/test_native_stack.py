"""kernels.cpu_layer's layer stack: the model's layers bound once and run in one call give
the bits of the layer-by-layer native calls and of the Python layers (hidden states, KV
caches, the features a draft head reads); its results are the caller's memory across steps;
a step or an aux layer it cannot take is declined with nothing written."""

from __future__ import annotations

import pytest
import torch

from quickdraft.kernels import cpu_fused, cpu_int4, cpu_layer, cpu_q4q8
from quickdraft.kernels.attention_metadata import build_metadata
from tests.engine.native_layer_cases import (
    BLOCK,
    NUM_BLOCKS,
    STEPS,
    TABLES,
    four_bit_model,
)

pytestmark = pytest.mark.skipif(not (cpu_layer.available() and cpu_int4.available()),
                                reason="needs g++, the C kernels and torch's CPU int4 ops")


@pytest.mark.parametrize(("kernel", "aux_layers"), [
    ("torch", (0, 1, 3)), ("q8", (0, 1, 3)), ("q8", (3, 1, 1))])  # (the stack's order; not)
def test_all_layers_in_one_call_equal_layer_by_layer(kernel: str, aux_layers: tuple[int, ...],
                                                     monkeypatch) -> None:
    """The model's layers bound once and run in one call (cpu_layer.run_stack, what the model
    uses when every layer is native) give the bits of the layer-by-layer native calls and of
    the Python layers: hidden states, KV caches and the residual-stream features a draft
    head reads (aux layers, the embeddings' 0 included, in the order asked for)."""
    if kernel == "q8" and not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    model = four_bit_model(False, kernel)

    def run(native: bool, stack: bool) -> list[torch.Tensor]:
        model.use_native_layers(native)
        assert (model._native_stack([torch.empty(0)] * 3) is not None) == native
        if not stack:
            monkeypatch.setattr(model, "_native_stack", lambda kv: None)
        caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16)
                  for _ in range(3)]
        gen, outs = torch.Generator().manual_seed(2), []
        with torch.inference_mode():
            for step in STEPS:
                qsl, lens, tables, positions = [0], [], [], []
                for seq, n, start in step:
                    qsl.append(qsl[-1] + n)
                    lens.append(start + n)
                    tables.append(TABLES[seq])
                    positions += range(start, start + n)
                meta = build_metadata(qsl, lens, tables, BLOCK)
                ids = torch.randint(0, 96, (qsl[-1],), generator=gen)
                hidden, aux = model.forward_with_aux(ids, torch.tensor(positions), caches, meta,
                                                     aux_layers)
                assert aux is not None
                outs += [hidden, aux]
        monkeypatch.undo()
        return [*outs, *caches]

    stacked = run(native=True, stack=True)
    others = [run(native=True, stack=False), run(native=False, stack=False)]
    if kernel == "q8":  # the AVX2-only kind's 4-bit loop too (the VNNI one's bits on either)
        cpu_layer.use_q4q8_loop(False)
        try:
            others.append(run(native=True, stack=True))
        finally:
            cpu_layer.use_q4q8_loop(None)
    for other in others:
        for g, w in zip(stacked, other, strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("avx2_loop", [False, True], ids=["own-loop", "avx2-loop"])
@pytest.mark.parametrize("kernel", ["q8", "q4k"])
def test_the_stacks_results_are_its_callers_across_steps(kernel: str, avx2_loop: bool) -> None:
    """LayerStack carves a step's tensors out of two arenas it keeps from step to step
    (kernels/cpu_layer_arena.h): what it returns must be the caller's own memory, which a
    later step (smaller or larger, so the arenas grow and merge: the wide q4k model's 30-row
    step takes more than the first 64 KB chunk) leaves alone, and each step's results must
    equal the same step run layer by layer. ``avx2_loop``: the matmuls on the AVX2-only
    kind's loop whatever this CPU is (the same as its own loop on such a CPU)."""
    if not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    if avx2_loop:
        cpu_layer.use_q4q8_loop(False)
    try:
        _check_stack_results_across_steps(kernel)
    finally:
        cpu_layer.use_q4q8_loop(None)


def _check_stack_results_across_steps(kernel: str) -> None:
    model = four_bit_model(False, kernel)
    model.use_native_layers(True)
    attn = model.layers[0].self_attn
    hidden = model.layers[0].input_layernorm.weight.numel()
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, attn.kv_heads, attn.head_dim,
                          dtype=torch.bfloat16) for _ in range(3)]
    stack = model._native_stack(caches)
    assert stack is not None
    gen, kept = torch.Generator().manual_seed(5), []
    with torch.inference_mode():
        for rows in (3, 30, 1, 30, 7):
            meta = build_metadata([0, rows], [rows], [list(range(NUM_BLOCKS))[:8]], BLOCK)
            x = torch.randn(rows, hidden, generator=gen).bfloat16()
            cos_sin = model.rotary.cos_sin(torch.arange(rows))
            out = cpu_layer.run_stack(stack, x, cos_sin, meta, [1, 3])
            assert out is not None
            want_x, want_r, streams = x, None, []
            for index, (layer, cache) in enumerate(zip(model.layers, caches, strict=True)):
                want_x, want_r = torch.ops.quickdraft_cpu.decoder_layer(
                    want_x, want_r, layer.native, *cos_sin, cache,
                    cpu_layer._meta_tensors(meta), attn.heads, attn.kv_heads,
                    layer.input_layernorm.eps, attn.scale)
                if index + 1 in (1, 3):
                    streams.append(want_x + want_r)  # torch's bf16 add
            x_out, r_out, aux = out
            assert torch.equal(x_out, want_x) and torch.equal(r_out, want_r)
            # the residual streams after layers 1 and 3, side by side in one tensor
            assert aux is not None and torch.equal(aux, torch.cat(streams, dim=-1))
            # the same step with the model's final norm in the call (its K/V rewritten with
            # the same values): the Python norm's bits on the same x and residual
            normed = cpu_layer.run_stack_normed(stack, x, cos_sin, meta, [1, 3],
                                                model.norm.weight, model.norm.eps)
            assert normed is not None
            h_out, aux_n = normed
            want_h = cpu_fused.add_rms_norm(want_x, want_r, model.norm.weight,
                                            model.norm.eps)[0]
            assert torch.equal(h_out, want_h) and aux_n is not None and torch.equal(aux_n, aux)
            # from token ids and positions: the embeddings and RoPE rows gathered in the
            # call give the bits of the same step on F.embedding's rows
            ids = torch.randint(0, model.embed_tokens.shape[0], (rows,), generator=gen)
            positions = torch.arange(rows)
            from_rows = cpu_layer.run_stack_normed(
                stack, torch.nn.functional.embedding(ids, model.embed_tokens),
                model.rotary.cos_sin(positions), meta, [2], model.norm.weight, model.norm.eps)
            from_ids = cpu_layer.run_stack_normed_ids(
                stack, ids, positions, model.embed_tokens, (model.rotary.cos, model.rotary.sin),
                meta, [0, 2], model.norm.weight, model.norm.eps)  # 0: the embeddings
            assert from_rows is not None and from_ids is not None
            assert from_ids[1] is not None and from_rows[1] is not None
            assert torch.equal(from_ids[0], from_rows[0])
            assert torch.equal(from_ids[1], torch.cat(  # [embeddings | stream after 2]
                [torch.nn.functional.embedding(ids, model.embed_tokens), from_rows[1]], dim=-1))
            none = cpu_layer.run_stack_normed(stack, x, cos_sin, meta, [], model.norm.weight,
                                              model.norm.eps)
            assert none is not None and none[1] is None and torch.equal(none[0], h_out)
            kept.append([t.clone() for t in (x_out, r_out, h_out, aux)]
                        + [x_out, r_out, h_out, aux])
    for saved in kept:  # every step's results are as they were returned
        half = len(saved) // 2
        for copy, live in zip(saved[:half], saved[half:], strict=True):
            assert torch.equal(copy, live)


def test_a_rejected_step_declines_the_stack_and_writes_nothing() -> None:
    model = four_bit_model(False)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    stack = model._native_stack(caches)
    assert stack is not None and model._native_stack(caches) is stack  # made once
    meta = build_metadata([0, 2], [2], [[NUM_BLOCKS + 3]], BLOCK)  # block id out of range
    with torch.inference_mode():
        out = cpu_layer.run_stack(stack, torch.randn(2, 64).bfloat16(),
                                  model.rotary.cos_sin(torch.arange(2)), meta, [1])
    assert out is None and not any(c.any() for c in caches)
    # a final norm that does not fit the hidden size: declined before any layer runs
    good = build_metadata([0, 2], [2], [TABLES["a"]], BLOCK)
    with torch.inference_mode():
        normed = cpu_layer.run_stack_normed(stack, torch.randn(2, 64).bfloat16(),
                                            model.rotary.cos_sin(torch.arange(2)), good, [],
                                            model.norm.weight[:32], model.norm.eps)
    assert normed is None and not any(c.any() for c in caches)
    # a token id or a position out of its table: declined before anything is written (the
    # model's Python path then raises F.embedding's error)
    vocab, max_pos = model.embed_tokens.shape[0], model.rotary.cos.shape[0]
    tables = (model.rotary.cos, model.rotary.sin)
    for ids, positions in (([1, vocab], [0, 1]), ([1, -1], [0, 1]), ([1, 2], [0, max_pos]),
                           ([1, 2], [0])):
        with torch.inference_mode():
            out_ids = cpu_layer.run_stack_normed_ids(
                stack, torch.tensor(ids), torch.tensor(positions), model.embed_tokens, tables,
                good, [], model.norm.weight, model.norm.eps)
        assert out_ids is None and not any(c.any() for c in caches)
    with pytest.raises(ValueError):
        cpu_layer.layer_stack([], caches, 4, 2, 1e-5, 0.25)


def test_the_stack_refuses_aux_layers_outside_the_model_before_running() -> None:
    model = four_bit_model(False)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    stack = model._native_stack(caches)
    meta = build_metadata([0, 2], [2], [TABLES["a"]], BLOCK)
    with torch.inference_mode():
        for after in ([4], [2, 1], [0]):
            out = cpu_layer.run_stack(stack, torch.randn(2, 64).bfloat16(),
                                      model.rotary.cos_sin(torch.arange(2)), meta, after)
            assert out is None and not any(c.any() for c in caches)
