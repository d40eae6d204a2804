"""The synchronous engine: ``add_request``, ``step``, ``abort``.

Data flow of one step: the scheduler assigns tokens to requests (``SchedulerOutput``), the
model runner computes and samples, the scheduler advances progress and applies token-level
stops, and the output processor turns new tokens into text deltas (stop strings included).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quickdraft.engine import loader
from quickdraft.engine.backend import KernelBackend, select_backend
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.cpu_threads import ThreadGovernor
from quickdraft.engine.detokenizer import IncrementalDetokenizer
from quickdraft.engine.kv_cache import KVCacheManager, cdiv, kv_bytes_per_block
from quickdraft.engine.model_runner import ModelRunner
from quickdraft.engine.models.llama_layers import ModelShape
from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import InvalidParameterError, SamplingParams
from quickdraft.engine.scheduler import RequestUpdate, Scheduler
from quickdraft.engine.startup_costs import measure_draft_costs, measure_target_cost
from quickdraft.engine.step_plan import CHECK_INVARIANTS
from quickdraft.spec.draft_cost import ObservedDraftCost
from quickdraft.spec.draft_head import SHIPPED_HEADS, find_head, model_fingerprint
from quickdraft.spec.draft_head_runner import DraftHeadRunner
from quickdraft.spec.draft_model import DraftModelRunner, check_same_vocabulary
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import HEAD_NODES_PER_DRAFT, Speculator
from quickdraft.spec.speed_guard import SpeedGuardConfig
from quickdraft.spec.step_cost import ObservedStepCost
from quickdraft.spec.suffix_corpus import find_corpus

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192
STEP_COST_REFRESH_S = 0.03  # seconds of steps between re-pricings (spec.step_cost)


class InvalidRequestError(InvalidParameterError):
    """A request cannot be served as asked (too long, empty, bad token ids, duplicate id)."""


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    architecture: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True,
                 backend: KernelBackend | None = None) -> None:
        """``backend``: the kernel backend (default: :func:`select_backend` of ``config``)."""
        self.config = config
        model_dir = loader.resolve_model(config.model, progress=progress)
        hf_config = loader.load_config(model_dir)
        self.tokenizer = loader.load_tokenizer(model_dir)
        self.eos_token_ids = loader.eos_token_ids(model_dir, hf_config, self.tokenizer)
        self.max_model_len = self._max_model_len(hf_config)
        self.backend: KernelBackend = backend or select_backend(config)
        # threads per step: config.num_threads, or adapted to the machine's load (CPU)
        self.threads = ThreadGovernor(config.num_threads,
                                      adaptive=self.backend.device.type == "cpu")
        self.draft = self._load_draft()
        head = find_head(config.draft_head if self.draft is None else None, model_dir,
                         ModelShape.from_config(hf_config))
        head_bytes = 0
        if head is not None:
            c = head.config
            head_bytes = kv_bytes_per_block(config.block_size, 1, c.num_kv_heads, c.head_dim,
                                            config.torch_dtype.itemsize)
        self.runner = ModelRunner(config, model_dir, hf_config, self.max_model_len,
                                  (self.draft.kv_bytes_per_block() if self.draft else 0)
                                  + head_bytes, self.backend)
        self.head: DraftHeadRunner | None = None
        if head is not None:
            self.head = DraftHeadRunner(head, self.runner.model, config.block_size,
                                        self.backend, torch.Generator().manual_seed(
                                            config.seed + 2))
            self.head.allocate(self.runner.num_blocks)
            self.runner.aux_layers = head.config.aux_layers
        if self.draft is not None:
            check_same_vocabulary(self.tokenizer, self._draft_tokenizer,
                                  self.runner.vocab_size, self.draft.vocab_size)
            self.draft.allocate(self.runner.num_blocks)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        architecture = (hf_config.architectures or [hf_config.model_type])[0]
        self.info = ModelInfo(str(model_dir), architecture, self.max_model_len,
                              self.runner.vocab_size, self.runner.num_blocks, config.block_size)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        draft_cost, draft_fixed_cost = measure_draft_costs(config, self.head, self.draft)
        # proposals as served cost more than the warm start-up timing: priced from their
        # observed times (None: not measured, drafting free)
        observed = ObservedDraftCost(draft_cost, draft_fixed_cost) \
            if draft_cost is not None else None
        step_cost = measure_target_cost(config, self.runner)
        # a measured curve is corrected by the steps' real times while serving (a busy
        # neighbour makes rows dearer); the default curve of an unmeasured engine stays fixed
        self.step_cost = ObservedStepCost(step_cost, refresh_seconds=STEP_COST_REFRESH_S) \
            if config.measure_step_cost and config.speculation != "off" else None
        policy = SpeculationPolicy(
            self.step_cost or step_cost, config.num_speculative_tokens,
            draft_cost=observed.per_draft if observed else None,
            draft_fixed_cost=observed.fixed if observed else None,
            rows_per_model_draft=HEAD_NODES_PER_DRAFT if self.head and not self.draft else 1)
        self.speculation = config.speculation
        if self.speculation == "auto":
            # combined when the user asked for a draft model or a head directory; a head
            # found on its own (shipped for this model) is there for requests that ask for
            # "head" or "combined": on the 2-core CPUs combined measured no faster than
            # suffix trees with it (docs/draft_head.md), so it is not the default
            chosen = self.draft is not None or (
                self.head is not None and config.draft_head not in (None, "none", "auto"))
            self.speculation = "combined" if chosen else "suffix"
        self.speculator = Speculator(
            self.speculation, config.num_speculative_tokens, config.ngram_min,
            config.ngram_max, policy, self.kv, self.draft, self.max_model_len,
            vocab_size=self.runner.vocab_size, head=self.head,
            verify_trees=self.runner.backend.verify_trees,
            suffix_corpus=find_corpus(
                config.suffix_corpus, model_fingerprint(model_dir), SHIPPED_HEADS,
                self._tokenize_texts, loader.cache_root(), self.runner.vocab_size)
            if config.speculation != "off" else None,
            speed_guard=SpeedGuardConfig() if config.speed_guard else None,
            draft_cost=observed)
        # the scheduler decides who runs with how many drafts; the speculator follows it
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.priority_aging_s,
                                   config.max_background_tokens_with_interactive,
                                   config.max_background_tokens_per_step, self.speculator)

    def _tokenize_texts(self, texts: list[str]) -> list[list[int]]:
        """The target's token ids of each text, no special tokens added (a public corpus's
        text re-tokenized for this target: spec/suffix_corpus.py)."""
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    def describe_speculation(self) -> dict[str, Any]:
        """What drafts for this engine (for ``/health``): the default method, whether a draft
        head and a draft model are loaded, and the public suffix corpus's size (None: none)."""
        suffix = self.speculator.suffix
        corpus = suffix.corpus if suffix is not None else None
        return {"method": self.speculation, "draft_head": self.head is not None,
                "draft_model": self.draft is not None,
                "suffix_corpus_tokens": corpus.num_tokens if corpus is not None else None}

    def _load_draft(self) -> DraftModelRunner | None:
        if self.config.draft_model is None:
            return None
        draft, self._draft_tokenizer = DraftModelRunner.load(
            self.config.draft_model, self.config.torch_dtype, self.max_model_len,
            self.config.block_size, self.backend, self.config.seed)
        return draft

    def _max_model_len(self, hf_config: Any) -> int:
        limit = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # we attend to the full context: stay inside the window
        if self.config.max_model_len is not None:
            return min(self.config.max_model_len, limit)
        return min(limit, DEFAULT_MAX_MODEL_LEN)

    # ------------------------------------------------------------------ requests

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return list(ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        speculation: SpeculationParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; raises :class:`InvalidRequestError` naming the bad field."""
        params = sampling_params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"duplicate request id {request_id!r}")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt", "give a prompt string or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt_token_ids)
        self._validate_prompt(ids)
        self._validate_speculation(speculation)
        request = Request(request_id, ids, params, self.eos_token_ids, priority=priority,
                          spec_params=speculation, cache_salt=cache_salt)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params)
        self.scheduler.add_request(request)

    def _validate_speculation(self, speculation: SpeculationParams | None) -> None:
        method = speculation.method if speculation else None
        if method == "draft" and self.draft is None:
            raise InvalidRequestError("speculation.method",
                                      f"{method!r} needs a draft model; this server has none")
        if method == "head" and self.head is None:
            raise InvalidRequestError("speculation.method",
                                      f"{method!r} needs a draft head; this server has none")
        if speculation and speculation.k is not None \
                and speculation.k > self.config.num_speculative_tokens:
            raise InvalidRequestError(
                "speculation.k", f"at most {self.config.num_speculative_tokens} on this server")

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(ids)} tokens; this model's context is "
                f"{self.max_model_len} and at least one new token must fit")
        if cdiv(len(ids) + 1, self.config.block_size) > self.kv.pool.num_blocks:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                f"({self.kv.pool.num_blocks * self.config.block_size} tokens)")

    def abort(self, request_ids: list[str] | str) -> list[RequestOutput]:
        """End requests now (their blocks are free when this returns)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finished = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._final_output(r, "", []) for r in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        drafting = self.speculator.stats.model_draft_seconds
        sched = self.scheduler.schedule()
        if sched.empty:
            return self._fail_unschedulable()
        self.threads.before_step()
        now = time.monotonic()
        requests = [self.scheduler.requests[s.request_id] for s in sched.requests]
        for request in requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        try:
            start = time.perf_counter()
            result = self.runner.execute(sched, self.speculator.recycler(requests),
                                         self.speculator.features_wanted(requests))
            model_seconds = time.perf_counter() - start
            if result.features is not None:
                self.speculator.observe_features(
                    requests, [s.start_pos for s in sched.requests], result.features)
        except Exception as exc:  # one bad step must not take the engine down
            log.exception("model step failed")
            ids = [s.request_id for s in sched.requests]
            failed = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            return [self._final_output(r, "", [], error=f"{type(exc).__name__}: {exc}")
                    for r in failed]
        updates = self.scheduler.update_from_output(sched, result.sampled, result.logprobs,
                                                    result.num_accepted)
        outputs = [out for u in updates if (out := self._process(u)) is not None]
        self.speculator.observe_step(
            requests, all(s.sample and s.num_tokens == 1 + s.num_draft_tokens
                          for s in sched.requests),
            sum(len(u.new_token_ids) for u in updates), time.perf_counter() - began)
        if self.step_cost is not None:
            # the rest of the step but the draft model's (or head's) forwards, which the
            # policy prices apart (draft_cost)
            drafted = self.speculator.stats.model_draft_seconds - drafting
            rest = time.perf_counter() - began - drafted - model_seconds
            self.step_cost.observe(sched.num_tokens, model_seconds, rest)
        if CHECK_INVARIANTS:
            self.scheduler.check_invariants()
        return outputs

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could run although requests wait: the head request can never fit."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        head = self.scheduler.waiting[0]
        failed = self.scheduler.finish_requests([head.request_id], RequestStatus.FINISHED_ERROR)
        return [self._final_output(r, "", [], error="the KV cache is too small for this request")
                for r in failed]

    def _process(self, update: RequestUpdate) -> RequestOutput | None:
        request = update.request
        detok = self._detokenizers[request.request_id]
        delta = detok.add_tokens(update.new_token_ids) if update.new_token_ids else None
        text = delta.text if delta else ""
        stop = delta.stop_str if delta is not None else None
        if stop is not None:  # a stop string ends the request whatever the tokens said
            if not update.finished:
                self.scheduler.finish_requests([request.request_id],
                                               RequestStatus.FINISHED_STOPPED)
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if update.finished or stop is not None:
            return self._final_output(request, text, update.new_token_ids)
        if not text and not update.new_token_ids:
            return None
        lp = request.output_logprobs[-len(update.new_token_ids):] \
            if request.sampling_params.logprobs and update.new_token_ids else None
        return RequestOutput(request.request_id, text, update.new_token_ids, logprobs=lp)

    def _final_output(self, request: Request, text: str, new_tokens: list[int],
                      error: str | None = None) -> RequestOutput:
        detok = self._detokenizers.pop(request.request_id, None)
        if detok is not None and request.status != RequestStatus.FINISHED_STOPPED:
            text += detok.finish()
        n = len(new_tokens)
        lp = request.output_logprobs[-n:] if request.sampling_params.logprobs and n else None
        return RequestOutput(
            request_id=request.request_id, text=text, token_ids=new_tokens, finished=True,
            finish_reason=request.status.value, stop_reason=request.stop_reason,
            logprobs=lp, usage=self._usage(request), error=error or request.error)

    @staticmethod
    def _usage(request: Request) -> Usage:
        now = time.monotonic()
        first = request.first_token_time
        scheduled = request.first_scheduled_time
        return Usage(
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens or 0,
            queue_time=(scheduled or now) - request.arrival_time,
            ttft=(first - request.arrival_time) if first else None,
            decode_time=(now - first) if first else 0.0,
            num_spec_steps=request.num_spec_steps,
            num_drafted_tokens=request.num_drafted_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    # ------------------------------------------------------------------ convenience

    def generate(self, prompts: Sequence[str | list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; one merged output per prompt (for scripts and tests)."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            if isinstance(prompt, str):
                self.add_request(rid, prompt, params)
            else:
                self.add_request(rid, sampling_params=params, prompt_token_ids=prompt)
        merged: dict[str, tuple[list[str], list[int]]] = {rid: ([], []) for rid in ids}
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                merged[out.request_id][0].append(out.text)
                merged[out.request_id][1].extend(out.token_ids)
                if out.finished:
                    final[out.request_id] = out
        return [
            RequestOutput(rid, "".join(merged[rid][0]), merged[rid][1], True,
                          final[rid].finish_reason, final[rid].stop_reason,
                          usage=final[rid].usage, error=final[rid].error)
            for rid in ids
        ]
