"""Per-request sampling parameters: a frozen, validated dataclass.

Every field is checked in ``__post_init__`` so a bad value is refused when the request is
made, with the offending field named, never later inside the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy (argmax); every other filter is then ignored.
    ``seed`` makes a sampled request reproducible on its own, whatever it is batched with.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off (HF/CTRL style, prompt + output)
    presence_penalty: float = 0.0  # OpenAI style, output tokens only
    frequency_penalty: float = 0.0  # OpenAI style, output tokens only
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool = False  # logprob of each chosen token
    skip_special_tokens: bool = True
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", "must be an integer >= 1")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               "top_k", "must be an integer >= 0 (0 = off)")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", "must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", "must be an integer in [0, 2**63)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), "stop", "must be non-empty strings")
        _check(len(stop) <= 16, "stop", "at most 16 stop strings")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids)
        _check(all(isinstance(t, int) and t >= 0 for t in ids),
               "stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seeded_sampling(self) -> bool:
        """Sampled with a seed: the output must depend on the seed and prompt alone."""
        return not self.greedy and self.seed is not None

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
