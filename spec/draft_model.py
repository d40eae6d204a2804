"""Draft-model proposer: a smaller causal LM drafts ``k`` tokens per request, batched.

The draft keeps its own K/V tensors but shares the target's paged block tables: position
``p`` of a request lives in the same slot in both caches, so the KV manager stays the one
writer of block tables and a request's blocks hold both models' K/V. Before drafting ``k``
tokens for a request with ``T`` tokens, the speculator makes the manager allocate slots for
``T + k`` positions (what the target's verification needs anyway).

Draft progress: ``num_computed`` = positions ``[0, d)`` whose draft K/V is valid. One call
of :meth:`DraftModelRunner.propose` runs ``max(k)`` forwards over the whole batch:

* step 0 feeds each request's pending tokens ``tokens[d:T]`` (usually 1 or 2; a longer
  catch-up after a prefill or after n-gram steps in ``combined`` mode) and samples ``x_0``;
* step ``j`` feeds ``x_{j-1}`` at position ``T + j - 1`` for the requests with ``k > j``.

Afterwards the draft K/V is valid up to ``T + k - 1``. Verification accepts ``a`` drafts and
sets the target's ``num_computed_tokens`` to ``T + a``; positions ``< T + a`` hold real
tokens, so the draft cache stays consistent by clamping ``d`` to the target's progress
(invariant: ``d <= num_computed_tokens``). Rejected drafts' slots are simply overwritten
later. After a preemption the blocks are gone: ``d`` restarts at 0.

Greedy requests draft the argmax (no distribution is kept: the verifier compares with the
target's argmax). Sampled requests draft from ``q = softmax(filters(logits / T))`` with the
request's own temperature / top-k / top-p / min-p and generator, and ``q`` goes to the
rejection sampler, which keeps the output distributed exactly as the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.engine import loader
from quickdraft.engine.backend import KernelBackend, synchronize
from quickdraft.engine.model_runner import allocate_kv_caches, load_model, model_kv_bytes_per_block
from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.sampler import apply_temperature_and_filters, sample_from_probs
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.step_plan import StepPlan


class DraftModelError(ValueError):
    """The draft model cannot serve this target (e.g. a different vocabulary)."""


@dataclass(frozen=True)
class DraftInput:
    """One request's share of a draft call."""

    pending_token_ids: list[int]  # tokens[d:T], not yet in the draft cache (>= 1)
    start_pos: int  # d
    k: int  # drafts wanted (>= 1)
    block_table: tuple[int, ...]  # covers T + k positions
    sampling_params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True)
class DraftOutput:
    token_ids: list[int]  # k drafts
    probs: torch.Tensor | None  # [k, vocab] float32 draft distributions; None when greedy


def check_same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any,
                          target_vocab: int, draft_vocab: int) -> None:
    """Drafts are token ids: both models must map ids to the same strings."""
    if target_vocab != draft_vocab:
        raise DraftModelError(f"the draft model's vocabulary has {draft_vocab} entries, the "
                              f"target's {target_vocab}: they must share one tokenizer")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise DraftModelError("the draft model's tokenizer differs from the target's: "
                              "they must share one vocabulary")


