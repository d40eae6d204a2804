"""kernels.cpu_layer: a whole decoder layer in one native call gives bit-identical hidden
states and KV caches to the Python layer (bf16, 4-bit weights on torch's int4 kernel or
on kernels.cpu_q4q8), on mixed steps of prefill
chunks, decodes and verification rows, with and without a qkv bias; a step the kernel
rejects falls back to the Python layer. Tree verification: the step's tree mask reaches the
native attention (same bits as the Python layer), and a malformed one declines."""


import ctypes

import pytest
import torch

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_layers import DecoderLayer
from quickdraft.kernels import (
    cbuild,
    cpu_attention,
    cpu_int4,
    cpu_layer,
    cpu_q4q8,
)
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
    model = four_bit_model(qwen, kernel)
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
    model = four_bit_model(False)
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
    model = four_bit_model(False, kernel)
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
    model = four_bit_model(False)
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
    model = four_bit_model(False)
    model.use_int4(False)
    assert all(layer.native is None for layer in model.layers)
    model.use_int4(True)
    assert all(layer.native is not None for layer in model.layers)


def test_a_rejected_step_declines_and_writes_nothing() -> None:
    model = four_bit_model(False)
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
    model = four_bit_model(False)
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
