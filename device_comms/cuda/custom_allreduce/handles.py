"""CUDA IPC handles: a fixed wire format, their exchange, and their bookkeeping.

* :class:`IpcHandle`: a ``cudaIpcMemHandle_t`` (64 bytes) naming an
  allocation, and the byte offset of a pointer inside it; 72 bytes on the
  wire (no pickle).
* :func:`all_gather_handles`: every rank's handles over a gloo group.
* :class:`IpcBackend`: how handles are made, opened (base and size of the
  mapped allocation) and closed; :class:`CudaIpcBackend` is the real one
  (CuPy and the driver API, imported lazily), tests pass fakes.
* :class:`HandleBook`: opens each peer allocation once, checks every pointer a
  peer names against that allocation, and closes each once.
* :func:`register_buffers`: exchange and register buffers, with a verdict
  every rank shares (what the custom all-reduce calls).

What a peer sends is checked before it is used:

* **Sizes.** Gloo aborts the receiving process (``gloo::EnforceNotMet``,
  SIGABRT, not catchable) when a message is longer than the buffer it posted,
  and silently keeps a partial buffer when it is shorter. So the rows of
  handles are never sized by what a peer sends: every rank first announces,
  in one all-gather of :data:`ANNOUNCE_WORDS` int64 words (a size fixed by
  this code), a marker, its handle count and the byte length of the very row
  it will send (computed from those bytes). Every rank checks every
  announcement (the marker, ``length == count * WIRE_BYTES``, equal counts)
  and, on any fault, every rank raises (:class:`~device_comms.errors.DecodeError`,
  :class:`~device_comms.errors.PeerRejectedError` or
  :class:`~device_comms.errors.CollectiveMismatch`, naming the rank) before
  the rows are exchanged. A rank whose own handles cannot be made
  (:meth:`IpcBackend.handle_of` raised) or encoded (a wrong type, a wire form
  of another length) is caught the same way: it announces a rejection in place
  of its count, raises its own error, and every peer raises
  :class:`~device_comms.errors.PeerRejectedError` naming it, at once rather
  than at the group's timeout.
* **Pointers.** :meth:`HandleBook.register` turns a peer's handle into a
  pointer only when ``offset + nbytes`` (the bytes the kernel uses through it)
  lies inside the allocation the driver mapped, the offset is aligned, the
  handle is not this rank's own, no two ranks name one allocation, and no rank
  names an allocation another rank exported; otherwise
  :class:`~device_comms.errors.DecodeError` names the peer and nothing of that
  buffer reaches a pointer table.

Limit: gloo has no framing this code controls. A peer that announces a
correct length and then sends a row of another length still aborts (longer)
or truncates (shorter) the receiver; the checks above stop every size a
conforming rank derives from its own data, and every value a peer announces,
from reaching gloo unchecked.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
import torch.distributed as dist

from device_comms.errors import (
    CollectiveMismatch,
    CommunicatorClosed,
    CommunicatorUnavailable,
    DecodeError,
    GroupCoordError,
    PeerRejectedError,
    add_note,
    translate_backend_error,
)

__all__ = [
    "HANDLE_BYTES",
    "WIRE_BYTES",
    "ANNOUNCE_WORDS",
    "IpcHandle",
    "all_gather_handles",
    "register_buffers",
    "IpcBackend",
    "CudaIpcBackend",
    "allocation_base",
    "allocation_range",
    "HandleBook",
]

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
WIRE_BYTES = HANDLE_BYTES + 8  # handle + little-endian uint64 offset
_U64_LIMIT = 1 << 64
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11  # CUpointer_attribute in cuda.h
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
#: Words of a rank's announcement before its row of handles: marker, count, row bytes.
ANNOUNCE_WORDS = 3
_MARK = 0x4950_4348_4E44_0000  # "IPCHND" in the high bytes: not what a stray message holds
_READY, _REJECTED, _REFUSED = _MARK | 1, _MARK | 2, _MARK | 3
# Why a rank rejected the exchange: the second word of its rejection.
_WHY_MAKE, _WHY_ENCODE = 1, 2
_WHY_TEXT = {
    _WHY_MAKE: "it could not make the IPC handle of one of its buffers; see its error",
    _WHY_ENCODE: "its handles could not be encoded",
}


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

        Any 64-bit offset parses; whether it lies inside the peer's allocation
        is for :meth:`HandleBook.register` to check, which knows the allocation.

        Raises:
            TypeError: ``data`` is not bytes-like.
            DecodeError: ``data`` is not exactly 72 bytes (a ``ValueError``).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes-like, got {type(data).__name__}")
        raw = bytes(data)
        if len(raw) != WIRE_BYTES:
            raise DecodeError(f"data must be {WIRE_BYTES} bytes (an IpcHandle), got {len(raw)}")
        return cls(raw[:HANDLE_BYTES], int.from_bytes(raw[HANDLE_BYTES:], "little"))


# ---------------------------------------------------------------------- exchange
def _check_handles(mine: Any) -> list[IpcHandle]:
    if isinstance(mine, (str, bytes)) or not isinstance(mine, Sequence):
        raise TypeError(f"mine must be a sequence of IpcHandle, got {type(mine).__name__}")
    for i, h in enumerate(mine):
        if not isinstance(h, IpcHandle):
            raise TypeError(f"mine[{i}] must be an IpcHandle, got {type(h).__name__}")
    return list(mine)


def _wire_row(handles: Sequence[IpcHandle]) -> bytes:
    """The bytes this rank sends: every handle's wire form, as produced (not assumed)."""
    parts = []
    for i, h in enumerate(handles):
        raw = h.to_bytes()
        if not isinstance(raw, bytes):
            raise TypeError(f"mine[{i}].to_bytes() must return bytes, got {type(raw).__name__}")
        parts.append(raw)
    return b"".join(parts)


