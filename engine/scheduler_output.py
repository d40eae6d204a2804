"""The scheduler's contract with the rest of the engine: the step it hands the runner
(:class:`SchedulerOutput` of :class:`ScheduledRequest`, the one scheduler -> runner
dataclass, read-only there), what applying a step did (:class:`RequestUpdate`), and what it
asks of speculation (:class:`Speculation`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from quickdraft.engine.request import Request, RequestStatus
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.token_tree import TokenTree


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: the scheduler -> runner contract (read-only there)."""

    request_id: str
    token_ids: list[int]  # inputs: not-yet-computed tokens, then draft tokens
    start_pos: int  # position of token_ids[0] (= num_computed_tokens)
    block_table: tuple[int, ...]  # covers start_pos + len(token_ids) positions
    num_draft_tokens: int  # drafts at the tail of token_ids, to verify this step
    # [num_draft_tokens, vocab] draft-model distributions, or None (one-hot / greedy drafts)
    draft_probs: torch.Tensor | None
    sample: bool  # the step reaches the end of the request: sample 1 + num_draft_tokens rows
    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # the drafts as a tree below the token before them (their order is the tree's); None:
    # a chain
    draft_tree: TokenTree | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class RequestUpdate:
    """What one step did to one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool



class Speculation(Protocol):
    """What the scheduler asks of speculation (:class:`spec.speculator.Speculator`), which
    keeps each request's state in ``request.spec_state`` and follows these calls."""

    def plan(self, requests: list[Request], rooms: list[int], num_plain_tokens: int,
             budget: int) -> None:
        """Drafts for this step's decoding ``requests`` (at most ``rooms[i]`` each, ``budget``
        in all) in a batch of ``num_plain_tokens`` tokens without drafts: model-free drafts
        into ``spec_token_ids``, the draft model's count into ``spec_state.model_k``."""

    def draft(self, requests: list[Request]) -> None:
        """The draft model fills the drafts it owes, into slots already reserved."""

    def cancel(self, request: Request) -> None:
        """The drafts planned for ``request`` will not run (the pool was short)."""

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """One verification of ``request``'s drafts happened."""

    def on_preempt(self, request: Request) -> None: ...

    def on_finish(self, request: Request, status: RequestStatus) -> None: ...
