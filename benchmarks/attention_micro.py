"""Micro-benchmark: kernels.cpu_attention.decode_attention (one C call per batch, reading the
paged cache in place) vs torch's scaled_dot_product_attention on K/V gathered from the cache
(gather included), per call, at SmolLM2-135M decode shapes (9 q + 3 kv heads of 64).

Fast and SDPA samples alternate so background load hits both alike; medians are printed.

    python benchmarks/attention_micro.py [--samples 201] [--calls 10] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import per_call_us

from quickdraft.kernels import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BF16 = torch.bfloat16



def make_case(num_seqs: int, ctx: int) -> tuple[torch.Tensor, ...]:
    n_blocks = -(-ctx // BLOCK_SIZE)
    num_blocks = num_seqs * n_blocks
    query = torch.randn(num_seqs, HEADS, HEAD_DIM).to(BF16)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(BF16)
    tables = torch.randperm(num_blocks).to(torch.int32).view(num_seqs, n_blocks).contiguous()
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    slots = (tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(
        num_seqs, -1)[:, :ctx]  # [b, ctx]
    return query, kv_cache, tables, seq_lens, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=201)
    ap.add_argument("--calls", type=int, default=10, help="calls per timed sample")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit("cpu_attention kernel unavailable (no gcc or no AVX2/FMA)")
    torch.manual_seed(0)
    scale = HEAD_DIM ** -0.5
    print(f"threads={torch.get_num_threads()} heads={HEADS}/{KV_HEADS} d={HEAD_DIM} "
          f"block_size={BLOCK_SIZE}")
    for num_seqs, ctx in ((1, 100), (1, 1000), (16, 300)):
        q, kv, tables, seq_lens, slots = make_case(num_seqs, ctx)
        kv_flat = kv.view(2, -1, KV_HEADS, HEAD_DIM)

        def fast(q=q, kv=kv, tables=tables, seq_lens=seq_lens) -> torch.Tensor:
            return cpu_attention.decode_attention(q, kv, tables, seq_lens, scale)

        def sdpa(q=q, kv_flat=kv_flat, slots=slots) -> torch.Tensor:
            g = kv_flat[:, slots]  # [2, b, ctx, kvh, d]
            out = F.scaled_dot_product_attention(
                q[:, :, None], g[0].transpose(1, 2), g[1].transpose(1, 2), scale=scale,
                enable_gqa=True)  # [b, H, 1, d]
            return out[:, :, 0]

        err = (fast().float() - sdpa().float()).abs().max().item()
        t_fast, t_sdpa = [], []
        for _ in range(args.samples):
            t_fast.append(per_call_us(fast, args.calls))
            t_sdpa.append(per_call_us(sdpa, args.calls))
        f, s = statistics.median(t_fast), statistics.median(t_sdpa)
        print(f"seqs={num_seqs:2d} ctx={ctx:4d}: cpu_attention {f:8.1f} us   "
              f"gather+sdpa {s:8.1f} us   x{s / f:5.1f}   max|diff| {err:.3g}")


if __name__ == "__main__":
    main()
