"""Device-resident ``RankTable`` entries: which pointers each kernel reads.

Entry 0 names every rank's staging area (eager calls). A call captured in a
CUDA graph gets an entry of its own whose address is baked into the captured
launch; the entry is filled once the capture is over and the peers' pointers
of that input are known (:meth:`RankTables.fill`). A kernel replayed from the
graph then reads the registered inputs directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from device_comms.cuda.custom_allreduce import layout
from device_comms.cuda.custom_allreduce.device_memory import DeviceBuffer
from device_comms.errors import CommunicatorUnavailable

__all__ = ["RankTables"]


class RankTables:
    """Up to ``capacity`` table entries in one device allocation.

    Args:
        device_index: CUDA device ordinal.
        capacity: Number of entries (entry 0 included).
    """

    def __init__(self, device_index: int, capacity: int) -> None:
        self.capacity = capacity
        self._buf = DeviceBuffer(capacity * layout.TABLE_ENTRY_BYTES, device_index)
        self._used = 1  # entry 0 is reserved for the staging areas

    def ptr(self, index: int) -> int:
        """Device address of entry ``index``."""
        return self._buf.ptr + index * layout.TABLE_ENTRY_BYTES

    def reserve(self) -> int:
        """A fresh entry's index (filled later; safe during a capture: no CUDA call).

        Raises:
            CommunicatorUnavailable: Every entry is taken.
        """
        if self._used >= self.capacity:
            raise CommunicatorUnavailable(
                f"the custom all-reduce has registered {self.capacity - 1} graph inputs, its "
                f"limit; create it with a larger max_graph_inputs or capture fewer all-reduces"
            )
        self._used += 1
        return self._used - 1

    @property
    def used(self) -> int:
        """Entries in use, entry 0 included."""
        return self._used

    def fill(
        self, index: int, sig: Sequence[int], data: Sequence[int], tmp: Sequence[int]
    ) -> None:
        """Write entry ``index`` (synchronous; never call it during a capture)."""
        self._buf.upload(index * layout.TABLE_ENTRY_BYTES, layout.table_entry(sig, data, tmp))

    def fill_many(self, entries: Sequence[tuple[int, np.ndarray]]) -> None:
        """Write several ``(index, 24 x uint64)`` entries."""
        for index, entry in entries:
            self._buf.upload(index * layout.TABLE_ENTRY_BYTES, entry)

    def close(self) -> None:
        """Free the entries (idempotent)."""
        self._buf.close()
