"""The Triton kernels compile for real GPUs (sm_80 and sm_90), without a GPU.

The interpreter tests (test_triton_attention.py, test_triton_ops.py, test_triton_rejection.py)
check the numbers but not that the kernels survive Triton's compiler (typing of loop-carried
values, dot shapes and layouts, constexpr handling...). Triton's NVIDIA backend (with the ptxas
it ships) compiles to a cubin for a given target without a device, so this runs everywhere
triton is installed.
It runs in a subprocess with ``TRITON_INTERPRET=0`` because the interpreter tests define the
kernels in interpreter mode in this process.

Argument specialisations mirror what a launch from torch tensors would get: unit innermost
strides as constants, pointers and other strides divisible by 16. Register use and spills
(from the cubin, via the ``cuobjdump`` triton ships) are printed (``pytest -s``), not
asserted: they are for tuning, and depend on the triton version.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import json, os, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quickdraft.kernels import (
    triton_attention as ta,
    triton_kv_write as kw,
    triton_ops as ops,
    triton_rejection as tr,
)

assert not ta.interpreting()
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
UNIT = {"stride_qd", "stride_kd", "stride_od", "stride_pd", "stride_ls", "stride_vd",
        "stride_cd", "stride_xd", "stride_sd"}
FLOATS = {"qk_scale", "eps"}
TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def usage(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                                 capture_output=True, text=True, timeout=60).stdout
        except OSError:
            return None
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def compile_(name, kernel, cap, ptrs, consts, opts):
    sig, attrs, consts = {}, {}, dict(consts)
    for i, p in enumerate(kernel.params):
        if p.name in consts:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*" + ptrs.get(p.name, ptrs["default"])
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in FLOATS:
            sig[p.name] = "fp32"
        elif p.name in UNIT:
            sig[p.name] = "constexpr"
            consts[p.name] = 1
        else:
            sig[p.name] = "i32"
            if p.name.startswith("stride") and p.name != "stride_bt":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)
    return {"name": f"sm{cap} {name}", "usage": usage(c.asm["cubin"]),
            "smem": c.metadata.shared}


results = []
attn = [(torch.bfloat16, 1, 128, 1), (torch.bfloat16, 4, 128, 64), (torch.bfloat16, 3, 64, 40),
        (torch.float16, 8, 128, 4), (torch.float32, 4, 128, 64), (torch.float32, 1, 64, 1)]
for cap in (80, 90):
    for dtype, group, dim, max_q in attn:
        if cap == 80 and dtype == torch.float16:
            continue
        # (split, tree): split-KV for decode shapes; the tree-mask variant for verification
        variants = [(False, False), (True, False)] if max_q == 1 else [(False, False)]
        if max_q == 64 and group == 4:
            variants.append((False, True))
        for split, tree in variants:
            cfg = ta.attention_config(dtype, dim, group, max_q)
            opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
            cfg["SPLIT"] = split
            cfg["HAS_TREE"] = tree
            dt = TL[dtype]
            ptrs = {"default": "i32", "q_ptr": dt, "kv_ptr": dt,
                    "out_ptr": "fp32" if split else dt, "lse_ptr": "fp32",
                    "tree_mask_ptr": "i64"}
            results.append(compile_(
                f"attention {dt} G={group} D={dim} BLOCK_M={cfg['BLOCK_M']} split={split} "
                f"tree={tree} warps={opts['num_warps']}", ta._paged_attention_kernel, cap, ptrs,
                cfg, opts))
    results.append(compile_("reduce_splits bf16 D=128", ta._reduce_splits_kernel, cap,
                            {"default": "fp32", "out_ptr": "bf16"},
                            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=16, INTERP=False),
                            {}))
    results.append(compile_("write_kv bf16 KVH=8 D=128", kw._write_kv_kernel, cap,
                            {"default": "bf16", "slot_mapping_ptr": "i64"},
                            dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128,
                                 INTERP=False), {}))
    for single, res in ((True, True), (False, False)):
        results.append(compile_(
            f"rms_norm bf16 single={single} residual={res}", ops._rms_norm_kernel, cap,
            {"default": "bf16"},
            dict(HAS_RESIDUAL=res, BLOCK=4096 if single else 8192, SINGLE=single,
                 INTERP=False),
            dict(ops._NO_FMA, num_warps=ops._norm_warps(4096 if single else 8192))))
    results.append(compile_("rope bf16 40 heads D=128", ops._rope_neox_kernel, cap,
                            {"default": "bf16"},
                            dict(HALF=64, HEADS_PAD=64, HALF_PAD=64,
                                 ROUND=triton.language.bfloat16, INTERP=False),
                            dict(ops._NO_FMA)))
    results.append(compile_("silu_mul bf16", ops._silu_mul_kernel, cap, {"default": "bf16"},
                            dict(BLOCK=1024, INTERP=False), dict(ops._NO_FMA)))
    for has_q in (True, False):
        results.append(compile_(
            f"rejection draft_probs={has_q}", tr._rejection_kernel, cap,
            {"default": "i64", "logits_ptr": "fp32", "draft_probs_ptr": "bf16",
             "uniforms_ptr": "fp32", "noise_ptr": "fp32", "noise_rows_ptr": "i32"},
            dict(HAS_DRAFT_PROBS=has_q, BLOCK_V=tr._BLOCK_V),
            dict(tr._NO_FMA, num_warps=tr._NUM_WARPS)))
print("RESULTS" + json.dumps(results))
'''


def test_kernels_compile_for_sm80_and_sm90():
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("triton without its NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    results = json.loads(line.removeprefix("RESULTS"))
    # 10 + 9 attention configs (sm_90, sm_80; 2 of each with tree masks), 8 others each
    assert len(results) == 35
    for r in results:
        regs, stack = r["usage"] or (None, None)
        print(f"{r['name']}: regs={regs} spill_stack={stack}B smem={r['smem']}B")
