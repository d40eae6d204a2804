"""What the engine hands back: one delta per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    queue_time: float = 0.0  # seconds from arrival to first scheduled
    ttft: float | None = None  # seconds from arrival to first token
    decode_time: float = 0.0  # seconds from first token to finish
    num_spec_steps: int = 0  # verification steps that carried drafts
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + 1); 0 without drafts."""
        if not self.num_spec_steps:
            return 0.0
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps


@dataclass(frozen=True)
class RequestOutput:
    """A streamed delta: the text and tokens produced for one request by one step.

    One delta may carry several tokens (speculation accepts several at once) or none
    (text held back until a character or a possible stop string completes).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[float] | None = None
    usage: Usage | None = None  # set on the final delta
    error: str | None = None
