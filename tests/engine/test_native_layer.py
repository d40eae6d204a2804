"""kernels.cpu_layer: a whole decoder layer in one native call gives bit-identical hidden
states and KV caches to the Python layer (bf16, 4-bit weights on torch's int4 kernel or
on kernels.cpu_q4q8), on mixed steps of prefill
chunks, decodes and verification rows, with and without a qkv bias; a step the kernel
rejects falls back to the Python layer. Tree verification: the step's tree mask reaches the
native attention (same bits as the Python layer), and a malformed one declines."""

from __future__ import annotations

import ctypes

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_layers import DecoderLayer
from quickdraft.engine.models.llama_weights import StackedWeight
from quickdraft.kernels import (
    cbuild,
    cpu_attention,
    cpu_fused,
    cpu_gemv,
    cpu_int4,
    cpu_layer,
    cpu_q4q8,
    torch_attention,
)
from quickdraft.kernels.attention_metadata import build_metadata
from tests.kernels.four_bit_oracle import random_q4k_weights, random_q6_weights

pytestmark = pytest.mark.skipif(not (cpu_layer.available() and cpu_int4.available()),
                                reason="needs g++, the C kernels and torch's CPU int4 ops")

BLOCK = 4
NUM_BLOCKS = 32


def _model(qwen: bool, kernel: str = "torch") -> LlamaForCausalLM:
    """A small random model on 4-bit weights for ``kernel`` ("torch": ATen's int4, "q8":
    kernels.cpu_q4q8; "q6": cpu_q4q8 with 6-bit matrices as a Qwen2.5 Q4_K_M file has them:
    layer 1's qkv as q, k in 4 bits and v in 6 side by side and its down in 6 bits, and
    layer 2's o in 6 bits; "q4k": cpu_q4q8's Q4_K layout for every matrix, on wider layers
    since it takes ``in % 256 == 0``)."""
    wide = kernel == "q4k"
    common = dict(vocab_size=96, hidden_size=256 if wide else 64,
                  intermediate_size=512 if wide else 96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = Qwen2Config(**common) if qwen else LlamaConfig(**common)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, torch.bfloat16, 128, torch_attention)
    model.init_random_weights(0, std=0.2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.enable_cpu_fast_path(cpu_gemv.linear_bf16)
    gen = torch.Generator().manual_seed(1)
    for layer in model.layers:
        for lin in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
            out, k = lin.weight.shape
            if wide:
                lin.int4 = cpu_q4q8.pack_q4k(*random_q4k_weights(out, k, seed=out + k))
                continue
            q = torch.randint(0, 16, (out, k), generator=gen)
            d = torch.rand(out, k // 32, generator=gen) * 0.02 + 0.005
            m = -8 * d + torch.randn(out, k // 32, generator=gen) * 0.01
            lin.int4 = (cpu_int4 if kernel == "torch" else cpu_q4q8).pack(q, d, m)
    if kernel == "q6":
        qkv, down = model.layers[1].self_attn.qkv, model.layers[1].mlp.down
        out, k = qkv.weight.shape
        q = torch.randint(0, 16, (out - 32, k), generator=gen)
        d = torch.rand(out - 32, k // 32, generator=gen) * 0.02 + 0.005
        v = random_q6_weights(32, k, 3)
        qkv.int4 = StackedWeight((cpu_q4q8.pack(q, d, -8 * d),
                                  cpu_q4q8.pack_q6(v.q, v.d * 0.05, v.sc)))
        for lin, seed in ((down, 4), (model.layers[2].self_attn.o, 5)):
            w = random_q6_weights(*lin.weight.shape, seed)
            lin.int4 = cpu_q4q8.pack_q6(w.q, w.d * 0.05, w.sc)  # |w| <= 0.2
    model.use_int4(True)
    return model


# (sequence, tokens fed, start position) per step: prefills, then a decode, a 3-row
# verification and a second prefill chunk in one step
STEPS = [[("a", 9, 0), ("b", 5, 0)], [("a", 1, 9), ("b", 3, 5), ("c", 7, 0)],
         [("c", 6, 7), ("a", 1, 10)]]
TABLES = {"a": [3, 0, 7, 12], "b": [5, 9, 1], "c": [2, 20, 4, 11], "d": [6, 8, 10, 13]}
# then a prefill of "d" and a step verifying a 6-node draft tree on it beside a decode of "a"
TREE_PARENTS = [-1, 0, 0, 1, 2, 3]  # rows 0-1-3-5 and 0-2-4: two branches
TREE_STEPS = [*STEPS, [("d", 10, 0)], [("d", 6, 10), ("a", 1, 11)]]


def _tree_rows(parents: list[int]) -> tuple[list[int], list[int]]:
    """(ancestor masks, depths) of a tree given in flat order."""
    masks, depths = [], []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | 1 << i)
        depths.append(depths[p] + 1 if p >= 0 else 0)
    return masks, depths


def _run(model: LlamaForCausalLM, native: bool, steps: list | None = None,
         tree: list[int] | None = None,
         use_mask: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hidden states of ``steps`` (default STEPS); with ``tree`` (parents), the last step's
    "d" rows are that tree (masks unless not ``use_mask``, RoPE at base + depth)."""
    model.use_native_layers(native)
    assert all((layer.native is not None) == native for layer in model.layers)
    shape = model.shape
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, shape.num_kv_heads, shape.head_dim,
                          dtype=torch.bfloat16) for _ in range(3)]
    outs, gen = [], torch.Generator().manual_seed(2)
    steps = STEPS if steps is None else steps
    with torch.inference_mode():
        for k, step in enumerate(steps):
            qsl, lens, tables, positions, masks = [0], [], [], [], []
            for seq, n, start in step:
                qsl.append(qsl[-1] + n)
                lens.append(start + n)
                tables.append(TABLES[seq])
                if tree is not None and seq == "d" and k == len(steps) - 1:
                    rows, depths = _tree_rows(tree)
                    masks += rows if use_mask else [0] * n
                    positions += [start + d for d in depths]
                else:
                    masks += [0] * n
                    positions += range(start, start + n)
            meta = build_metadata(qsl, lens, tables, BLOCK, tree_mask=masks)
            ids = torch.randint(0, 96, (qsl[-1],), generator=gen)
            outs.append(model(ids, torch.tensor(positions), caches, meta))
    return outs, caches


@pytest.mark.parametrize("kernel", ["torch", "q8", "q6", "q4k"])
@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen2-qkv-bias"])
def test_native_layers_equal_python_layers_bit_for_bit(qwen: bool, kernel: str) -> None:
    if kernel != "torch" and not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    model = _model(qwen, kernel)
    want, want_caches = _run(model, native=False)
    got, got_caches = _run(model, native=True)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(w.float()).all()
        assert torch.equal(g, w)
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g, w)


def test_another_attention_build_runs_in_the_layer_and_is_put_back(monkeypatch, tmp_path
                                                                   ) -> None:
    """use_attention_kernel (benchmarks/attention_ab.py's hook): the op runs whatever build of
    the attention kernel it is given (here one that doubles every output), and None puts
    the built-in one back."""
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    source = cbuild.read_source(cpu_attention._SOURCE)
    doubled = source.replace(b"const float inv = 1.0f / fl[", b"const float inv = 2.0f / fl[")
    assert doubled != source
    other = ctypes.CDLL(str(cbuild.build("cpu_attention_ab", doubled, cpu_attention._CFLAGS,
                                         "gcc")))
    model = _model(False)
    want, _ = _run(model, native=True)
    try:
        cpu_layer.use_attention_kernel(
            ctypes.cast(other.qd_write_kv_attention_bf16, ctypes.c_void_p).value)
        got, _ = _run(model, native=True)
    finally:
        cpu_layer.use_attention_kernel(None)
    assert not any(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    again, _ = _run(model, native=True)
    assert all(torch.equal(g, w) for g, w in zip(again, want, strict=True))


@pytest.mark.parametrize("kernel", ["torch", "q8"])
def test_tree_step_native_equals_python_and_honours_the_mask(kernel: str) -> None:
    if kernel == "q8" and not cpu_q4q8.available():
        pytest.skip("the q4q8 kernel is not built here")
    model = _model(False, kernel)
    want, want_caches = _run(model, native=False, steps=TREE_STEPS, tree=TREE_PARENTS)
    got, got_caches = _run(model, native=True, steps=TREE_STEPS, tree=TREE_PARENTS)
    for g, w in zip([*got, *got_caches], [*want, *want_caches], strict=True):
        assert torch.equal(g, w)
    # the mask matters: row 2 (a child of the root) sees row 1 when the rows are causal
    causal, _ = _run(model, native=True, steps=TREE_STEPS, tree=TREE_PARENTS, use_mask=False)
    assert not torch.equal(causal[-1][2], got[-1][2])
    assert torch.equal(causal[-1][:2], got[-1][:2])


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_tree_rows_equal_their_path_fed_as_a_chain(native: bool) -> None:
    """Lossless tree verification through whole layers: each root-to-leaf path's rows of the
    tree step give the bits of a causal step feeding only that path over the same prefix
    (the K/V a verified path leaves are what later steps see). Also relies on the int4
    matmul computing each row alone, as ATen's CPU kernel does."""
    model = _model(False)
    model.use_native_layers(native)
    masks, depths = _tree_rows(TREE_PARENTS)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (10,), generator=gen)
    drafts = torch.randint(0, 96, (6,), generator=gen)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    table = [TABLES["d"]]
    with torch.inference_mode():
        model(prompt, torch.arange(10), caches, build_metadata([0, 10], [10], table, BLOCK))
        prefix = [c.clone() for c in caches]
        meta = build_metadata([0, 6], [16], table, BLOCK, tree_mask=masks)
        tree = model(drafts, torch.tensor([10 + d for d in depths]), caches, meta)
        for path in ([0, 1, 3, 5], [0, 2, 4]):
            n, kv = len(path), [c.clone() for c in prefix]
            meta = build_metadata([0, n], [10 + n], table, BLOCK)
            chain = model(drafts[path], torch.arange(10, 10 + n), kv, meta)
            for m, r in enumerate(path):
                assert torch.equal(tree[r], chain[m]), (path, m)


def test_layers_without_int4_weights_stay_python() -> None:
    model = _model(False)
    model.use_int4(False)
    assert all(layer.native is None for layer in model.layers)
    model.use_int4(True)
    assert all(layer.native is not None for layer in model.layers)


def test_a_rejected_step_declines_and_writes_nothing() -> None:
    model = _model(False)
    layer = model.layers[0]
    assert layer.native is not None
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16)
    meta = build_metadata([0, 2], [2], [[NUM_BLOCKS + 3]], BLOCK)  # block id out of range
    x = torch.randn(2, 64).bfloat16()
    cos_sin = model.rotary.cos_sin(torch.arange(2))
    attn = layer.self_attn
    with torch.inference_mode():
        out = cpu_layer.decoder_layer(x, None, layer.native, cos_sin, kv, meta, attn.heads,
                                      attn.kv_heads, layer.input_layernorm.eps, attn.scale)
    assert out is None and not kv.any()


def test_a_malformed_tree_mask_declines_and_writes_nothing() -> None:
    model = _model(False)
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer) and layer.native is not None
    attn = layer.self_attn
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    cos_sin = model.rotary.cos_sin(torch.tensor([4, 5, 5]))
    for masks in ([1, 0b101, 0b101], [1, 0b11, 0b011]):  # a bit above row 1; no own bit
        meta = build_metadata([0, 3], [7], [[3, 5]], BLOCK, tree_mask=masks)
        with torch.inference_mode():
            out = cpu_layer.decoder_layer(x, None, layer.native, cos_sin, kv, meta, attn.heads,
                                          attn.kv_heads, layer.input_layernorm.eps,
                                          attn.scale)
        assert out is None and not kv.any()


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
    model = _model(False, kernel)

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
    model = _model(False, kernel)
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
    model = _model(False)
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
    model = _model(False)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    stack = model._native_stack(caches)
    meta = build_metadata([0, 2], [2], [TABLES["a"]], BLOCK)
    with torch.inference_mode():
        for after in ([4], [2, 1], [0]):
            out = cpu_layer.run_stack(stack, torch.randn(2, 64).bfloat16(),
                                      model.rotary.cos_sin(torch.arange(2)), meta, after)
            assert out is None and not any(c.any() for c in caches)