def _gather(cpu_group: dist.ProcessGroup, t: torch.Tensor, where: str) -> list[torch.Tensor]:
    # Zero-filled: a shorter message than posted (gloo accepts one) leaves zeros, not old memory.
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(cpu_group))]
    try:
        dist.all_gather(out, t, group=cpu_group)
    except RuntimeError as e:
        err = translate_backend_error(e, where)
        if err is e:
            raise
        raise err from e
    return out


def all_gather_handles(
    cpu_group: dist.ProcessGroup, mine: Sequence[IpcHandle], what: str,
    *, group_name: str = "custom-allreduce",
) -> list[list[IpcHandle]]:
    """Gather every rank's handles (collective over ``cpu_group``).

    Two all-gathers: the announcements (:data:`ANNOUNCE_WORDS` int64 per
    rank), checked on every rank, then the rows of handles, whose size every
    rank derives from its own count once the announcements agree.

    Args:
        cpu_group: A gloo group over the ranks.
        mine: This rank's handles; every rank must pass as many.
        what: What the handles are, for error messages.
        group_name: The owning group's name, for error messages.

    Returns:
        ``result[r][i]``: the ``i``-th handle of group rank ``r``.

    Raises:
        TypeError: ``what`` is not a str, ``mine`` holds something other than
            handles, or a handle's wire form is not bytes (its peers raise
            :class:`PeerRejectedError` naming this rank).
        DecodeError: On every rank, when a rank announced a row whose length
            is not its count times :data:`WIRE_BYTES` (a handle with a wire
            form of another length), or an announcement is malformed.
        PeerRejectedError: A peer could not make or encode its handles.
        CollectiveMismatch: On every rank, when ranks pass different counts.
    """
    return _exchange_rows(cpu_group, lambda: mine, what, group_name)


