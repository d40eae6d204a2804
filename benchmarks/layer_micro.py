"""Micro-benchmark: one SmolLM2 decoder layer at batch 1 (int4 weights), eager with the fused
C ops against the same layer in one native call (``kernels.cpu_layer``, what the engine
runs), the layer captured by ``torch.compile`` (inductor, C++ wrapper, frozen weights), and
the layer's four matmuls alone; the difference to the matmuls is the non-matmul time a step
pays 30 times. Samples of the variants alternate; medians reported.

    python benchmarks/layer_micro.py [--samples 301] [--calls 20] [--no-compile]

The compiled variant runs the torch reference small ops (inductor fuses them) and calls the
int4 matmul, the KV write and our C attention as opaque ops (the KV write and attention
registered as torch custom ops; an in-graph ``index_copy_`` into the cache made inductor copy
the whole 1 GiB cache each call).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, machine_summary, per_call_us

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.models.llama_layers import TORCH_OPS
from quickdraft.kernels import cpu_attention, cpu_int4, cpu_layer


@torch.library.custom_op("quickdraft_bench::attention", mutates_args=())
def _attention(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
               qsl: torch.Tensor, scale: float) -> torch.Tensor:
    out = cpu_attention.ragged_attention(q.contiguous(), kv, tables, lens, qsl, scale)
    assert out is not None, "the CPU attention kernel is not available here"
    return out


@_attention.register_fake
def _(q, kv, tables, lens, qsl, scale):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)


@torch.library.custom_op("quickdraft_bench::write_kv", mutates_args=("kv",))
def _write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    flat = kv.view(2, -1, *kv.shape[3:])
    flat[0][slots] = k
    flat[1][slots] = v



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--samples", type=int, default=301)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper")
    p.add_argument("--freezing", action="store_true", help="inductor freezing")
    args = p.parse_args()
    print(machine_summary(machine_info()), file=sys.stderr)
    llm = LLMEngine(EngineConfig(weights="int4", speculation="off", measure_step_cost=False),
                    progress=False)
    model = llm.runner.model
    layer, kv = model.layers[0], llm.runner.kv_caches[0]
    from quickdraft.kernels.attention_metadata import build_metadata

    ctx = 65
    meta = build_metadata([0, 1], [ctx], [list(range(5))], llm.config.block_size)
    x = torch.randn(1, 576).bfloat16()
    res = torch.randn(1, 576).bfloat16()
    cos_sin = model.rotary.cos_sin(torch.tensor([ctx - 1]))
    attn = layer.self_attn
    lin = [attn.qkv, attn.o, layer.mlp.gate_up, layer.mlp.down]
    ins = [torch.randn(1, m.weight.shape[1]).bfloat16() for m in lin]

    native_weights = layer.native
    layer.native = None  # "eager": the Python layer

    def eager() -> object:
        return layer.forward(x, res, cos_sin, kv, meta, model.ops)

    def native() -> object:
        return cpu_layer.decoder_layer(x, res, native_weights, cos_sin, kv, meta, attn.heads,
                                       attn.kv_heads, layer.input_layernorm.eps, attn.scale)

    def matmuls() -> object:
        return [cpu_int4.linear(v, m.int4) for v, m in zip(ins, lin, strict=True)]

    def layer_fn(x, res, cos, sin, kv, slots, tables, lens, qsl):  # type: ignore[no-untyped-def]
        ops = TORCH_OPS
        h, res = ops.add_rms_norm(x, res, layer.input_layernorm.weight, 1e-5)
        qkv = cpu_int4.linear(h, attn.qkv.int4)
        qk, v = qkv.split([768, 192], dim=-1)
        qk = ops.rope(qk.reshape(-1, 12, 64), cos, sin)
        q, k = qk.split([9, 3], dim=1)
        _write_kv(k, v.reshape(-1, 3, 64), kv, slots)  # an op: no functional copy of the cache
        out = _attention(q, kv, tables, lens, qsl, attn.scale)
        h = cpu_int4.linear(out.reshape(-1, 576), attn.o.int4)
        h, res = ops.add_rms_norm(h, res, layer.post_attention_layernorm.weight, 1e-5)
        g = ops.silu_mul(cpu_int4.linear(h, layer.mlp.gate_up.int4))
        return cpu_int4.linear(g, layer.mlp.down.int4), res

    variants: dict[str, Callable[[], object]] = {"eager (fused C ops)": eager,
                                                 "4 int4 matmuls only": matmuls}
    if native_weights is not None:
        variants["one native call (cpu_layer)"] = native
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = args.cpp_wrapper
        inductor_config.freezing = args.freezing
        compiled = torch.compile(layer_fn, dynamic=False, fullgraph=False)
        call_args = (x, res, *cos_sin, kv, meta.slot_mapping, meta.block_tables,
                     meta.seq_lens, meta.query_start_loc)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(*call_args)
        print(f"compile: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        variants["torch.compile (inductor)"] = lambda: compiled(*call_args)
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for fn in variants.values():
            per_call_us(fn, 50)
        for _ in range(args.samples):
            for name, fn in variants.items():
                times[name].append(per_call_us(fn, args.calls))
    mm = statistics.median(times["4 int4 matmuls only"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} {med:7.1f} us/layer  non-matmul {med - mm:6.1f} us  "
              f"(x30 layers: {(med - mm) * 30 / 1e3:.2f} ms a step)")


if __name__ == "__main__":
    main()
