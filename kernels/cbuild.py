"""Build-on-first-use for the small C kernels: compile with gcc, cache, load with ctypes.

A kernel's shared library lands in ``$QUICKDRAFT_CACHE/kernels`` (default
``~/.cache/quickdraft/kernels``) as ``<name>-<hash of source and flags>.so``: written to a temp
file and ``os.replace``d into place, older builds of the same kernel removed. The source goes
through stdin so what is built is exactly what was hashed: :func:`read_source` expands its
``#include "name.h"`` lines (headers beside it, each once) into that one text. Loading never
raises: without gcc, without the CPU features, without the source (a broken install) or on a
failed build it logs one ERROR and returns None, and the caller falls back to its torch
reference, which is several times slower. :func:`status` says which kernels loaded and why the
others did not (``/health`` shows it, ``quickdraft serve`` prints it at start-up).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# kernel name -> "ok" or why it is not available. Written by load() and record(), read by
# status(); kernels load once per process (their modules cache the result).
_STATUS: dict[str, str] = {}


def record(name: str, problem: str | None) -> None:
    """Note that ``name`` loaded (``problem`` None) or why not (logged once as an ERROR: the
    torch fallback it leaves is a slow path nobody asked for)."""
    if problem is None:
        _STATUS[name] = "ok"
        return
    if _STATUS.get(name) != problem:
        log.error("%s: %s; the torch fallback runs instead (slower)", name, problem)
    _STATUS[name] = problem


def status() -> dict[str, str]:
    """Every native kernel this process tried to load: ``"ok"`` or why not."""
    return dict(_STATUS)


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


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$')


def read_source(path: Path) -> bytes:
    """``path``'s text with each ``#include "name.h"`` line replaced by the text of
    ``name.h`` from the same folder (expanded the same way; a header already expanded is left
    out): one translation unit, so the hash covers every line compiled. ``#line`` markers keep
    compiler messages pointing at the right file and line."""
    seen: set[Path] = set()

    def expand(file: Path) -> list[bytes]:
        seen.add(file)
        out = [b'#line 1 "%s"' % file.name.encode()]
        for number, line in enumerate(file.read_bytes().splitlines(), start=1):
            match = _LOCAL_INCLUDE.match(line)
            if match is None:
                out.append(line)
                continue
            header = file.parent / match.group(1).decode()
            if header not in seen:
                out += expand(header)
            out.append(b'#line %d "%s"' % (number + 1, file.name.encode()))
        return out

    return b"\n".join(expand(path.resolve())) + b"\n"


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
    """Build if needed and load; None (with one error logged) when that is impossible.

    CDLL, not PyDLL: the GIL is released during calls. torch is imported first, so the
    library's libgomp.so.1 resolves to torch's and both share one OpenMP thread pool.
    """
    problem: str
    try:
        if not cpu_has(cpu_flags):
            problem = f"CPU lacks {sorted(cpu_flags)}"
        elif (cc := shutil.which("gcc")) is None:
            problem = "gcc not found"
        else:
            lib = ctypes.CDLL(str(build(name, read_source(source), cflags, cc)))
            record(name, None)
            return lib
    except subprocess.CalledProcessError as e:
        problem = f"build failed:\n{e.stderr.decode(errors='replace')[-2000:]}"
    except Exception as e:
        problem = f"unavailable ({type(e).__name__}: {e})"
    record(name, problem)
    return None