def _exchange_rows(cpu_group: dist.ProcessGroup, make: Callable[[], Sequence[IpcHandle]],
                   what: str, group_name: str) -> list[list[IpcHandle]]:
    """:func:`all_gather_handles` with this rank's handles made by ``make`` inside
    the announced step: whatever ``make`` raises is announced as a rejection, so
    the peers raise at once instead of waiting for this rank's announcement."""
    where = f"group {group_name!r}: exchange of IPC handles ({what})"
    stage = _WHY_MAKE
    try:
        if not isinstance(what, str):
            raise TypeError(f"what must be a str, got {type(what).__name__}")
        made = make()
        stage = _WHY_ENCODE
        handles = _check_handles(made)
        row = _wire_row(handles)
    except Exception as e:  # a backend's error too: the peers are told, then it propagates
        if not isinstance(cpu_group, dist.ProcessGroup):
            raise  # no group to tell the peers through
        _tell_rejection(cpu_group, where, e, stage)
        raise
    announced = torch.tensor([_READY, len(handles), len(row)], dtype=torch.int64)
    table = [[int(w) for w in a] for a in _gather(cpu_group, announced, where)]
    count = _settle_announcements(table, dist.get_rank(cpu_group), where, group_name, what)
    if count == 0:
        return [[] for _ in table]
    rows = _gather(cpu_group, torch.frombuffer(bytearray(row), dtype=torch.uint8), where)
    return [_unpack(r.numpy().tobytes()) for r in rows]


def _tell_rejection(cpu_group: dist.ProcessGroup, where: str, error: BaseException,
                    why: int) -> None:
    """Announce a rejection, so the peers raise instead of waiting for this rank's row."""
    try:
        _gather(cpu_group, torch.tensor([_REJECTED, why, 0], dtype=torch.int64), where)
    except (GroupCoordError, RuntimeError) as e:
        add_note(error, f"the peers could not be told of this rejection ({e})")


def _settle_announcements(table: list[list[int]], me: int, where: str, group_name: str,
                          what: str) -> int:
    """The handle count every rank announced; raises the same verdict on every rank.

    Every rank sees the same table, so every rank reaches the same verdict
    (this rank's own announcement is checked like its peers').
    """
    side = f"rank {me}"
    for r, (mark, count, nbytes) in enumerate(table):
        if mark == _REJECTED:
            if r == me:
                continue  # raised its own error already
            why = _WHY_TEXT.get(count, "it gave up before the exchange")  # 2nd word: why
            raise PeerRejectedError(group_name, f"exchange of IPC handles ({what})", r, why)
        if mark != _READY:
            raise DecodeError(
                f"{where}: rank {r} sent a malformed announcement (marker {mark:#x}); it is not "
                f"in this exchange or not running this code; nothing was exchanged",
                queue=group_name, side=side, peers=(r,))
        if count < 0 or nbytes != count * WIRE_BYTES:
            raise DecodeError(
                f"{where}: rank {r} announced {count} handles in a row of {nbytes} bytes; "
                f"every handle is {WIRE_BYTES} bytes on the wire, so its row would not fit "
                f"the buffers the ranks post; refused on every rank before the rows were "
                f"exchanged", queue=group_name, side=side, peers=(r,))
    counts = [a[1] for a in table]
    if len(set(counts)) != 1:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise CollectiveMismatch(
            f"{where}: ranks disagree on the number of handles ({listed}); every rank "
            f"must register the same buffers in the same order", queue=group_name, side=side)
    return counts[0]


def _unpack(raw: bytes) -> list[IpcHandle]:
    return [IpcHandle.from_bytes(raw[i : i + WIRE_BYTES]) for i in range(0, len(raw), WIRE_BYTES)]


