"""Per-request speculation override (the API's ``speculation`` field)."""

from __future__ import annotations

from dataclasses import dataclass

from quickdraft.engine.sampling_params import InvalidParameterError

SPEC_METHODS = ("off", "ngram", "suffix", "recycling", "draft", "head", "combined")


@dataclass(frozen=True)
class SpeculationParams:
    """``method`` None = the engine's default; ``k`` None = the policy decides up to max."""

    method: str | None = None
    k: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise InvalidParameterError(
                "speculation.method", f"must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        if self.k is not None and not (isinstance(self.k, int) and 0 <= self.k <= 16):
            raise InvalidParameterError("speculation.k", "must be an integer in [0, 16]")
