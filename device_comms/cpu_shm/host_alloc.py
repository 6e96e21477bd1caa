"""Result tensors of collectives, allocated without a page fault per 4 KiB.

A new tensor from the malloc heap faults its pages in on first write whenever
the heap handed out memory it had returned to the kernel: glibc serves
requests of 32 MiB and more (its largest dynamic mmap threshold) with a fresh
``mmap`` every time, and below that, whether a freed block is reused or
unmapped and trimmed depends on the order of allocations and frees (a fresh
process that all-reduces 16 MiB into a new tensor in a loop faulted all 4,096
pages of every result for its first 18 calls; 4 MiB results faulted on two
calls in three, without end). Where page faults are expensive (in a virtual
machine, 1.5-2 us each) they cost more than the collective that fills the
tensor (measured in docs/performance.md, "Page faults on a new result").

So results of at least :data:`POOL_MIN_BYTES` come from :class:`ResultPool`:
anonymous mappings handed out as tensors and taken back, pages already
faulted in, once no tensor uses them any more. The tensor holds a numpy array
over the mapping (``torch.from_numpy``); a weak reference to that array says
when the last tensor, view or array derived from it is gone, and its callback
puts the mapping back. A mapping of :data:`HUGE_MIN_BYTES` or more is advised
into transparent huge pages (``MADV_HUGEPAGE``), so its first use faults 2 MiB
at a time.

The pool keeps at most :data:`IDLE_PER_SIZE` idle mappings of a size and
reserves room for that many of each size it serves, evicting the size used
longest ago when the reserved room would pass :attr:`ResultPool.idle_max_bytes`;
so idle memory never exceeds that bound. :func:`release_idle` unmaps every
idle mapping.

A pooled tensor's storage is not resizable; otherwise it is an ordinary CPU
tensor.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "empty",
    "release_idle",
    "ResultPool",
    "RESULT_POOL",
    "POOL_MIN_BYTES",
    "HUGE_MIN_BYTES",
    "IDLE_MAX_BYTES",
    "IDLE_PER_SIZE",
]

#: Results of at least this many bytes come from the pool; smaller ones from
#: ``torch.empty`` (the heap reuses blocks below glibc's first mmap threshold,
#: and the pool's own cost per tensor is a few microseconds).
POOL_MIN_BYTES = 512 << 10
#: Mappings of at least this many bytes are advised into transparent huge pages.
HUGE_MIN_BYTES = 32 << 20
#: The default bound on the memory the pool keeps while no tensor uses it.
IDLE_MAX_BYTES = 256 << 20
#: Idle mappings kept per size: a loop that rebinds a result allocates the next
#: one while the previous one still lives, so two of a size are in use at once.
IDLE_PER_SIZE = 2

_PAGE = mmap.PAGESIZE
_NUMPY_DTYPES: dict[torch.dtype, tuple[Any, bool]] = {}
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


class ResultPool:
    """Anonymous mappings lent out as tensors and reused once no tensor holds them.

    Thread-safe: a mapping is lent to one tensor at a time. A mapping comes back
    from the weak-reference callback of the array the tensor holds, in whichever
    thread drops the last reference; the callback only appends to a deque
    (atomic), so it never waits for a lock.

    Args:
        idle_max_bytes: Bound on the bytes of idle mappings kept (0: keep none).

    Attributes:
        idle_max_bytes: As the argument.
    """

    def __init__(self, idle_max_bytes: int = IDLE_MAX_BYTES) -> None:
        self.idle_max_bytes = idle_max_bytes
        # size -> idle mappings of that size, the size used last at the end
        self._idle: collections.OrderedDict[int, collections.deque[mmap.mmap]] = \
            collections.OrderedDict()
        self._lent: dict[int, tuple[Any, mmap.mmap]] = {}  # id(weakref) -> (it, mapping)
        self._lock = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` (``nbytes`` bytes, > 0)."""
        size = -(-nbytes // _PAGE) * _PAGE
        idle = self._idle_of(size)
        try:
            mapping = idle.pop() if idle is not None else _map(size)
        except IndexError:  # none idle
            mapping = _map(size)
        as_numpy, same = _numpy_dtype(dtype)
        array = np.frombuffer(mapping, dtype=as_numpy, count=nbytes // dtype.itemsize)
        array = array.reshape(shape)
        ref = weakref.ref(array, self._returned)
        self._lent[id(ref)] = (ref, mapping)
        if same:
            return torch.from_numpy(array)
        return torch.from_numpy(array).view(dtype)  # an element of the same size

    def release_idle(self) -> int:
        """Unmap every idle mapping (lent ones come back as usual); the bytes freed."""
        with self._lock:
            sizes = list(self._idle.items())
            self._idle.clear()
        freed = 0
        for size, idle in sizes:
            while True:
                try:
                    mapping = idle.pop()
                except IndexError:
                    break
                mapping.close()
                freed += size
        return freed

    @property
    def idle_bytes(self) -> int:
        """Bytes of the mappings kept idle now."""
        with self._lock:
            return sum(size * len(idle) for size, idle in self._idle.items())

    def _idle_of(self, size: int) -> collections.deque[mmap.mmap] | None:
        """The idle deque of ``size``, now the size used last (made now, evicting the
        sizes used longest ago if their reserved room is needed); None: the pool
        keeps none of ``size``."""
        with self._lock:
            idle = self._idle.get(size)
            if idle is not None:
                self._idle.move_to_end(size)
                return idle
            room = size * IDLE_PER_SIZE
            if room > self.idle_max_bytes:
                return None
            reserved = sum(self._idle) * IDLE_PER_SIZE
            evicted = []  # their mappings are unmapped outside the lock
            while reserved + room > self.idle_max_bytes:
                old, old_idle = self._idle.popitem(last=False)
                reserved -= old * IDLE_PER_SIZE
                evicted.append(old_idle)
            idle = self._idle[size] = collections.deque()
        evicted.clear()
        return idle

    def _returned(self, ref: Any) -> None:
        """Weak-reference callback: the tensor lent ``ref``'s mapping is gone."""
        _, mapping = self._lent.pop(id(ref))
        idle = self._idle.get(len(mapping))
        if idle is not None and len(idle) < IDLE_PER_SIZE:
            idle.append(mapping)


def _map(size: int) -> mmap.mmap:
    """A new anonymous private mapping of ``size`` bytes (huge-page advised if large)."""
    mapping = mmap.mmap(-1, size, flags=_FLAGS)
    if size >= HUGE_MIN_BYTES and _MADV_HUGEPAGE is not None:
        with contextlib.suppress(OSError):  # THP disabled: still correct, just 4 KiB pages
            mapping.madvise(_MADV_HUGEPAGE)
    return mapping


def _numpy_dtype(dtype: torch.dtype) -> tuple[Any, bool]:
    """numpy's dtype for torch ``dtype``'s elements and whether it is the same type
    (False: numpy has none, as for bfloat16, and an unsigned int of its size stands in)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        pass
    try:
        got = (torch.empty(0, dtype=dtype).numpy().dtype, True)
    except TypeError:
        got = (np.dtype(f"u{dtype.itemsize}"), False)
    _NUMPY_DTYPES[dtype] = got
    return got


#: The pool of this process's results.
RESULT_POOL = ResultPool()


def empty(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from :data:`RESULT_POOL` when at least
    :data:`POOL_MIN_BYTES`."""
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for n in shape_t:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes < POOL_MIN_BYTES or not _FLAGS:
        return torch.empty(shape_t, dtype=dtype)
    return RESULT_POOL.tensor(shape_t, dtype, nbytes)


def release_idle() -> int:
    """Unmap the idle mappings of :data:`RESULT_POOL`; the bytes freed."""
    return RESULT_POOL.release_idle()