def register_buffers(
    cpu_group: dist.ProcessGroup, book: HandleBook, backend: IpcBackend,
    buffers: Sequence[tuple[int, int]], what: str, *, align: int = 1,
    group_name: str = "custom-allreduce",
) -> list[list[int]]:
    """Exchange the handles of this rank's ``buffers`` and register each (collective).

    After registering, the ranks agree on the outcome (one all-gather of
    :data:`ANNOUNCE_WORDS` words): when any rank refused a peer's handle, every
    rank raises, so no rank goes on to launch kernels that a peer will never join.

    Args:
        cpu_group: A gloo group over the ranks.
        book: This rank's book of opened peer allocations.
        backend: Makes this rank's handles.
        buffers: ``(pointer, nbytes)`` of each buffer of this rank, in the same
            order on every rank; ``nbytes`` is what the kernels use through each
            rank's pointer.
        what: What the buffers are, for error messages.
        align: Alignment each peer's offset must have.
        group_name: The owning group's name, for error messages.

    Returns:
        ``ptrs[i][r]``: rank ``r``'s ``i``-th buffer as seen from this process.

    Raises:
        DecodeError: This rank refused a peer's handle (:meth:`HandleBook.register`),
            or an announcement was malformed.
        CollectiveMismatch: Another rank refused a handle or failed to open one
            (the message names that rank and the peer it refused).
        PeerRejectedError: Another rank could not make or encode its handles
            (nothing was exchanged).
        Exception: What making this rank's handles (:meth:`IpcBackend.handle_of`)
            or opening a peer's handle raised here (the backend's error); the
            peers were told, and raise one of the errors above.
    """
    gathered = _exchange_rows(
        cpu_group, lambda: [backend.handle_of(ptr) for ptr, _ in buffers], what, group_name)
    ptrs: list[list[int]] = []
    failure: Exception | None = None
    try:
        for i, (ptr, nbytes) in enumerate(buffers):
            row = [gathered[r][i] for r in range(len(gathered))]
            ptrs.append(book.register(row, ptr, nbytes=nbytes, align=align))
    except Exception as e:  # a refused handle, or a failed open: the peers are told below
        failure = e
    _agree_on_registration(cpu_group, failure, what, group_name)
    return ptrs


def _agree_on_registration(cpu_group: dist.ProcessGroup, failure: Exception | None,
                           what: str, group_name: str) -> None:
    where = f"group {group_name!r}: registration of IPC handles ({what})"
    blamed = failure.peers if isinstance(failure, DecodeError) else ()
    culprit = next((p for p in blamed if isinstance(p, int)), -1)
    word = torch.tensor([_READY if failure is None else _REFUSED, culprit, 0], dtype=torch.int64)
    try:
        table = [[int(w) for w in a] for a in _gather(cpu_group, word, where)]
    except (GroupCoordError, RuntimeError) as e:
        if failure is None:
            raise
        add_note(failure, f"the peers could not be told of this failure ({e})")
        raise failure from None
    if failure is not None:
        raise failure
    me = dist.get_rank(cpu_group)
    for r, (mark, peer, _) in enumerate(table):
        if mark == _REFUSED:
            what_failed = (f"refused the IPC handle of rank {peer}" if peer >= 0
                           else "could not open a peer's IPC handle")
            raise CollectiveMismatch(
                f"{where}: rank {r} {what_failed} (see rank {r}'s error); every rank "
                f"abandons the registration", queue=group_name, side=f"rank {me}",
                peers=(r, peer) if peer >= 0 else (r,))
        if mark != _READY:
            raise DecodeError(
                f"{where}: rank {r} sent a malformed verdict (marker {mark:#x})",
                queue=group_name, side=f"rank {me}", peers=(r,))


# ---------------------------------------------------------------------- backends
@runtime_checkable
class IpcBackend(Protocol):
    """Makes, opens and closes IPC handles (CUDA IPC, or a fake in tests)."""

    def handle_of(self, ptr: int) -> IpcHandle:
        """The handle of the allocation holding device pointer ``ptr``, and ``ptr``'s offset."""
        ...

    def open(self, handle: bytes) -> tuple[int, int]:
        """Map a peer's allocation into this process.

        Returns:
            ``(base, size)``: the base pointer of the mapping here, and how many
            bytes from ``base`` on belong to it (as the driver reports them,
            not as the peer claims).
        """
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


