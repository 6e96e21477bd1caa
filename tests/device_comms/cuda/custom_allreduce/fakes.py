"""Stand-ins for the CUDA driver in the handle tests (no GPU here).

The fakes play the driver's part only: which base address and how many
bytes an opened handle maps. What is checked against those answers (the
exchange, the book's offset and claim checks) is the real code under test.
"""

from __future__ import annotations

import random

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
                 sizes: dict[bytes, int] | None = None, rank: int = 0) -> None:
        self.bases: dict[bytes, int] = {}
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.fail_open, self.fail_close = fail_open, fail_close
        self.sizes = dict(sizes or {})
        self.rank = rank
        self.offsets: dict[int, int] = {}  # ptr -> the offset handle_of reports (default 0)

    def handle_of(self, ptr: int) -> IpcHandle:
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
