"""Weights on 2 MiB pages: one buffer the kernel is asked to back with transparent huge pages.

A CPU decode step streams every 4-bit weight from DRAM (96 MB for SmolLM2-135M). On 4 KiB
pages that is ~24,000 pages a step, far more than the TLB holds, so each page can cost a
page walk (whose table entries the stream itself evicts from the caches). With the machine's
transparent huge pages in ``madvise`` mode (the usual default) memory is on 4 KiB pages
unless a region asks otherwise; :func:`copy_to_huge_pages` copies tensors into one anonymous
mapping that does (``madvise(MADV_HUGEPAGE)`` before the first touch), 64-byte aligned each.

Measured on the 2-core AVX2-only EPYC (Zen 3), SmolLM2's 120 layer matrices and Q8_0 head
through the q4q8 kernel, the two placements alternating in one process: 0.913x the time at
1 row, 0.949x at 2, 0.975x at 4, 0.991x at 8; whole decode steps ~0.986x
(docs/kernels.md).

Where the mapping or the advice is not available (not Linux, THP ``never``, a kernel
without it) the tensors come back unchanged: the same values either way, only where they
live differs. Needs only the standard library and torch.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: every tensor starts on a cache line
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The machine's transparent-huge-page mode (``always``, ``madvise``, ``never``), or
    None where it cannot be read."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


# madvise(MADV_POPULATE_WRITE): fault a range in now, writable (Linux 5.14+; the mmap module
# names it from Python 3.12)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _advised_buffer(nbytes: int, populate: bool = False) -> torch.Tensor | None:
    """``nbytes`` zero bytes (uint8) starting on a 2 MiB boundary of an anonymous mapping
    advised onto huge pages: untouched (the kernel fills pages on first use), or with
    ``populate`` every page faulted in now; None where that is impossible."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or thp_mode() not in ("always", "madvise"):
        return None
    try:
        # page-aligned; one huge page more so that the used part can start on a 2 MiB
        # boundary (only whole aligned 2 MiB ranges become huge pages). Private: a shared
        # anonymous mapping is shmem, whose huge pages follow another setting (usually never)
        buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)  # (keeps the mapping alive)
        skip = -raw.data_ptr() % HUGE_PAGE
        length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        buffer.madvise(advice, skip, min(length, len(buffer) - skip))
    except (OSError, ValueError):
        return None
    if populate:
        try:
            buffer.madvise(_POPULATE_WRITE, skip, min(length, len(buffer) - skip))
        except (OSError, ValueError):  # an older kernel: write every page instead
            raw[skip:skip + nbytes].zero_()
    return raw[skip:skip + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype, *, populate: bool = False) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` (CPU) on huge pages where it can be: a KV cache
    pool, read block by block every step. ``populate``: every page faulted in now (as
    ``torch.zeros`` does, writing them), else each is on its first write. A KV pool is
    populated: a huge page's first fault zeroes 2 MiB, and on a VM whose host backs memory
    lazily it cost ~2.7 ms (1 GiB in 1.4 s; 0.1 s once the host had backed it), so a lazy pool
    made whichever request first wrote a new stretch of blocks pay ~60 such faults a step (a
    prefill of 8 prompts 2x its time, on the 2-core AMX Xeon VM; docs/kernels.md)."""
    numel = math.prod(shape)
    raw = _advised_buffer(numel * dtype.itemsize, populate) if numel else None
    if raw is None:
        return torch.zeros(*shape, dtype=dtype)
    return raw.view(dtype).view(*shape)


def copy_to_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors`` (CPU) side by side in one buffer advised onto huge
    pages; ``tensors`` themselves where that is impossible. The copies keep the buffer
    alive (through their storage); they are not resizable."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    raw = _advised_buffer(sum(sizes))
    if raw is None:
        return list(tensors)
    out: list[torch.Tensor] = []
    offset = 0
    for t, size in zip(tensors, sizes, strict=True):
        nbytes = t.numel() * t.element_size()
        view = raw[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += size
    return out
