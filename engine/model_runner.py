"""Runs one scheduled step: builds the flat batch, runs the model, samples.

The runner owns the model weights and the K/V tensors, on the kernel backend's device
(:mod:`engine.backend`). It reads block tables from the ``SchedulerOutput`` it is given and
never edits them. A step is first flattened into a :class:`engine.step_plan.StepPlan` (host
lists); the decode/verification steps that fit a captured CUDA graph replay it
(:mod:`engine.cuda_graphs`), the others build its attention metadata and run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.engine import loader, weight_format
from quickdraft.engine.backend import KernelBackend, select_backend, synchronize
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.cuda_graphs import Capture, CUDAGraphRunner, cuda_capture, eager_capture
from quickdraft.engine.kv_cache import kv_bytes_per_block
from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.sampler import SamplingBatch, sample
from quickdraft.engine.scheduler import ScheduledRequest, SchedulerOutput
from quickdraft.engine.step_plan import StepPlan, plan_step
from quickdraft.kernels import cpu_gemv, huge_pages
from quickdraft.spec.token_tree import TokenTree
from quickdraft.spec.tree_verification import verify_trees

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerOutput:
    """What a step produced, per scheduled request (in the scheduler output's order)."""

    sampled: list[list[int]]  # accepted drafts then one sampled token; empty: no sample
    logprobs: list[list[float]] | None
    num_accepted: list[int]  # accepted drafts (0 without drafts or without a sample)
    # per request (when asked): the target's aux-layer features [m, 3h] of the positions
    # this step verified, from its start_pos (a draft head's input); None: not asked
    features: list[torch.Tensor | None] | None = None


def load_model(model_dir: Any, hf_config: Any, dtype: torch.dtype, max_model_len: int,
               backend: KernelBackend, seed: int = 0) -> LlamaForCausalLM:
    """Build the model on the backend's device with its weights in ``dtype`` (random when
    ``model_dir`` is None: speed benchmarks only) and the backend's kernels."""
    start = time.perf_counter()
    # Real weights: built on the host (the rope tables as HF computes them), then moved.
    # Random weights: built on the device directly (an 8B shape is 16 GB).
    with torch.device("cpu" if model_dir is not None else backend.device):
        model = LlamaForCausalLM(hf_config, dtype, max_model_len, backend.attention)
    if model_dir is not None:
        model.load_weights((name, t.to(dtype)) for name, t in loader.iter_safetensors(model_dir))
    model = model.to(backend.device).eval()
    if model_dir is None:
        model.init_random_weights(seed)
    if backend.linear is not None:
        model.use_linear_kernel(backend.linear)
    if backend.layer_ops is not None:
        model.use_layer_ops(backend.layer_ops)
    elif (backend.linear is None and backend.device.type == "cpu"
          and dtype == torch.bfloat16 and cpu_gemv.available()):
        model.enable_cpu_fast_path(cpu_gemv.linear_bf16)
    log.info("loaded weights of %s in %.2fs", model_dir or "(random)",
             time.perf_counter() - start)
    return model


def model_kv_bytes_per_block(model: LlamaForCausalLM, block_size: int) -> int:
    s = model.shape
    return kv_bytes_per_block(block_size, s.num_layers, s.num_kv_heads, s.head_dim,
                              model.dtype.itemsize)


def allocate_kv_caches(model: LlamaForCausalLM, num_blocks: int,
                       block_size: int) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer, on the
    model's device, resident from the start (as ``torch.zeros`` makes it: no page faults
    while serving)."""
    s = model.shape
    device = model.embed_tokens.device
    shape = (2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
    if device.type == "cpu":  # on 2 MiB pages where the machine allows (kernels.huge_pages)
        return [huge_pages.zeros(shape, model.dtype, populate=True)
                for _ in range(s.num_layers)]
    return [torch.zeros(*shape, dtype=model.dtype, device=device) for _ in range(s.num_layers)]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Any, hf_config: Any,
                 max_model_len: int, extra_bytes_per_block: int = 0,
                 backend: KernelBackend | None = None, capture: Capture | None = None) -> None:
        """``extra_bytes_per_block``: what a draft model's K/V adds to every block (it
        shares the block tables), so that the pool fits ``kv_cache_memory`` in all.
        ``model_dir`` None: random weights. ``capture``: how graphs are recorded when the
        backend uses them (default: CUDA graphs on CUDA, :func:`eager_capture` elsewhere)."""
        self.config = config
        self.dtype = config.torch_dtype
        self.backend = backend or select_backend(config)
        self.device = self.backend.device
        self.model = load_model(model_dir, hf_config, self.dtype, max_model_len, self.backend,
                                config.seed)
        self.num_blocks = self._num_blocks(extra_bytes_per_block)
        self.kv_caches = allocate_kv_caches(self.model, self.num_blocks, config.block_size)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.aux_layers: tuple[int, ...] = ()  # features a draft head reads (set by the engine)
        self.graphs = self._make_graphs(max_model_len, capture)
        if self.graphs is not None:
            self.graphs.capture_all()
        choice = weight_format.choose(self, model_dir, hf_config, config.weights)
        native = sum(layer.native is not None for layer in self.model.layers)
        self.weights = dataclasses.replace(choice, native_layers=native)
        log.info("weights: %s", self.weights.describe())

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def _num_blocks(self, extra_bytes_per_block: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = model_kv_bytes_per_block(self.model, self.config.block_size)
        return max(self.config.kv_cache_memory // (per_block + extra_bytes_per_block), 1)

    def _make_graphs(self, max_model_len: int, capture: Capture | None) -> CUDAGraphRunner | None:
        if not self.backend.cuda_graphs:
            return None
        if capture is None:  # off CUDA (tests), "graphs" replay eagerly over the same buffers
            capture = cuda_capture(self.device) if self.device.type == "cuda" else eager_capture
        attention = self.backend.attention
        kv_heads = self.model.shape.num_kv_heads
        c = self.config
        return CUDAGraphRunner(
            self.model, self.kv_caches, block_size=c.block_size, max_model_len=max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_tokens=min(c.cuda_graph_max_tokens, c.max_num_batched_tokens),
            max_query_len=1 + c.num_speculative_tokens if c.speculation != "off" else 1,
            device=self.device, capture=capture,
            choose_num_splits=lambda seqs, q, ctx: attention.choose_num_splits(
                seqs, kv_heads, q, ctx))

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """Logits at the rows to sample: ``[num_sample_rows, vocab]`` float32, on the device.
        Decode/verification steps replay a CUDA graph when one fits."""
        return self.forward_logits_and_features(plan, ())[0]

    @torch.inference_mode()
    def forward_logits_and_features(self, plan: StepPlan, aux_layers: tuple[int, ...],
                                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits as :meth:`forward_logits`, and with ``aux_layers`` every row's features
        ``[num_tokens, len(aux_layers) * hidden]`` (an eager step: no graph replays them)."""
        if not aux_layers and self.graphs is not None and plan.tree_mask is None \
                and self.graphs.eligible(
                len(plan.input_ids), len(plan.seq_lens), plan.max_query_len,
                plan.all_rows_sampled):
            hidden = self.graphs.run(plan)
            return self.model.compute_logits(hidden), None  # every row is sampled
        packed = torch.tensor([plan.input_ids, plan.positions], dtype=torch.int64)
        packed = packed.to(self.device, non_blocking=True)  # [2, num_tokens], one copy
        meta = plan.attention_metadata(self.config.block_size, self.device)
        hidden, aux = self.model.forward_with_aux(packed[0], packed[1], self.kv_caches, meta,
                                                  aux_layers)  # [T, hidden], [T, 3h]
        if not plan.all_rows_sampled:
            index = torch.tensor(plan.logits_indices, dtype=torch.int64)
            hidden = hidden[index.to(self.device, non_blocking=True)]
        return self.model.compute_logits(hidden), aux

    def execute(self, sched: SchedulerOutput,
                observe: Callable[[torch.Tensor, StepPlan], None] | None = None,
                features_for: list[bool] | None = None) -> RunnerOutput:
        """``observe``: shown the step's logits and plan before sampling (token recycling);
        ``features_for[i]``: return request i's verified features (a draft head's input)."""
        plan = plan_step(sched)
        sampled: list[list[int]] = [[] for _ in sched.requests]
        aux_layers = self.aux_layers if features_for else ()
        logits, aux = self.forward_logits_and_features(plan, aux_layers)
        if observe is not None and plan.sample_requests:
            observe(logits, plan)
        num_accepted = [0] * len(sched.requests)
        if not plan.sample_requests:
            features = _verified_features(sched, plan, aux, features_for, None)
            return RunnerOutput(sampled, None, num_accepted, features)
        reqs = [sched.requests[i] for i in plan.sample_requests]
        batch = SamplingBatch(
            params=[r.sampling_params for r in reqs],
            generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            default_generator=self.default_generator,
        )
        tokens, logprobs, paths = self._sample(logits, reqs, batch)
        if paths is not None:
            self._move_accepted_kv(reqs, paths)
        accepted_nodes: list[list[int] | None] = [None] * len(sched.requests)
        logprob_rows: list[list[float]] | None = None
        if logprobs is not None:
            logprob_rows = [[] for _ in sched.requests]
        for row, i in enumerate(plan.sample_requests):
            sampled[i] = tokens[row]
            num_accepted[i] = len(tokens[row]) - 1
            accepted_nodes[i] = (paths[row] if paths is not None
                                 else list(range(num_accepted[i])))
            if logprob_rows is not None and logprobs is not None:
                logprob_rows[i] = logprobs[row]
        features = _verified_features(sched, plan, aux, features_for, accepted_nodes)
        return RunnerOutput(sampled, logprob_rows, num_accepted, features)

    def _sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest], batch: SamplingBatch,
                ) -> tuple[list[list[int]], list[list[float]] | None, list[list[int]] | None]:
        """Plain sampling, or lossless verification when any request carries drafts; the
        third item: per request, the accepted tree nodes when the step verified trees.

        On a GPU, greedy steps (and verification with the Triton kernel) stay on the device;
        sampled or penalised plain steps and torch-path verification copy the logits to the
        host, where the requests' generators live (see docs/kernels.md)."""
        on_host = logits.device.type == "cpu"
        if any(r.draft_tree is not None for r in reqs):
            # trees carry one-hot drafts (the speculator keeps draft-model chains with
            # distributions out of tree steps); chains and plain rows are trees too
            assert all(r.draft_probs is None or r.sampling_params.greedy for r in reqs)
            trees = [r.draft_tree or TokenTree.from_chain(
                r.token_ids[r.num_tokens - r.num_draft_tokens:]) for r in reqs]
            tree_out = verify_trees(logits if on_host else logits.cpu(), trees, batch)
            return tree_out.token_ids, tree_out.logprobs, tree_out.accepted_nodes
        if any(r.num_draft_tokens for r in reqs):
            drafts = [r.token_ids[len(r.token_ids) - r.num_draft_tokens:] for r in reqs]
            if not on_host and self.backend.name != "triton":
                logits = logits.cpu()
            probs = _draft_probs(reqs, logits.shape[1], logits.device)
            verified = self.backend.rejection_sample(logits, drafts, probs, batch)
            return verified.token_ids, verified.logprobs, None
        if not on_host and not all(p.greedy and not p.uses_penalties for p in batch.params):
            logits = logits.cpu()
        result = sample(logits, batch)
        tokens = [[t] for t in result.token_ids.tolist()]
        if result.logprobs is None:
            return tokens, None, None
        return tokens, [[lp] for lp in result.logprobs.tolist()], None

    def _move_accepted_kv(self, reqs: list[ScheduledRequest], paths: list[list[int]]) -> None:
        """Copy each verified tree's accepted path to the slots right after its root, in
        every layer, so the cache holds the accepted tokens at consecutive positions (the
        rejected nodes' slots are rolled back by the scheduler). Node ``i`` was written at
        row ``1 + i`` after the root; the ``k``-th accepted node belongs at row ``1 + k``.
        A path that is already in place (a chain's accepted prefix) moves nothing."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.config.block_size
        for r, path in zip(reqs, paths, strict=True):
            root = r.start_pos + r.num_tokens - r.num_draft_tokens - 1  # root's position
            for k, node in enumerate(path):
                if node != k:
                    for pos, out in ((root + 1 + node, src), (root + 1 + k, dst)):
                        out.append(r.block_table[pos // bs] * bs + pos % bs)
        if not src:
            return
        # a destination row is never a later source (node >= k): one gather, one scatter
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for kv in self.kv_caches:
            flat = kv.view(2, -1, *kv.shape[3:])  # [2, num_slots, kv_heads, head_dim]
            flat[:, dst_t] = flat[:, src_t]

    @torch.inference_mode()
    def time_forward(self, num_tokens: int, context: int = 64) -> float:
        """Seconds for one forward pass with ``num_tokens`` new tokens after ``context`` cached
        ones, every row scored, as in a verification step, whose rows the LM head scores
        (with CUDA graphs: ``num_tokens`` rows spread over sequences of at most the graphs'
        query length, which is how such a step is run). Uses the first blocks: call only
        while no request holds blocks."""
        width = self.graphs.max_query_len if self.graphs is not None else num_tokens
        seqs = -(-num_tokens // width)
        return self.time_decode(seqs, context, width, num_tokens=num_tokens,
                                share_blocks=True, score_all=True)

    @torch.inference_mode()
    def time_decode(self, batch: int, context: int, width: int = 1, *,
                    num_tokens: int | None = None, share_blocks: bool = False,
                    score_all: bool = True) -> float:
        """Seconds for one step of ``batch`` sequences each feeding ``width`` tokens (decode:
        1; verification: 1 + drafts) after ``context`` cached positions, every row scored (a
        graph-eligible step). Each sequence gets its own blocks unless ``share_blocks``.
        NaN when the pool is too small."""
        num_tokens = num_tokens if num_tokens is not None else batch * width
        bs = self.config.block_size
        per_seq = -(-(context + width) // bs)
        if per_seq * (1 if share_blocks else batch) > self.num_blocks:
            return float("nan")
        plan = _timing_plan(batch, context, width, num_tokens, per_seq, share_blocks,
                            score_all)
        synchronize(self.device)
        start = time.perf_counter()
        self.forward_logits(plan)
        synchronize(self.device)
        return time.perf_counter() - start


def _timing_plan(batch: int, context: int, width: int, num_tokens: int, per_seq: int,
                 share_blocks: bool, score_all: bool) -> StepPlan:
    widths = [min(width, num_tokens - i * width) for i in range(batch)]
    qsl = [0]
    positions: list[int] = []
    for w in widths:
        qsl.append(qsl[-1] + w)
        positions += range(context, context + w)
    tables: list[Sequence[int]] = [list(range(0 if share_blocks else s * per_seq,
                         (1 if share_blocks else s + 1) * per_seq)) for s in range(batch)]
    last = list(range(num_tokens)) if score_all else [num_tokens - 1]
    return StepPlan([0] * num_tokens, positions, qsl, [context + w for w in widths], tables,
                    last, [])


def _verified_features(sched: SchedulerOutput, plan: StepPlan, aux: torch.Tensor | None,
                       wanted: list[bool] | None,
                       accepted_nodes: list[list[int] | None] | None,
                       ) -> list[torch.Tensor | None] | None:
    """Per request, the rows of ``aux [num_tokens, 3h]`` at the positions the step verified:
    its tokens before the drafts, then the accepted drafts' rows (``accepted_nodes[i]``:
    tree nodes or a chain's first ones, in path order); on the host. One gather and one copy
    for the whole step, split into per-request views (per request, ~3 small torch ops were
    ~0.2 ms a step at 8 requests on a 2-core CPU)."""
    if aux is None or wanted is None:
        return None
    rows: list[int] = []
    counts: list[int] = []
    for i, req in enumerate(sched.requests):
        if not wanted[i]:
            continue
        first = plan.query_start_loc[i]
        plain = req.num_tokens - req.num_draft_tokens
        before = len(rows)
        rows.extend(range(first, first + plain))
        nodes = accepted_nodes[i] if accepted_nodes is not None else None
        if nodes:
            rows.extend(first + plain + node for node in nodes)
        counts.append(len(rows) - before)
    if not counts:
        return [None] * len(wanted)
    # rows increase (requests in order, a path's nodes after their parents): they are
    # contiguous when they span no more rows than they are. (Each torch call here costs
    # several times its warm time right after a forward has streamed the weights through
    # the caches, so a step that keeps every row of aux for one request, a plain decode
    # step, makes none: 45 -> ~20 us a step on the 2-core AVX2-only Zen 4.)
    if len(rows) == len(aux) and len(counts) == 1 and aux.device.type == "cpu":
        return [aux if w else None for w in wanted]  # one request, rows [0, T): all of it
    if rows[-1] - rows[0] == len(rows) - 1:
        gathered = aux[rows[0]:rows[-1] + 1].cpu()  # [sum(counts), 3h]
    else:
        gathered = aux[torch.tensor(rows, device=aux.device)].cpu()
    parts = iter(gathered.split(counts))
    return [next(parts) if w else None for w in wanted]


def _draft_probs(reqs: list[ScheduledRequest], vocab: int,
                 device: torch.device) -> torch.Tensor | None:
    """``[D, vocab]`` draft distributions for the rejection sampler, or None when every
    draft is one-hot (n-gram) or belongs to a greedy request (compared by argmax only)."""
    if all(r.draft_probs is None or r.sampling_params.greedy for r in reqs):
        return None
    rows: list[torch.Tensor] = []
    for r in reqs:
        if not r.num_draft_tokens:
            continue
        if r.draft_probs is not None:
            rows.append(r.draft_probs.to(device))
        else:  # n-gram drafts: one-hot at the drafted token
            ids = torch.tensor(r.token_ids[len(r.token_ids) - r.num_draft_tokens:])
            rows.append(torch.nn.functional.one_hot(ids, vocab).float().to(device))
    return torch.cat(rows)  # [D, vocab]
