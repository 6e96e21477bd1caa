"""CUDA IPC handles: a fixed wire format, their exchange, and their bookkeeping.

* :class:`IpcHandle`: a ``cudaIpcMemHandle_t`` (64 bytes) naming an
  allocation, and the byte offset of a pointer inside it; 72 bytes on the
  wire (no pickle).
* :func:`all_gather_handles`: every rank's handles over a gloo group.
* :class:`IpcBackend`: how handles are made, opened and closed;
  :class:`CudaIpcBackend` is the real one (CuPy and the driver API, imported
  lazily), tests pass fakes.
* :class:`HandleBook`: opens each peer allocation once and closes each once.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
import torch.distributed as dist

from device_comms.errors import (
    CollectiveMismatch,
    CommunicatorClosed,
    CommunicatorUnavailable,
    translate_backend_error,
)

__all__ = [
    "HANDLE_BYTES",
    "WIRE_BYTES",
    "IpcHandle",
    "all_gather_handles",
    "IpcBackend",
    "CudaIpcBackend",
    "allocation_base",
    "HandleBook",
]

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
WIRE_BYTES = HANDLE_BYTES + 8  # handle + little-endian uint64 offset
_U64_LIMIT = 1 << 64
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11  # CUpointer_attribute in cuda.h


class IpcHandle(msgspec.Struct, frozen=True):
    """An IPC handle of an allocation and a pointer's offset inside it.

    Attributes:
        handle: The 64 bytes of the ``cudaIpcMemHandle_t`` of the allocation.
        offset: Byte offset of the pointer from the allocation's base.
    """

    handle: bytes
    offset: int

    def __post_init__(self) -> None:
        if not isinstance(self.handle, bytes):
            raise TypeError(f"handle must be bytes, got {type(self.handle).__name__}")
        if len(self.handle) != HANDLE_BYTES:
            raise ValueError(
                f"handle must be {HANDLE_BYTES} bytes (a cudaIpcMemHandle_t), "
                f"got {len(self.handle)}"
            )
        if isinstance(self.offset, bool) or not isinstance(self.offset, int):
            raise TypeError(f"offset must be an int, got {type(self.offset).__name__}")
        if not 0 <= self.offset < _U64_LIMIT:
            raise ValueError(f"offset must be in [0, 2**64), got {self.offset}")

    def to_bytes(self) -> bytes:
        """The 72-byte wire form: the handle, then the offset as a little-endian uint64."""
        return self.handle + self.offset.to_bytes(8, "little")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> IpcHandle:
        """Parse the wire form written by :meth:`to_bytes`.

        Raises:
            TypeError: ``data`` is not bytes-like.
            ValueError: ``data`` is not exactly 72 bytes.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes-like, got {type(data).__name__}")
        raw = bytes(data)
        if len(raw) != WIRE_BYTES:
            raise ValueError(f"data must be {WIRE_BYTES} bytes (an IpcHandle), got {len(raw)}")
        return cls(raw[:HANDLE_BYTES], int.from_bytes(raw[HANDLE_BYTES:], "little"))


# ---------------------------------------------------------------------- exchange
def _check_handles(mine: Any) -> list[IpcHandle]:
    if isinstance(mine, (str, bytes)) or not isinstance(mine, Sequence):
        raise TypeError(f"mine must be a sequence of IpcHandle, got {type(mine).__name__}")
    for i, h in enumerate(mine):
        if not isinstance(h, IpcHandle):
            raise TypeError(f"mine[{i}] must be an IpcHandle, got {type(h).__name__}")
    return list(mine)


def _gather(cpu_group: dist.ProcessGroup, t: torch.Tensor, where: str) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(cpu_group))]
    try:
        dist.all_gather(out, t, group=cpu_group)
    except RuntimeError as e:
        err = translate_backend_error(e, where)
        if err is e:
            raise
        raise err from e
    return out


def all_gather_handles(
    cpu_group: dist.ProcessGroup, mine: Sequence[IpcHandle], what: str
) -> list[list[IpcHandle]]:
    """Gather every rank's handles (collective over ``cpu_group``).

    Args:
        cpu_group: A gloo group over the ranks.
        mine: This rank's handles; every rank must pass as many.
        what: What the handles are, for error messages.

    Returns:
        ``result[r][i]``: the ``i``-th handle of group rank ``r``.

    Raises:
        CollectiveMismatch: On every rank, when ranks pass different counts.
    """
    handles = _check_handles(mine)
    if not isinstance(what, str):
        raise TypeError(f"what must be a str, got {type(what).__name__}")
    where = f"exchange of IPC handles ({what})"
    count = torch.tensor([len(handles)], dtype=torch.int64)
    counts = [int(c) for c in _gather(cpu_group, count, where)]
    if len(set(counts)) != 1:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise CollectiveMismatch(
            f"{where}: ranks disagree on the number of handles ({listed}); every rank "
            f"must register the same buffers in the same order"
        )
    if counts[0] == 0:
        return [[] for _ in counts]
    blob = bytearray(b"".join(h.to_bytes() for h in handles))
    rows = _gather(cpu_group, torch.frombuffer(blob, dtype=torch.uint8), where)
    return [_unpack(row.numpy().tobytes()) for row in rows]


def _unpack(raw: bytes) -> list[IpcHandle]:
    return [IpcHandle.from_bytes(raw[i : i + WIRE_BYTES]) for i in range(0, len(raw), WIRE_BYTES)]


