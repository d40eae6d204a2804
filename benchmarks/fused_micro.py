"""Micro-benchmark: kernels.cpu_fused (one C call per op) vs the plain-torch references, per
call, at decode shapes of SmolLM2-135M (hidden 576, 9 q + 3 kv heads of 64, inter 1536).

Each sample times a short batch of calls (short, so that on a shared machine a preemption
spoils few samples rather than doubling long ones); fast and reference samples alternate so
that background load hits both alike; the median per-call time is reported. The per-step
line assumes what one decoder layer would call: two add_rms_norm, one rope_neox_ and one
silu_mul (x30 layers).

    python benchmarks/fused_micro.py [--rows 1] [--samples 501] [--calls 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from common import per_call_us

from quickdraft.kernels import cpu_fused, torch_ops

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30
EPS = 1e-5



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--samples", type=int, default=501)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_fused.available():
        raise SystemExit("cpu_fused kernels unavailable (no gcc or no AVX2/FMA/F16C)")

    rows, bf16 = args.rows, torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(rows, HIDDEN).to(bf16)
    res = torch.randn(rows, HIDDEN).to(bf16)
    w = torch.randn(HIDDEN).to(bf16)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(bf16)
    qk = qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    # real rotations (|cos + i sin| = 1): rotating the same buffer over and over keeps its
    # values in range (random tables would drive them to inf/NaN or subnormals)
    angle = torch.rand(rows, HEAD_DIM // 2) * 6.28
    cos = torch.cat([angle.cos()] * 2, dim=-1).to(bf16)
    sin = torch.cat([angle.sin()] * 2, dim=-1).to(bf16)
    gate_up = torch.randn(rows, 2 * INTER).to(bf16)

    ops: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
        # name: (fast, reference, calls per decoder layer)
        "rms_norm": (lambda: cpu_fused.rms_norm(x, w, EPS),
                     lambda: torch_ops.rms_norm(x, w, EPS), 0),
        "add_rms_norm": (lambda: cpu_fused.add_rms_norm(x, res, w, EPS),
                         lambda: torch_ops.add_rms_norm(x, res, w, EPS), 2),
        "rope_neox_": (lambda: cpu_fused.rope_neox_(qk, cos, sin),
                       lambda: torch_ops.rope_neox(qk, cos, sin), 1),
        "silu_mul": (lambda: cpu_fused.silu_mul(gate_up),
                     lambda: torch_ops.silu_mul(gate_up), 1),
    }
    print(f"rows={rows} hidden={HIDDEN} threads={torch.get_num_threads()} "
          f"median of {args.samples} samples x {args.calls} calls (us per call)")
    saved = 0.0
    with torch.inference_mode():
        for name, (fast, ref, per_layer) in ops.items():
            for fn in (fast, ref):  # warm-up
                per_call_us(fn, args.calls)
            t_fast, t_ref = [], []
            for _ in range(args.samples):
                t_fast.append(per_call_us(fast, args.calls))
                t_ref.append(per_call_us(ref, args.calls))
            mf, mr = statistics.median(t_fast), statistics.median(t_ref)
            saved += per_layer * LAYERS * (mr - mf)
            print(f"{name:13s} fast {mf:6.2f} (best {min(t_fast):6.2f})   "
                  f"ref {mr:6.2f} (best {min(t_ref):6.2f})   {mr / mf:4.1f}x")
    print(f"per decode step ({LAYERS} layers x [2 add_rms_norm, rope, silu_mul]): "
          f"{saved / 1e3:.2f} ms saved")


if __name__ == "__main__":
    main()
