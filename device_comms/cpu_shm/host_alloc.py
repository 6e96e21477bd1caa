"""Allocation of large result tensors without a page fault per 4 KiB.

glibc serves requests of 32 MiB and more (its largest dynamic mmap threshold)
with a fresh ``mmap`` every time, so a new 64 MiB tensor costs 16,384 page
faults when first written, one per 4 KiB page; where page faults are expensive
(in a virtual machine) they can cost more than the collective that fills the
tensor (measured in docs/performance.md). For such sizes :func:`empty` maps
anonymous memory itself and advises transparent huge pages
(``MADV_HUGEPAGE``), so the kernel faults it in 2 MiB pages. Smaller tensors
come from ``torch.empty`` (the malloc heap reuses them without faults).

The tensor owns its mapping (it is unmapped when the last tensor using the
storage is freed); its storage is not resizable, otherwise it is an ordinary
CPU tensor.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

import torch

__all__ = ["empty", "HUGE_MIN_BYTES"]

HUGE_MIN_BYTES = 32 << 20
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def empty(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; huge-page backed when at least :data:`HUGE_MIN_BYTES`."""
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape_t)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES or _MADV_HUGEPAGE is None or not _FLAGS:
        return torch.empty(shape_t, dtype=dtype, device="cpu")  # whatever the default device
    mm = mmap.mmap(-1, nbytes, flags=_FLAGS)
    with contextlib.suppress(OSError):  # THP disabled: still correct, just 4 KiB pages
        mm.madvise(_MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=dtype, count=numel).view(shape_t)
