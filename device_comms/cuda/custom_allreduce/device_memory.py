"""Raw CUDA memory for the custom all-reduce, through CuPy's runtime bindings.

* :class:`DeviceBuffer`: one ``cudaMalloc`` allocation of its own (so an IPC
  handle of its pointer names exactly it), freed by :meth:`DeviceBuffer.close`.
* :class:`KernelFaultWords`: page-locked host words mapped into the device; a
  kernel that gives up waiting stores a code there, and the host reads it
  without synchronising a stream.
* :func:`decode_error`: what such a code says.

CuPy is imported inside the functions, never at module load.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

__all__ = ["DeviceBuffer", "KernelFaultWords", "decode_error", "PHASE_NAMES"]

PHASE_NAMES = ("start", "mid", "end")
_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped
_H2D = 1  # cudaMemcpyHostToDevice


def _runtime() -> Any:
    import cupy

    return cupy.cuda.runtime


class DeviceBuffer:
    """A device allocation of ``nbytes`` on ``device_index``, zero-filled.

    Args:
        nbytes: Size in bytes.
        device_index: CUDA device ordinal.
    """

    def __init__(self, nbytes: int, device_index: int) -> None:
        import cupy

        self.nbytes = nbytes
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self.ptr: int = _runtime().malloc(nbytes)
            _runtime().memset(self.ptr, 0, nbytes)
        self._closed = False

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` torch view of ``[offset, offset + nbytes)`` (no copy, not owning)."""
        import cupy

        mem = cupy.cuda.UnownedMemory(self.ptr + offset, nbytes, self, self.device_index)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=torch.device("cuda", self.device_index))

    def upload(self, offset: int, data: np.ndarray) -> None:
        """Copy host ``data`` to ``offset`` synchronously (never during a capture)."""
        import cupy

        data = np.ascontiguousarray(data)
        with cupy.cuda.Device(self.device_index):
            _runtime().memcpy(self.ptr + offset, data.ctypes.data, data.nbytes, _H2D)

    def close(self) -> None:
        """Free the allocation (idempotent). Synchronises the device first."""
        if self._closed:
            return
        self._closed = True
        import cupy

        with cupy.cuda.Device(self.device_index):
            _runtime().deviceSynchronize()
            _runtime().free(self.ptr)


class KernelFaultWords:
    """``count`` 32-bit words of mapped, page-locked host memory, zeroed.

    Attributes:
        host_ptr: Address the host reads.
        device_ptr: Address kernels write (word ``i`` at ``device_ptr + 4 * i``).
    """

    def __init__(self, count: int) -> None:
        rt = _runtime()
        self.count = count
        self.host_ptr: int = rt.hostAlloc(4 * count, _HOST_ALLOC_MAPPED)
        ctypes.memset(self.host_ptr, 0, 4 * count)
        # Unified addressing (every 64-bit CUDA platform): a mapped page-locked
        # allocation has the same address on the host and on every device.
        self.device_ptr: int = self.host_ptr
        self._closed = False

    def read(self, i: int = 0) -> int:
        """The current value of word ``i`` (no synchronisation)."""
        return ctypes.c_uint32.from_address(self.host_ptr + 4 * i).value

    def clear(self) -> None:
        """Zero every word."""
        ctypes.memset(self.host_ptr, 0, 4 * self.count)

    def close(self) -> None:
        """Free the host memory (idempotent)."""
        if not self._closed:
            self._closed = True
            _runtime().freeHost(self.host_ptr)


def decode_error(code: int) -> tuple[str, int, int]:
    """``(phase, rank that did not arrive, rank that reported)`` of a kernel's error code."""
    phase = (code >> 16) & 0xFF
    name = PHASE_NAMES[phase] if phase < len(PHASE_NAMES) else f"phase {phase}"
    return name, (code >> 8) & 0xFF, code & 0xFF
