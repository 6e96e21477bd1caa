"""Stand-ins for the CUDA driver in the handle and agreement tests (no GPU here).

The fakes play the driver's part only: which base address and how many
bytes an opened handle maps, which handle a pointer has (or that making one
fails), how many devices a process sees and whether two of them have peer
access, and the device memory of the tables and fault words. What is checked
against those answers (the exchange, the book's offset and claim checks, the
agreement of every rank on one verdict) is the real code under test.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np

from device_comms.cuda.custom_allreduce import communicator, eligibility
from device_comms.cuda.custom_allreduce.handles import HANDLE_BYTES, IpcHandle

#: Size of every allocation a fake driver maps, unless told otherwise (16 MiB).
ALLOCATION_BYTES = 16 << 20


def fake_handles(rank: int, count: int) -> list[IpcHandle]:
    """``count`` handles of ``rank``: random bytes (seeded by rank) and distinct offsets."""
    rng = random.Random(1000 + rank)
    return [IpcHandle(rng.randbytes(HANDLE_BYTES), 256 * i + rank) for i in range(count)]


class FakeIpcBackend:
    """Maps handle bytes to fake base addresses and records every open and close.

    Args:
        fail_open: A handle whose opening fails.
        fail_close: A base whose closing fails.
        sizes: Bytes mapped per handle (default :data:`ALLOCATION_BYTES`), as
            the driver would report them.
        rank: Makes :meth:`handle_of` name allocations of this rank (distinct
            from other ranks' for the same pointer).
    """

    def __init__(self, fail_open: bytes | None = None, fail_close: int | None = None,
                 sizes: dict[bytes, int] | None = None, rank: int = 0,
                 fail_handle_of: int | None = None) -> None:
        self.bases: dict[bytes, int] = {}
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.fail_open, self.fail_close = fail_open, fail_close
        self.fail_handle_of = fail_handle_of
        self.sizes = dict(sizes or {})
        self.rank = rank
        self.offsets: dict[int, int] = {}  # ptr -> the offset handle_of reports (default 0)

    def handle_of(self, ptr: int) -> IpcHandle:
        if ptr == self.fail_handle_of:  # as cudaIpcGetMemHandle on an expandable segment
            raise RuntimeError("cudaIpcGetMemHandle failed: invalid argument (fake)")
        raw = ptr.to_bytes(HANDLE_BYTES - 8, "little") + self.rank.to_bytes(8, "little")
        return IpcHandle(raw, self.offsets.get(ptr, 0))

    def open(self, handle: bytes) -> tuple[int, int]:
        if handle == self.fail_open:
            raise RuntimeError("cudaIpcOpenMemHandle failed (fake)")
        self.opened.append(handle)
        base = self.bases.setdefault(handle, 0x7F00_0000_0000 + 0x1000_0000 * len(self.bases))
        return base, self.sizes.get(handle, ALLOCATION_BYTES)

    def close(self, base_ptr: int) -> None:
        self.closed.append(base_ptr)
        if base_ptr == self.fail_close:
            raise RuntimeError("cudaIpcCloseMemHandle failed (fake)")


class FakeCudaRuntimeError(RuntimeError):
    """What a CUDA binding raises (not of this project's error family)."""


def fake_peer_probe(device_count: int, broken: bool = False) -> Callable[[int, int], bool]:
    """``deviceCanAccessPeer`` of a process that sees ``device_count`` devices, all
    with peer access: raises for an index it does not see, or always when ``broken``."""
    def can_access_peer(a: int, b: int) -> bool:
        if broken or not (0 <= a < device_count and 0 <= b < device_count):
            raise FakeCudaRuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal ({a}, {b})")
        return True
    return can_access_peer


@contextlib.contextmanager
def fake_driver(device_count: int, probe: Callable[[int, int], bool] | None = None,
                not_ready: str = "") -> Iterator[None]:
    """The custom all-reduce's view of the devices, in this process, for the block:
    ``device_count`` devices, ``probe`` (default :func:`fake_peer_probe`) for
    peer access, and the kernels ready to run (``not_ready``: why they are not,
    as a GPU that is too old or a failed compile would say). The process-wide
    verdict cache is emptied before and after."""
    probe = probe or fake_peer_probe(device_count)
    eligibility.P2P_CACHE.clear()
    try:
        with mock.patch.object(communicator, "_device_count", lambda: device_count), \
                mock.patch.object(communicator, "_can_access_peer", probe), \
                mock.patch.object(communicator, "_kernels_ready", lambda index: not_ready):
            yield
    finally:
        eligibility.P2P_CACHE.clear()


class HostTables:
    """The table entries, kept on the host (the device memory of ``RankTables``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 1
        self.entries: dict[int, Any] = {}

    def ptr(self, index: int) -> int:
        return 0x6000_0000 + 64 * index

    def reserve(self) -> int:
        self.used += 1
        return self.used - 1

    def fill(self, index: int, sig: Sequence[int], data: Sequence[int],
             tmp: Sequence[int]) -> None:
        self.entries[index] = (list(sig), list(data), list(tmp))

    def fill_many(self, entries: Sequence[tuple[int, np.ndarray]]) -> None:
        self.entries.update(entries)

    def close(self) -> None:
        self.entries.clear()


class HostFaultWords:
    """Kernel fault words that no kernel ever sets (the host-mapped words, faked)."""

    def read(self, i: int = 0) -> int:
        return 0

    def clear(self) -> None:
        pass

    def close(self) -> None:
        pass