def _pointer_attribute(ptr: int, attribute: int, name: str) -> int:
    """One 64-bit ``cuPointerGetAttribute`` answer about device pointer ``ptr``."""
    lib = _libcuda()
    value = ctypes.c_uint64()
    rc = lib.cuPointerGetAttribute(ctypes.byref(value), attribute, ctypes.c_uint64(ptr))
    if rc != 0:
        err = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(err))
        raise RuntimeError(
            f"cuPointerGetAttribute({name}, {ptr:#x}) failed with "
            f"{(err.value or b'CUDA error').decode()} ({rc}); is it a device pointer "
            f"of this process, allocated with cudaMalloc?"
        )
    return value.value


def allocation_base(ptr: int) -> int:
    """The base address of the device allocation that holds ``ptr`` (driver API).

    Raises:
        RuntimeError: The driver does not know ``ptr`` (the message has its error name).
        CommunicatorUnavailable: There is no CUDA driver.
    """
    return _pointer_attribute(ptr, _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, "RANGE_START_ADDR")


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation (or IPC mapping) that holds ``ptr``.

    Raises:
        RuntimeError: The driver does not know ``ptr`` (the message has its error name).
        CommunicatorUnavailable: There is no CUDA driver.
    """
    base = allocation_base(ptr)
    return base, _pointer_attribute(ptr, _CU_POINTER_ATTRIBUTE_RANGE_SIZE, "RANGE_SIZE")


class CudaIpcBackend:
    """CUDA IPC through CuPy's runtime bindings (imported on first use)."""

    def handle_of(self, ptr: int) -> IpcHandle:
        """See :meth:`IpcBackend.handle_of`."""
        import cupy

        base = allocation_base(ptr)
        return IpcHandle(bytes(cupy.cuda.runtime.ipcGetMemHandle(base)), ptr - base)

    def open(self, handle: bytes) -> tuple[int, int]:
        """See :meth:`IpcBackend.open` (peer access is enabled lazily; the size is
        the driver's range of the mapping)."""
        import cupy

        rt = cupy.cuda.runtime
        ptr = int(rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess))
        try:
            base, size = allocation_range(ptr)
        except BaseException:
            rt.ipcCloseMemHandle(ptr)
            raise
        # The bytes from ptr to the end of its mapping (none if the driver places ptr outside).
        return ptr, (base + size - ptr if base <= ptr < base + size else 0)

    def close(self, base_ptr: int) -> None:
        """See :meth:`IpcBackend.close`."""
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(base_ptr)


