"""Micro-benchmark: kernels.cpu_gemv.linear_bf16 vs torch F.linear (bf16) at decode shapes.

One "step" is every linear of SmolLM2-135M for m tokens: per layer the fused qkv (960x576),
o (576x576), fused gate/up (3072x576) and down (576x1536), x30 layers with distinct weights
(so they stream from memory as in a real model), plus the 49152x576 LM head.

    python benchmarks/gemv_micro.py [--runs 15] [--m 1 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from quickdraft.kernels import cpu_gemv

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (n, k)
NUM_LAYERS = 30
LM_HEAD = (49152, 576)


def make_weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    return [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]


def time_step(fn, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    """Seconds for one pass over all weights."""
    t0 = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if not cpu_gemv.available():
        raise SystemExit("cpu_gemv kernel unavailable (no gcc or no AVX2/FMA/F16C)")
    weights = make_weights()
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"threads={torch.get_num_threads()} weights={nbytes / 1e6:.0f} MB per step, "
          f"{len(weights)} matmuls, median of {args.runs}")
    with torch.inference_mode():
        for m in args.m:
            xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in {k for _, k in LAYER_SHAPES}}
            impls = {"F.linear": F.linear, "cpu_gemv": cpu_gemv.linear_bf16}
            times: dict[str, list[float]] = {name: [] for name in impls}
            for fn in impls.values():  # warm-up
                time_step(fn, weights, xs)
            for _ in range(args.runs):  # alternate so that background load hits both alike
                for name, fn in impls.items():
                    times[name].append(time_step(fn, weights, xs))
            med = {name: statistics.median(t) for name, t in times.items()}
            for name, t in med.items():
                print(f"m={m} {name:9s} median {t * 1e3:7.2f} ms/step  {nbytes / t / 1e9:5.1f} GB/s"
                      f"   (best {min(times[name]) * 1e3:7.2f} ms)")
            print(f"m={m} speed-up {med['F.linear'] / med['cpu_gemv']:.2f}x (medians)")


if __name__ == "__main__":
    main()