# ---------------------------------------------------------------------- backends
@runtime_checkable
class IpcBackend(Protocol):
    """Makes, opens and closes IPC handles (CUDA IPC, or a fake in tests)."""

    def handle_of(self, ptr: int) -> IpcHandle:
        """The handle of the allocation holding device pointer ``ptr``, and ``ptr``'s offset."""
        ...

    def open(self, handle: bytes) -> int:
        """Map a peer's allocation into this process; returns its base pointer here."""
        ...

    def close(self, base_ptr: int) -> None:
        """Unmap an allocation returned by :meth:`open`."""
        ...


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CommunicatorUnavailable(
            f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}"
        ) from e
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuPointerGetAttribute.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def allocation_base(ptr: int) -> int:
    """The base address of the device allocation that holds ``ptr`` (driver API).

    Raises:
        RuntimeError: The driver does not know ``ptr`` (the message has its error name).
        CommunicatorUnavailable: There is no CUDA driver.
    """
    lib = _libcuda()
    base = ctypes.c_uint64()
    rc = lib.cuPointerGetAttribute(
        ctypes.byref(base), _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ctypes.c_uint64(ptr)
    )
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(
            f"cuPointerGetAttribute(RANGE_START_ADDR, {ptr:#x}) failed with "
            f"{(name.value or b'CUDA error').decode()} ({rc}); is it a device pointer "
            f"of this process, allocated with cudaMalloc?"
        )
    return base.value


class CudaIpcBackend:
    """CUDA IPC through CuPy's runtime bindings (imported on first use)."""

    def handle_of(self, ptr: int) -> IpcHandle:
        """See :meth:`IpcBackend.handle_of`."""
        import cupy

        base = allocation_base(ptr)
        return IpcHandle(bytes(cupy.cuda.runtime.ipcGetMemHandle(base)), ptr - base)

    def open(self, handle: bytes) -> int:
        """See :meth:`IpcBackend.open` (peer access is enabled lazily)."""
        import cupy

        rt = cupy.cuda.runtime
        return int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))

    def close(self, base_ptr: int) -> None:
        """See :meth:`IpcBackend.close`."""
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(base_ptr)


# ---------------------------------------------------------------------- book
class HandleBook:
    """Peer allocations opened by this process: each opened once, closed once.

    Args:
        backend: Opens and closes handles.
        self_rank: This process's rank within the group (its index in the
            handle lists passed to :meth:`register`).
    """

    def __init__(self, backend: IpcBackend, self_rank: int) -> None:
        if not isinstance(backend, IpcBackend):
            raise TypeError(
                f"backend must implement IpcBackend (handle_of, open, close), "
                f"got {type(backend).__name__}"
            )
        if isinstance(self_rank, bool) or not isinstance(self_rank, int):
            raise TypeError(f"self_rank must be an int, got {type(self_rank).__name__}")
        if self_rank < 0:
            raise ValueError(f"self_rank must be >= 0, got {self_rank}")
        self._backend, self._rank = backend, self_rank
        self._opened: dict[bytes, int] = {}
        self._closed = False

    @property
    def open_count(self) -> int:
        """How many distinct peer allocations are open."""
        return len(self._opened)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def register(self, peer_handles: Sequence[IpcHandle], local_ptr: int) -> list[int]:
        """One pointer per rank for a buffer every rank registered.

        Args:
            peer_handles: Each rank's handle of its buffer, indexed by group rank
                (one row of :func:`all_gather_handles`).
            local_ptr: This rank's own pointer (its own handle is not opened).

        Returns:
            ``ptrs[r]``: rank ``r``'s buffer as seen from this process.

        Raises:
            CommunicatorClosed: After :meth:`close`.
        """
        if self._closed:
            raise CommunicatorClosed("this HandleBook was closed; it cannot open handles again")
        handles = _check_peer_handles(peer_handles, self._rank)
        if isinstance(local_ptr, bool) or not isinstance(local_ptr, int):
            raise TypeError(f"local_ptr must be an int, got {type(local_ptr).__name__}")
        if local_ptr <= 0:
            raise ValueError(f"local_ptr must be a positive device address, got {local_ptr}")
        return [
            local_ptr if r == self._rank else self._base(h.handle) + h.offset
            for r, h in enumerate(handles)
        ]

    def _base(self, handle: bytes) -> int:
        base = self._opened.get(handle)
        if base is None:
            base = self._opened[handle] = int(self._backend.open(handle))
        return base

    def close(self) -> None:
        """Close every opened allocation exactly once (idempotent).

        Every one is attempted; the first failure is raised afterwards.
        """
        if self._closed:
            return
        self._closed = True
        opened, self._opened = self._opened, {}
        first: BaseException | None = None
        for base in opened.values():
            try:
                self._backend.close(base)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> HandleBook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.open_count} open"
        return f"HandleBook(rank {self._rank}, {state})"


def _check_peer_handles(peer_handles: Any, rank: int) -> list[IpcHandle]:
    if isinstance(peer_handles, (str, bytes)) or not isinstance(peer_handles, Sequence):
        raise TypeError(
            f"peer_handles must be a sequence of IpcHandle, got {type(peer_handles).__name__}"
        )
    for i, h in enumerate(peer_handles):
        if not isinstance(h, IpcHandle):
            raise TypeError(f"peer_handles[{i}] must be an IpcHandle, got {type(h).__name__}")
    if rank >= len(peer_handles):
        raise ValueError(
            f"peer_handles must have one handle per rank, including this rank {rank}; "
            f"got {len(peer_handles)}"
        )
    return list(peer_handles)