class DraftModelRunner:
    """Owns the draft model and its K/V tensors; reads block tables, never edits them."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, backend: KernelBackend,
                 default_generator: torch.Generator) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.default_generator = default_generator
        self.kv_caches: list[torch.Tensor] = []

    @classmethod
    def load(cls, model_spec: str, dtype: torch.dtype, max_model_len: int, block_size: int,
             backend: KernelBackend, seed: int) -> tuple[DraftModelRunner, Any]:
        """Load the draft; returns it with its tokenizer (for the vocabulary check)."""
        model_dir = loader.resolve_model(model_spec)
        hf_config = loader.load_config(model_dir)
        model = load_model(model_dir, hf_config, dtype, max_model_len, backend)
        runner = cls(model, block_size, backend, torch.Generator().manual_seed(seed + 1))
        return runner, loader.load_tokenizer(model_dir)

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def kv_bytes_per_block(self) -> int:
        return model_kv_bytes_per_block(self.model, self.block_size)

    def allocate(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model, num_blocks, self.block_size)

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput]) -> list[DraftOutput]:
        """Draft ``inputs[i].k`` tokens for every request: ``max(k)`` batched forwards."""
        if not inputs:
            return []
        tokens: list[list[int]] = [[] for _ in inputs]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        active = list(range(len(inputs)))
        feeds = [inp.pending_token_ids for inp in inputs]
        starts = [inp.start_pos for inp in inputs]
        for step in range(max(inp.k for inp in inputs)):
            logits = self._forward([feeds[i] for i in active], [starts[i] for i in active],
                                   [inputs[i].block_table for i in active])  # [A, vocab]
            drafted, q = self._sample(logits, [inputs[i] for i in active])
            for row, i in enumerate(active):
                tokens[i].append(drafted[row])
                if q is not None and not inputs[i].sampling_params.greedy:
                    probs[i].append(q[row])
                starts[i] += len(feeds[i])
                feeds[i] = [drafted[row]]
            active = [i for i in active if inputs[i].k > step + 1]
        return [DraftOutput(t, torch.stack(p) if p else None)
                for t, p in zip(tokens, probs, strict=True)]

    def _forward(self, feeds: list[list[int]], starts: list[int],
                 tables: list[tuple[int, ...]]) -> torch.Tensor:
        """Logits after each request's last fed token: ``[len(feeds), vocab]`` float32."""
        plan = StepPlan.from_feeds(feeds, starts, tables)
        device = self.backend.device
        meta = plan.attention_metadata(self.block_size, device)
        packed = torch.tensor([plan.input_ids, plan.positions],
                              dtype=torch.int64).to(device, non_blocking=True)  # [2, N]
        hidden = self.model(packed[0], packed[1], self.kv_caches, meta)  # [N, hidden]
        last = torch.tensor(plan.logits_indices, dtype=torch.int64)  # [A]
        return self.model.compute_logits(hidden[last.to(device)])  # on the device

    def _sample(self, logits: torch.Tensor, inputs: list[DraftInput],
                ) -> tuple[list[int], torch.Tensor | None]:
        """Argmax for greedy rows; a draw from ``q`` (returned) for sampled rows."""
        tokens = logits.argmax(dim=-1)  # [A]
        params = [inp.sampling_params for inp in inputs]
        if all(p.greedy for p in params):
            return tokens.tolist(), None
        # sampled drafts draw on the host, where the requests' generators live
        logits, tokens = logits.cpu(), tokens.cpu()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        rows = logits[sampled]  # [S, vocab]
        filtered = apply_temperature_and_filters(
            rows,
            temperature=torch.tensor([params[i].temperature for i in sampled]),
            top_k=torch.tensor([params[i].top_k for i in sampled], dtype=torch.long),
            top_p=torch.tensor([params[i].top_p for i in sampled]),
            min_p=torch.tensor([params[i].min_p for i in sampled]),
        )
        q_rows = torch.softmax(filtered, dim=-1)  # [S, vocab]
        drawn = sample_from_probs(q_rows, [inputs[i].generator for i in sampled],
                                  self.default_generator)
        tokens[sampled] = drawn
        q = torch.zeros_like(logits)  # [A, vocab]; rows of greedy requests unused
        q[sampled] = q_rows
        return tokens.tolist(), q

    @torch.inference_mode()
    def time_forward(self, batch: int, context: int = 64) -> float:
        """Seconds for one draft step over ``batch`` requests (one token each) after
        ``context`` cached tokens. Uses the first blocks: call only while no request runs."""
        per_seq = -(-(context + 1) // self.block_size)
        num_blocks = self.kv_caches[0].shape[1]
        if per_seq > num_blocks:
            return float("nan")
        table = tuple(range(per_seq))
        synchronize(self.backend.device)
        start = time.perf_counter()
        self._forward([[0]] * batch, [context] * batch, [table] * batch)
        synchronize(self.backend.device)
        return time.perf_counter() - start
