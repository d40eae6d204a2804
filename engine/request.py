"""A request's state inside the engine.

One progress model for everything: ``num_computed_tokens`` (tokens whose K/V is in the cache)
chases ``num_tokens`` (prompt + verified output) plus any draft tokens awaiting verification.
Prefill chunks, decode steps and verification are all "schedule the next tokens of this request".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.params import SpeculationParams
from quickdraft.spec.state import RequestSpecState
from quickdraft.spec.token_tree import TokenTree


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Draft tokens proposed for this step; they are part of the scheduled input but not of
    # `num_tokens` until verified. A chain, or, when `spec_tree` is set, that tree's nodes
    # in its (topological) order, below the last verified token.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_tree: TokenTree | None = None
    # Draft-model distributions of those drafts [num_drafts, vocab] (sampled requests only).
    spec_draft_probs: torch.Tensor | None = None
    spec_state: RequestSpecState = field(default_factory=RequestSpecState)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    spec_params: SpeculationParams | None = None
    cache_salt: str | None = None  # separates prefix-cache namespaces (e.g. tenants)
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    num_spec_steps: int = 0  # verification steps with >= 1 draft
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_lookahead_tokens(self) -> int:
        """Draft slots this step needs: the drafts, or those the draft model still owes."""
        return len(self.spec_token_ids) + self.spec_state.model_k

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_tree, self.spec_draft_probs = [], None, None

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output + drafts (no full-list copy)."""
        n_prompt = len(self.prompt_token_ids)
        out: list[int] = []
        if start < n_prompt:
            out += self.prompt_token_ids[start : min(end, n_prompt)]
        n_tokens = self.num_tokens
        if end > n_prompt and start < n_tokens:
            out += self.output_token_ids[max(start - n_prompt, 0) : end - n_prompt]
        if end > n_tokens:
            out += self.spec_token_ids[max(start - n_tokens, 0) : end - n_tokens]
        return out

    def append_output(self, token_id: int, logprob: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions that depend only on token ids (stop strings are checked on text)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
