"""kernels/huge_pages.py: copies hold the same values, aligned, side by side in one buffer;
where the advice is unavailable the tensors come back as they were."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from quickdraft.kernels import huge_pages


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (300, 1000), dtype=torch.uint8, generator=g),
            torch.randn(17, 3, generator=g).half(),
            torch.empty(0, dtype=torch.bfloat16),
            torch.randn(5, 7, generator=g).bfloat16()[:, 2:]]  # not contiguous


def test_copies_hold_the_values_aligned_in_one_buffer() -> None:
    tensors = _tensors()
    copies = huge_pages.copy_to_huge_pages(tensors)
    assert len(copies) == len(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)
    if huge_pages.thp_mode() not in ("always", "madvise") \
            or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no transparent huge pages here: the inputs come back")
    assert all(c.data_ptr() % huge_pages.ALIGN == 0 for c in copies if c.numel())
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the buffer's first 2 MiB page
    starts = [c.data_ptr() for c in copies if c.numel()]
    assert starts == sorted(starts) and starts[-1] - starts[0] < 2 * huge_pages.HUGE_PAGE
    copies[1].add_(1)  # writable, and the copies are not the inputs
    assert not torch.equal(copies[1], tensors[1])


def test_without_the_advice_the_tensors_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _tensors()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert all(a is b for a, b in zip(huge_pages.copy_to_huge_pages(tensors), tensors,
                                      strict=True))
    assert huge_pages.copy_to_huge_pages([]) == []


def test_zeros_are_zeros_of_the_shape() -> None:
    t = huge_pages.zeros((2, 5, 16, 3, 64), torch.bfloat16)
    assert t.shape == (2, 5, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 4].fill_(2.0)  # writable, every element
    assert t.sum().item() == 2.0 * 16 * 3 * 64
    assert huge_pages.zeros((0, 4), torch.float32).shape == (0, 4)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("kernel_populates", [True, False])
def test_populated_zeros_are_resident_from_the_start(monkeypatch: pytest.MonkeyPatch,
                                                     kernel_populates: bool) -> None:
    """``populate`` faults every page in at once (madvise, else by writing them: an older
    kernel refuses the advice); without it the pages wait for their first write."""
    if not kernel_populates:
        monkeypatch.setattr(huge_pages, "_POPULATE_WRITE", -1)  # (an advice none knows)
    size = 64 << 20
    before = _resident_bytes()
    lazy = huge_pages.zeros((size,), torch.uint8)
    mid = _resident_bytes()
    t = huge_pages.zeros((size,), torch.uint8, populate=True)
    after = _resident_bytes()
    assert after - mid >= size * 0.9
    assert mid - before < size * 0.5
    assert not t.any() and t.shape == (size,) and not lazy[:4096].any()
