"""Result tensors of collectives, allocated without a page fault per 4 KiB.

A new tensor from the malloc heap faults its pages in on first write whenever
the heap handed out memory it had returned to the kernel: glibc serves
requests of 32 MiB and more (its largest dynamic mmap threshold) with a fresh
``mmap`` every time, and below that, whether a freed block is reused or
unmapped and trimmed depends on the order of allocations and frees. A plain
process that makes a new 1 MiB or 3 MiB result in a loop, rebinding it,
faulted on 34 of 49 calls; where page faults are expensive (in a virtual
machine, 1.5-2 us each) that costs more than the collective that fills the
tensor (docs/performance.md, "Page faults on a new result").

So results of at least :data:`POOL_MIN_BYTES` come from :class:`ResultPool`:
anonymous mappings handed out as tensors and taken back, pages already
faulted in, once no tensor uses them any more. The tensor holds a numpy array
over the mapping (``torch.from_numpy``); a weak reference to that array says
when the last tensor, view, storage or array derived from it is gone, and its
callback puts the mapping back. Mappings come in size classes (powers of two):
a result of another size within a class reuses the class's mapping and
touches only its own pages, so varying sizes (a batch's token count) do not
each map afresh. A mapping of :data:`HUGE_MIN_BYTES` or more is advised into
transparent huge pages (``MADV_HUGEPAGE``), so its first use faults 2 MiB at a
time.

The pool keeps at most :data:`IDLE_PER_SIZE` idle mappings of a class and
reserves room for that many of each class it serves, evicting the class used
longest ago when the reserved room would pass :attr:`ResultPool.idle_max_bytes`;
so idle memory never exceeds that bound. :func:`release_idle` drops every idle
mapping.

A pooled tensor's storage is not resizable; otherwise it is an ordinary CPU
tensor.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from device_comms.cpu_shm.host_arrays import numpy_dtype

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
#: ``torch.empty``. Measured (docs/performance.md): at 512 KiB the heap's
#: blocks were reused (5 faults a call, 18 us against the pool's 19), at 1 MiB
#: they were not (167 faults a call, 325 us against 29); a pooled tensor costs
#: about 2 us more to make.
POOL_MIN_BYTES = 1 << 20
#: Mappings of at least this many bytes are advised into transparent huge pages.
HUGE_MIN_BYTES = 32 << 20
#: The default bound on the memory the pool keeps while no tensor uses it.
IDLE_MAX_BYTES = 256 << 20
#: Idle mappings kept per size class: a loop that rebinds a result allocates the
#: next one while the previous one still lives, so two of a class are in use at once.
IDLE_PER_SIZE = 2

_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
#: torch dtype -> (numpy dtype of its elements, whether it is the same type)
_NUMPY_DTYPES: dict[torch.dtype, tuple[Any, bool]] = {}


def size_class(nbytes: int) -> int:
    """The bytes of the mapping that serves a result of ``nbytes`` (> 0): the next
    power of two, at least a page."""
    return max(mmap.PAGESIZE, 1 << (nbytes - 1).bit_length())


class ResultPool:
    """Anonymous mappings lent out as tensors and reused once no tensor holds them.

    Thread-safe: a mapping is lent to one tensor at a time. It comes back from
    the weak-reference callback of the array the tensor holds, in whichever
    thread drops the last reference (or the garbage collector); the callback
    never waits for the lock: when another thread holds it, the mapping is
    dropped (unmapped once nothing refers to it) instead of kept.

    Args:
        idle_max_bytes: Bound on the bytes of idle mappings kept (0: keep none).

    Attributes:
        idle_max_bytes: As the argument (read when a size class is added).
    """

    def __init__(self, idle_max_bytes: int = IDLE_MAX_BYTES) -> None:
        self.idle_max_bytes = idle_max_bytes
        self._per_size = IDLE_PER_SIZE
        # class bytes -> idle mappings of that class, the class used last at the end
        self._idle: collections.OrderedDict[int, list[mmap.mmap]] = collections.OrderedDict()
        self._lent: dict[int, tuple[Any, mmap.mmap]] = {}  # id(weakref) -> (it, mapping)
        self._lock = threading.Lock()
        _POOLS.add(self)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """An uninitialised contiguous tensor on a lent mapping.

        Args:
            shape: The tensor's shape.
            dtype: Its dtype.
            nbytes: Its bytes (the product of ``shape`` times the element size,
                computed by the caller, > 0).

        Returns:
            The tensor; the mapping comes back when nothing derived from it lives.
        """
        size = size_class(nbytes)
        mapping = self._take(size)
        as_numpy, same = _numpy_dtype(dtype)
        array = np.frombuffer(mapping, dtype=as_numpy, count=nbytes // dtype.itemsize)
        array = array.reshape(shape)
        ref = weakref.ref(array, self._returned)
        self._lent[id(ref)] = (ref, mapping)
        if same:
            return torch.from_numpy(array)
        return torch.from_numpy(array).view(dtype)  # an element of the same size

    def release_idle(self) -> int:
        """Drop every idle mapping and forget every size class (mappings lent now are
        dropped when they come back, until their class is used again); the bytes
        dropped. A mapping is unmapped once nothing refers to it."""
        with self._lock:
            classes = list(self._idle.items())
            self._idle.clear()
        return sum(size * len(idle) for size, idle in classes)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the mappings kept idle now."""
        with self._lock:
            return sum(size * len(idle) for size, idle in self._idle.items())

    @property
    def lent(self) -> int:
        """Mappings lent out now (their tensors, or something derived from them, live)."""
        return len(self._lent)

    def _take(self, size: int) -> mmap.mmap:
        """An idle mapping of class ``size`` or a new one; the class becomes the one
        used last (added now if new, evicting the classes used longest ago while
        the reserved room would pass the bound; a class whose own room is past the
        bound is not kept)."""
        evicted: list[list[mmap.mmap]] = []  # dropped outside the lock
        with self._lock:
            idle = self._idle.get(size)
            if idle is not None:
                self._idle.move_to_end(size)
                if idle:
                    return idle.pop()
            elif size * self._per_size <= self.idle_max_bytes:
                reserved = sum(self._idle) * self._per_size
                while reserved + size * self._per_size > self.idle_max_bytes:
                    old, old_idle = self._idle.popitem(last=False)
                    reserved -= old * self._per_size
                    evicted.append(old_idle)
                self._idle[size] = []
        evicted.clear()
        return _map(size)

    def _returned(self, ref: Any) -> None:
        """Weak-reference callback: the tensor lent ``ref``'s mapping is gone."""
        _, mapping = self._lent.pop(id(ref))
        if not self._lock.acquire(False):
            return  # another thread (or this one, collecting garbage) is in the pool
        try:
            idle = self._idle.get(len(mapping))
            if idle is not None and len(idle) < self._per_size:
                idle.append(mapping)
        finally:
            self._lock.release()

    def after_fork(self) -> None:
        """In a forked child (called for every pool): a fresh lock, since the
        parent's may have been held by a thread that does not exist here."""
        self._lock = threading.Lock()


#: Every pool of this process, for :func:`_after_fork_in_child`.
_POOLS: weakref.WeakSet[ResultPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child must not inherit a lock held by a thread it does not have."""
    for pool in list(_POOLS):
        pool.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
    got = _NUMPY_DTYPES.get(dtype)
    if got is None:
        try:
            got = (numpy_dtype(dtype), True)
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
    """Drop the idle mappings of :data:`RESULT_POOL`; the bytes dropped."""
    return RESULT_POOL.release_idle()
