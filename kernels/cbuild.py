"""Build-on-first-use for the small C kernels: compile with gcc, cache, load with ctypes.

A kernel's shared library lands in ``$QUICKDRAFT_CACHE/kernels`` (default
``~/.cache/quickdraft/kernels``) as ``<name>-<hash of source and flags>.so``: written to a temp
file and ``os.replace``d into place, older builds of the same kernel removed. The source goes
through stdin so what is built is exactly what was hashed. Loading never raises: without gcc,
without the CPU features or on a failed build it logs one warning and returns None, and the
caller falls back to its torch reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Built kernels: ``$QUICKDRAFT_CACHE/kernels``, else ``~/.cache/quickdraft/kernels``."""
    root = os.environ.get("QUICKDRAFT_CACHE") or Path.home() / ".cache" / "quickdraft"
    return Path(root) / "kernels"


def cpu_has(flags: frozenset[str]) -> bool:
    """Whether /proc/cpuinfo lists every one of ``flags`` (e.g. avx2, fma, f16c)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split()) >= flags
    return False


def build(name: str, source: bytes, cflags: tuple[str, ...], cc: str, *, lang: str = "c",
          ldflags: tuple[str, ...] = ("-lm",)) -> Path:
    """Compile ``source`` (``lang``: ``c`` or ``c++``) into the cache (once per source and
    flags); the library's path."""
    digest = hashlib.sha256(source + " ".join((*cflags, *ldflags)).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"{name}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags, "-o", tmp, "-x", lang, "-", *ldflags], input=source,
                       check=True, capture_output=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for stale in out_dir.glob(f"{name}-*.so"):  # builds of older sources (unlinking is safe
        if stale != target:                     # even if another process has one loaded)
            with contextlib.suppress(OSError):
                stale.unlink()
    return target


def load(name: str, source: Path, cflags: tuple[str, ...],
         cpu_flags: frozenset[str]) -> ctypes.CDLL | None:
    """Build if needed and load; None (with one warning) when that is impossible.

    CDLL, not PyDLL: the GIL is released during calls. torch is imported first, so the
    library's libgomp.so.1 resolves to torch's and both share one OpenMP thread pool.
    """
    try:
        if not cpu_has(cpu_flags):
            log.warning("%s: CPU lacks %s; using the torch reference", name, sorted(cpu_flags))
            return None
        cc = shutil.which("gcc")
        if cc is None:
            log.warning("%s: gcc not found; using the torch reference", name)
            return None
        return ctypes.CDLL(str(build(name, source.read_bytes(), cflags, cc)))
    except subprocess.CalledProcessError as e:
        log.warning("%s: build failed, using the torch reference:\n%s", name,
                    e.stderr.decode(errors="replace"))
    except Exception as e:
        log.warning("%s: unavailable (%s: %s); using the torch reference", name,
                    type(e).__name__, e)
    return None