# ---------------------------------------------------------------------- book
class HandleBook:
    """Peer allocations opened by this process: each opened once, closed once.

    Every pointer it hands out was checked against the allocation the driver
    mapped (see :meth:`register`); a peer's handle that fails a check raises
    :class:`~device_comms.errors.DecodeError` naming the peer.

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
        self._opened: dict[bytes, tuple[int, int]] = {}  # handle -> (base, size) here
        self._owner: dict[bytes, int] = {}  # handle -> the rank that sent it first
        self._own: set[bytes] = set()  # this rank's own handles
        self._closed = False

    @property
    def open_count(self) -> int:
        """How many distinct peer allocations are open."""
        return len(self._opened)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def register(self, peer_handles: Sequence[IpcHandle], local_ptr: int, *,
                 nbytes: int = 1, align: int = 1) -> list[int]:
        """One pointer per rank for a buffer every rank registered.

        A peer's handle becomes a pointer only when its offset is a multiple of
        ``align`` and ``offset + nbytes`` lies inside the allocation the driver
        mapped, when it is not one of this rank's own handles, when no other
        rank of this call names the same allocation, and when no other rank
        sent that allocation before. Claims are checked before anything is
        opened; ranges after each open (the driver tells the size).

        Args:
            peer_handles: Each rank's handle of its buffer, indexed by group rank
                (one row of :func:`all_gather_handles`).
            local_ptr: This rank's own pointer (its own handle is not opened).
            nbytes: Bytes the kernels use from each peer's pointer (at least 1).
            align: Alignment, in bytes, each peer's offset must have (the
                kernels' loads need it; at least 1).

        Returns:
            ``ptrs[r]``: rank ``r``'s buffer as seen from this process.

        Raises:
            DecodeError: A peer's handle failed a check (the message names it);
                what this call opened stays in the book until :meth:`close`.
            CommunicatorClosed: After :meth:`close`.
        """
        if self._closed:
            raise CommunicatorClosed("this HandleBook was closed; it cannot open handles again")
        handles = _check_peer_handles(peer_handles, self._rank)
        if isinstance(local_ptr, bool) or not isinstance(local_ptr, int):
            raise TypeError(f"local_ptr must be an int, got {type(local_ptr).__name__}")
        if local_ptr <= 0:
            raise ValueError(f"local_ptr must be a positive device address, got {local_ptr}")
        nbytes, align = _positive(nbytes, "nbytes"), _positive(align, "align")
        self._own.add(handles[self._rank].handle)
        self._check_claims(handles)
        ptrs = []
        for r, h in enumerate(handles):
            if r == self._rank:
                ptrs.append(local_ptr)
                continue
            base, size = self._open(h.handle, r)
            _check_range(r, h, size, nbytes, align, self._rank)
            ptrs.append(base + h.offset)
        return ptrs

    def _check_claims(self, handles: list[IpcHandle]) -> None:
        """Refuse handles no honest peer sends: this rank's own, one allocation named
        by two ranks, an allocation another rank sent before."""
        first: dict[bytes, int] = {}
        for r, h in enumerate(handles):
            if r == self._rank:
                continue
            if h.handle in self._own:
                raise DecodeError(
                    f"rank {r} sent an IPC handle of an allocation of this rank "
                    f"({self._rank}); a peer's buffer must be its own allocation",
                    side=f"rank {self._rank}", peers=(r,))
            other = first.setdefault(h.handle, r)
            if other != r:
                raise DecodeError(
                    f"ranks {other} and {r} sent the IPC handle of one allocation for one "
                    f"buffer; every rank's buffer must be an allocation of its own",
                    side=f"rank {self._rank}", peers=(other, r))
            owner = self._owner.get(h.handle, r)
            if owner != r:
                raise DecodeError(
                    f"rank {r} sent the IPC handle of an allocation that rank {owner} sent "
                    f"before; a rank can only share allocations of its own",
                    side=f"rank {self._rank}", peers=(r, owner))

    def _open(self, handle: bytes, rank: int) -> tuple[int, int]:
        opened = self._opened.get(handle)
        if opened is None:
            got = self._backend.open(handle)
            if (not isinstance(got, tuple) or len(got) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in got)):
                raise TypeError(
                    f"{type(self._backend).__name__}.open must return (base, size) ints, got "
                    f"{got!r:.80}")
            opened = self._opened[handle] = got
            self._owner[handle] = rank
        return opened

    def close(self) -> None:
        """Close every opened allocation exactly once (idempotent).

        Every one is attempted; the first failure is raised afterwards.
        """
        if self._closed:
            return
        self._closed = True
        opened, self._opened = self._opened, {}
        first: BaseException | None = None
        for base, _ in opened.values():
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


def _check_range(rank: int, h: IpcHandle, size: int, nbytes: int, align: int, me: int) -> None:
    """``[offset, offset + nbytes)`` of rank ``rank``'s handle lies in its mapped ``size``."""
    if h.offset % align:
        raise DecodeError(
            f"rank {rank} sent an IPC handle with offset {h.offset:#x}, not a multiple of "
            f"{align} bytes as the kernels' loads need", side=f"rank {me}", peers=(rank,))
    if h.offset + nbytes > size:
        raise DecodeError(
            f"rank {rank} sent an IPC handle with offset {h.offset:#x}; with the {nbytes} "
            f"bytes this buffer uses it ends at {h.offset + nbytes:#x}, past the end of its "
            f"allocation ({size:#x} bytes as mapped here); refused before it reached a "
            f"pointer table", side=f"rank {me}", peers=(rank,))


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


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
