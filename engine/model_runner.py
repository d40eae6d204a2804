"""Runs one scheduled step: builds the flat batch, runs the model, samples.

The runner owns the model weights and the K/V tensors. It reads block tables from the
``SchedulerOutput`` it is given and never edits them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine import loader
from engine.config import EngineConfig
from engine.kv_cache import kv_bytes_per_block
from engine.models.llama import LlamaForCausalLM
from engine.sampler import SamplingBatch, sample
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kernels import cpu_gemv, paged_attention_ref
from spec.rejection_sampler import rejection_sample

log = logging.getLogger(__name__)
# Up to this many rows, chunked bf16 GEMV beats an fp32 GEMM on this class of CPU
# (measured with benchmarks/gemv_micro.py; both are compute-bound beyond it).
GEMV_MAX_ROWS = 48


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_sample_rows] int64 rows of the flat batch to score
    sample_requests: list[int]  # indices into SchedulerOutput.requests that sample this step


@dataclass(frozen=True)
class RunnerOutput:
    sampled: list[list[int]]  # per scheduled request: accepted tokens (empty if none)
    logprobs: list[list[float]] | None


def select_attention_backend(name: str) -> ModuleType:
    """``auto`` and ``torch`` both mean the torch path (with its CPU kernels) today; a Triton
    backend will plug in behind the same module interface (write_kv, paged_attention,
    build_metadata)."""
    return paged_attention_ref


def load_model(model_dir: Any, hf_config: Any, dtype: torch.dtype, max_model_len: int,
               backend: ModuleType) -> LlamaForCausalLM:
    """Build the model, load its weights in ``dtype`` and enable the CPU fast path."""
    start = time.perf_counter()
    model = LlamaForCausalLM(hf_config, dtype, max_model_len, backend)
    model.load_weights((name, t.to(dtype)) for name, t in loader.iter_safetensors(model_dir))
    model.eval()
    if dtype == torch.bfloat16 and cpu_gemv.available():
        model.enable_cpu_fast_path(cpu_gemv.linear_bf16, cpu_gemv.MAX_ROWS, GEMV_MAX_ROWS)
    log.info("loaded weights of %s in %.2fs", model_dir, time.perf_counter() - start)
    return model


def model_kv_bytes_per_block(model: LlamaForCausalLM, block_size: int) -> int:
    s = model.shape
    return kv_bytes_per_block(block_size, s.num_layers, s.num_kv_heads, s.head_dim,
                              model.dtype.itemsize)


def allocate_kv_caches(model: LlamaForCausalLM, num_blocks: int,
                       block_size: int) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    s = model.shape
    return [torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim,
                        dtype=model.dtype) for _ in range(s.num_layers)]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Any, hf_config: Any,
                 max_model_len: int, extra_bytes_per_block: int = 0) -> None:
        """``extra_bytes_per_block``: what a draft model's K/V adds to every block (it
        shares the block tables), so that the pool fits ``kv_cache_memory`` in all."""
        self.config = config
        self.dtype = config.torch_dtype
        self.backend = select_attention_backend(config.attention_backend)
        self.model = load_model(model_dir, hf_config, self.dtype, max_model_len, self.backend)
        self.num_blocks = self._num_blocks(extra_bytes_per_block)
        self.kv_caches = allocate_kv_caches(self.model, self.num_blocks, config.block_size)
        self.default_generator = torch.Generator().manual_seed(config.seed)

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def _num_blocks(self, extra_bytes_per_block: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = model_kv_bytes_per_block(self.model, self.config.block_size)
        return max(self.config.kv_cache_memory // (per_block + extra_bytes_per_block), 1)

    def prepare(self, sched: SchedulerOutput) -> tuple[StepInputs, Any]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_requests: list[int] = []
        for i, req in enumerate(sched.requests):
            n = req.num_tokens
            input_ids += req.token_ids
            positions += range(req.start_pos, req.start_pos + n)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(req.start_pos + n)
            if req.sample:
                end = query_start_loc[-1]
                logits_indices += range(end - 1 - req.num_draft_tokens, end)
                sample_requests.append(i)
        meta = self.backend.build_metadata(
            query_start_loc, seq_lens, [r.block_table for r in sched.requests],
            self.config.block_size)
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            sample_requests=sample_requests,
        )
        return inputs, meta

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs, meta: Any) -> torch.Tensor:
        """Logits at the rows to sample: ``[num_sample_rows, vocab]`` float32."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        inputs, meta = self.prepare(sched)
        sampled: list[list[int]] = [[] for _ in sched.requests]
        logits = self.forward_logits(inputs, meta)  # [num_sample_rows, vocab]
        if not inputs.sample_requests:
            return RunnerOutput(sampled, None)
        reqs = [sched.requests[i] for i in inputs.sample_requests]
        batch = SamplingBatch(
            params=[r.sampling_params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            default_generator=self.default_generator,
        )
        tokens, logprobs = self._sample(logits, reqs, batch)
        logprob_rows: list[list[float]] | None = None
        if logprobs is not None:
            logprob_rows = [[] for _ in sched.requests]
        for row, i in enumerate(inputs.sample_requests):
            sampled[i] = tokens[row]
            if logprob_rows is not None and logprobs is not None:
                logprob_rows[i] = logprobs[row]
        return RunnerOutput(sampled, logprob_rows)

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[ScheduledRequest], batch: SamplingBatch,
                ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Plain sampling, or lossless verification when any request carries drafts."""
        if any(r.num_draft_tokens for r in reqs):
            drafts = [r.token_ids[len(r.token_ids) - r.num_draft_tokens:] for r in reqs]
            verified = rejection_sample(logits, drafts, _draft_probs(reqs, logits.shape[1]),
                                        batch)
            return verified.token_ids, verified.logprobs
        result = sample(logits, batch)
        tokens = [[t] for t in result.token_ids.tolist()]
        if result.logprobs is None:
            return tokens, None
        return tokens, [[lp] for lp in result.logprobs.tolist()]

    @torch.inference_mode()
    def time_forward(self, num_tokens: int, context: int = 64) -> float:
        """Seconds for one forward pass with ``num_tokens`` new tokens after ``context`` cached
        ones. Uses the first blocks of the pool: call only while no request holds blocks."""
        bs = self.config.block_size
        total = context + num_tokens
        table = list(range(min(-(-total // bs), self.num_blocks)))
        if len(table) * bs < total:
            return float("nan")
        meta = self.backend.build_metadata([0, num_tokens], [total], [table], bs)
        ids = torch.zeros(num_tokens, dtype=torch.int64)
        positions = torch.arange(context, total)
        start = time.perf_counter()
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
        return time.perf_counter() - start


def _draft_probs(reqs: list[ScheduledRequest], vocab: int) -> torch.Tensor | None:
    """``[D, vocab]`` draft distributions for the rejection sampler, or None when every
    draft is one-hot (n-gram) or belongs to a greedy request (compared by argmax only)."""
    if all(r.draft_probs is None or r.sampling_params.greedy for r in reqs):
        return None
    rows: list[torch.Tensor] = []
    for r in reqs:
        if not r.num_draft_tokens:
            continue
        if r.draft_probs is not None:
            rows.append(r.draft_probs)
        else:  # n-gram drafts: one-hot at the drafted token
            ids = torch.tensor(r.token_ids[len(r.token_ids) - r.num_draft_tokens:])
            rows.append(torch.nn.functional.one_hot(ids, vocab).float())
    return torch.cat(rows)  # [D, vocab]
