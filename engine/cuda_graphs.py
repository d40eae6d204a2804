"""CUDA graphs for decode and verification steps (triton backend).

A decode or verification step runs the same few hundred kernels every time; at small batch
their launch overhead is most of the step. Captured once per *bucket* of step sizes at
start-up, a step is then one graph replay.

A step is *graph-eligible* when every scheduled request samples every one of its rows, i.e.
it feeds its last token plus its drafts (``num_tokens == 1 + num_draft_tokens``), with at
most ``max_query_len`` (1 + the speculative width) rows per request. Prefill chunks run
eagerly. Buckets are step sizes in tokens: 1, 2, 4, 8, then multiples of 8 up to
``max_tokens``. Bucket ``T`` holds up to ``min(T, max_num_seqs)`` real sequences plus one
padding sequence that owns the ``T - num_tokens`` padding rows (see
:mod:`kernels.attention_metadata`): slot -1 (no KV write), context of one position (block 0),
outputs discarded.

Static state, shared by every graph: ``input_ids`` / ``positions`` ``[max_tokens]`` int64,
one packed int32 metadata buffer, and the output ``hidden [max_tokens, hidden]``. A bucket's
graph reads prefixes of them laid out for its own sizes, and copies the final hidden
states into ``hidden[:T]``; logits are computed outside the graph (one GEMM for the real
rows), so graphs do not each keep a ``[T, vocab]`` output alive.

``capture`` is injectable: on CUDA it records a ``torch.cuda.CUDAGraph`` in a shared memory
pool; tests on CPU pass :func:`eager_capture`, whose "replay" re-runs the step function over
the same static buffers, which checks the padding and the buffer plumbing without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from quickdraft.engine.step_plan import CHECK_INVARIANTS, StepPlan
from quickdraft.kernels.attention_metadata import (
    AttentionMetadata,
    MetadataLayout,
    fill_packed,
    unpack,
)

log = logging.getLogger(__name__)

StepFn = Callable[[], None]
Capture = Callable[[StepFn], StepFn]  # records a step function, returns its replay


def token_buckets(max_tokens: int) -> list[int]:
    """Captured step sizes: 1, 2, 4, 8, 16, 24, ... up to ``max_tokens`` (which is included)."""
    sizes = {n for n in (1, 2, 4, 8) if n <= max_tokens}
    sizes.update(range(16, max_tokens + 1, 8))
    sizes.add(max_tokens)
    return sorted(sizes)


def eager_capture(fn: StepFn) -> StepFn:
    """A stand-in for CUDA graph capture: run once, replay by running again."""
    fn()
    return fn


def cuda_capture(device: torch.device) -> Capture:
    """Capture into ``torch.cuda.CUDAGraph`` objects sharing one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: StepFn) -> StepFn:
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture


class CUDAGraphRunner:
    """Captured forwards ``(input_ids, positions, metadata) -> hidden`` per token bucket."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_tokens: int, max_query_len: int,
                 device: torch.device, choose_num_splits: Callable[[int, int, int], int],
                 capture: Capture) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_query_len = block_size, max_query_len
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.device = device
        self.choose_num_splits = choose_num_splits  # (num_seqs, max_query_len, max_seq_len)
        self.buckets = token_buckets(max_tokens)
        self.max_blocks = -(-max_model_len // block_size)
        top = self._layout(self.buckets[-1])
        pin = device.type == "cuda"
        self.ids_host = torch.zeros(2, max_tokens, dtype=torch.int64, pin_memory=pin)
        self.meta_host = torch.zeros(top.size, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.zeros(2, max_tokens, dtype=torch.int64, device=device)
        self.meta = torch.zeros(top.size, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_tokens, model.shape.hidden_size, dtype=model.dtype,
                                  device=device)
        self._capture = capture
        self.graphs: dict[int, StepFn] = {}
        self.metas: dict[int, AttentionMetadata] = {}  # per bucket, over the static buffers
        self.num_replays = 0  # steps served by a graph (stats and tests)

    def _layout(self, num_tokens: int) -> MetadataLayout:
        return MetadataLayout(num_tokens, min(num_tokens, self.max_num_seqs) + 1,
                              self.max_blocks)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest captured bucket holding ``num_tokens`` (None: too large)."""
        for size in self.buckets:
            if size >= num_tokens:
                return size
        return None

    def eligible(self, num_tokens: int, num_seqs: int, max_query_len: int,
                 all_rows_sampled: bool) -> bool:
        return (all_rows_sampled and max_query_len <= self.max_query_len
                and num_seqs <= self.max_num_seqs and self.bucket_for(num_tokens) is not None)

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Warm up (compiles the kernels) and capture every bucket, largest first. Seconds."""
        start = time.perf_counter()
        for size in reversed(self.buckets):
            step_fn = self._step_fn(size)
            self._fill(size, StepPlan([], [], [0], [], [], [], []))
            step_fn()  # eager warm-up: JIT compilation and autotuning happen outside capture
            self.graphs[size] = self._capture(step_fn)
        seconds = time.perf_counter() - start
        log.info("captured %d CUDA graphs (%s tokens) in %.2fs", len(self.graphs),
                 self.buckets, seconds)
        return seconds

    def _step_fn(self, size: int) -> StepFn:
        layout = self._layout(size)
        splits = self.choose_num_splits(layout.num_seqs, self.max_query_len, self.max_model_len)
        meta = unpack(self.meta[: layout.size], self.meta_host.numpy()[: layout.size], layout,
                      self.block_size,
                      max_query_len=max(self.max_query_len, 1),
                      max_seq_len=self.max_model_len, num_splits=splits)
        self.metas[size] = meta
        ids, positions, out = self.ids[0, :size], self.ids[1, :size], self.hidden[:size]

        def step() -> None:
            out.copy_(self.model(ids, positions, self.kv_caches, meta))

        return step

    def _fill(self, size: int, step: StepPlan) -> None:
        """Write a step into the static buffers (host staging, then one copy each)."""
        n = len(step.input_ids)
        ids = self.ids_host.numpy()
        ids[0, :n], ids[1, :n] = step.input_ids, step.positions
        ids[:, n:size] = 0
        layout = self._layout(size)
        fill_packed(self.meta_host.numpy()[: layout.size], layout, step.query_start_loc,
                    step.seq_lens, step.block_tables, self.block_size)
        self.ids[:, :size].copy_(self.ids_host[:, :size], non_blocking=True)
        self.meta[: layout.size].copy_(self.meta_host[: layout.size], non_blocking=True)

    @torch.inference_mode()
    def run(self, step: StepPlan) -> torch.Tensor:
        """Replay the bucket's graph for ``step``: hidden states ``[num_tokens, hidden]`` (a
        view of the static output: use it before the next step)."""
        n = len(step.input_ids)
        size = self.bucket_for(n)
        assert size is not None and size in self.graphs, f"no graph for {n} tokens"
        self._fill(size, step)
        if CHECK_INVARIANTS:
            step.check_invariants(self.block_size)
            self.metas[size].check_invariants()
        self.graphs[size]()
        self.num_replays += 1
        return self.hidden[:n]
