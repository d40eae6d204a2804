"""engine.gguf_quant: a GGUF's 4-bit blocks read as stored, equal to what transformers makes of
them once dequantized (so the int4 path multiplies by the same numbers as the fp32 oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from quickdraft.engine import gguf_quant, loader
from tests.kernels.four_bit_oracle import random_q4_k_blocks


def _random_blocks(kind: GGMLQuantizationType, rows: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks: finite fp16 scales, random nibbles."""
    rng = np.random.default_rng(seed)
    size = 20 if kind == GGMLQuantizationType.Q4_1 else 18
    b = rng.integers(0, 256, size=(rows, k // 32, size), dtype=np.uint8)
    scales = 2 if kind == GGMLQuantizationType.Q4_1 else 1
    fp = (rng.standard_normal((rows, k // 32, scales)) * 0.05).astype(np.float16)
    b[..., : 2 * scales] = fp.view(np.uint8).reshape(rows, k // 32, 2 * scales)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0])
def test_unpack_equals_gguf_dequantize(kind):
    rows, k = 7, 96
    blocks = _random_blocks(kind, rows, k, seed=int(kind))
    w = gguf_quant._unpack(blocks, rows, k, has_min=kind == GGMLQuantizationType.Q4_1)
    assert w.q.dtype == torch.uint8 and int(w.q.max()) <= 15 and w.shape == (rows, k)
    want = torch.from_numpy(quants.dequantize(blocks, kind).reshape(rows, k))
    assert torch.equal(w.dequantize(), want)


def test_q4_k_unpack_equals_gguf_dequantize():
    rows, k = 5, 512
    blocks = random_q4_k_blocks(rows, k, seed=11)
    w = gguf_quant._unpack_q4_k(blocks, rows, k)
    assert w.q.dtype == torch.uint8 and int(w.q.max()) <= 15 and w.d.shape == (rows, k // 32)
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_K)
                            .reshape(rows, k))
    assert torch.equal(w.dequantize(), want)


def test_rows_and_cat_keep_blocks_whole():
    blocks = _random_blocks(GGMLQuantizationType.Q4_1, 6, 64, seed=3)
    w = gguf_quant._unpack(blocks, 6, 64, has_min=True)
    perm = gguf_quant._unpermute_rows(6, 1)  # one head of 6 rows: (3, 2) -> (2, 3)
    assert perm.tolist() == [0, 2, 4, 1, 3, 5]
    assert torch.equal(w.rows(perm).dequantize(), w.dequantize()[perm])
    both = gguf_quant.Q4Weight.cat([w, w.rows(perm)])
    assert torch.equal(both.dequantize(), torch.cat([w.dequantize(), w.dequantize()[perm]]))


@pytest.mark.slow
def test_default_model_blocks_equal_the_converted_checkpoint(default_model_dir):
    """Every Q4_1 matrix of the embedded GGUF, read natively (names mapped, q/k rows
    permuted back), dequantizes bit for bit to the fp32 checkpoint transformers made."""
    config = loader.load_config(default_model_dir)
    q4 = gguf_quant.read_q4_weights(loader.default_gguf_path(), llama_permute=True,
                                    num_heads=config.num_attention_heads,
                                    num_kv_heads=config.num_key_value_heads)
    assert len(q4) == 7 * config.num_hidden_layers  # q k v o gate up down, every layer
    dense = dict(loader.iter_safetensors(default_model_dir))
    for name, w in q4.items():
        assert torch.equal(w.dequantize(), dense[name]), name


def _q8_0_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, k // 32, 34), dtype=np.uint8)
    fp = (rng.standard_normal((rows, k // 32, 1)) * 0.01).astype(np.float16)
    b[..., :2] = fp.view(np.uint8).reshape(rows, k // 32, 2)
    return b.reshape(rows, -1)


def test_q8_0_unpack_equals_gguf_dequantize():
    rows, k = 6, 128
    blocks = _q8_0_blocks(rows, k, seed=4)
    w = gguf_quant._unpack_q8_0(blocks, rows, k)
    assert w.q.dtype == torch.int8 and w.shape == (rows, k)
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(rows, k))
    assert torch.equal(w.dequantize(), want)


def _q6_k_blocks(rows: int, k: int, seed: int) -> np.ndarray:
    """Valid Q6_K rows: random codes and int8 scales (-128 included), finite fp16 ``d``."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * k // 256, 210), dtype=np.uint8)
    d = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16)
    b[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    b[0, 192] = 0x80  # an int8 scale of -128
    return b.reshape(rows, -1)


def test_q6_k_unpack_equals_gguf_dequantize():
    """Codes -32..31 and one scale per 16 weights, ``d · sc`` exact in fp32: the product with
    a code is gguf's own dequantized value bit for bit (and transformers')."""
    rows, k = 3, 512
    blocks = _q6_k_blocks(rows, k, seed=5)
    w = gguf_quant._unpack_q6_k(blocks, rows, k)
    assert w.q.dtype == torch.int8 and w.shape == (rows, k)
    assert w.sc.dtype == torch.int8 and w.sc.shape == (rows, k // 16)
    assert w.d.shape == (rows, k // 256) and int(w.sc.min()) == -128
    assert int(w.q.min()) == -32 and int(w.q.max()) == 31
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q6_K)
                            .reshape(rows, k))
    assert torch.equal(w.dequantize(), want)


def test_a_gguf_file_s_q6_k_matrices_and_head_are_read_as_stored(tmp_path):
    """A GGUF written by gguf's own writer with a Q6_K layer matrix, a Q4_1 one and a Q6_K
    ``output.weight``: read from the file, each dequantizes to gguf's values bit for bit."""
    from gguf import GGUFWriter

    down, up = _q6_k_blocks(8, 512, seed=1), _random_blocks(GGMLQuantizationType.Q4_1, 8, 64, 3)
    head = _q6_k_blocks(16, 256, seed=2)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", down, raw_dtype=GGMLQuantizationType.Q6_K)
    writer.add_tensor("blk.0.ffn_up.weight", up, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("output.weight", head, raw_dtype=GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = gguf_quant.read_q4_weights(path, llama_permute=False, num_heads=1,
                                         num_kv_heads=1, tied=False)
    assert set(weights) == {"model.layers.0.mlp.down_proj.weight",
                            "model.layers.0.mlp.up_proj.weight", gguf_quant.LM_HEAD}
    for name, blocks, kind, shape in (
            ("model.layers.0.mlp.down_proj.weight", down, GGMLQuantizationType.Q6_K, (8, 512)),
            ("model.layers.0.mlp.up_proj.weight", up, GGMLQuantizationType.Q4_1, (8, 64)),
            (gguf_quant.LM_HEAD, head, GGMLQuantizationType.Q6_K, (16, 256))):
        want = torch.from_numpy(quants.dequantize(blocks, kind).reshape(shape))
        assert torch.equal(weights[name].dequantize(), want), name
    assert isinstance(gguf_quant.read_head(path, tied=False), gguf_quant.Q6Weight)


@pytest.mark.slow
def test_default_model_q8_head_equals_the_converted_embedding(default_model_dir):
    """SmolLM2's tied embedding is Q8_0: read as the LM head, it dequantizes bit for bit to
    the fp32 embedding transformers made."""
    config = loader.load_config(default_model_dir)
    weights = gguf_quant.read_q4_weights(  # the engine reads head and layers in one parse
        loader.default_gguf_path(), llama_permute=True, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, tied=True)
    head = weights[gguf_quant.LM_HEAD]
    assert isinstance(head, gguf_quant.Q8Weight)
    assert len(weights) == 7 * config.num_hidden_layers + 1
    dense = dict(loader.iter_safetensors(default_model_dir))
    assert torch.equal(head.dequantize(), dense["model.embed_tokens.weight"])
    assert gguf_quant.read_head(loader.default_gguf_path(), tied=False) is None


def test_cache_file_round_trips(tmp_path):
    w: dict[str, gguf_quant.Q4Weight | gguf_quant.HeadWeight] = {
        f"model.layers.{i}.mlp.up_proj.weight": gguf_quant._unpack(
            _random_blocks(GGMLQuantizationType.Q4_1, 16, 64, seed=i), 16, 64, has_min=True)
        for i in range(2)}
    w[gguf_quant.LM_HEAD] = gguf_quant._unpack_q8_0(_q8_0_blocks(8, 64, seed=9), 8, 64)
    w["output.q6"] = gguf_quant._unpack_q6_k(_q6_k_blocks(8, 256, seed=4), 8, 256)
    path = tmp_path / "q4.safetensors"
    gguf_quant.save_q4_weights(path, w)
    back = gguf_quant.load_q4_weights(path)
    assert back.keys() == w.keys()
    for name in w:
        assert type(back[name]) is type(w[name])
        assert torch.equal(back[name].q, w[name].q)
        assert torch.equal(back[name].dequantize(), w[name].dequantize())
    assert [p.name for p in tmp_path.iterdir()] == ["q4.safetensors"]  # no temp file left
