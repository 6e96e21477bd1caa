"""ShmRingBuffer: a shared-memory ring of fixed-size chunks with per-chunk flags.

One writer and ``n_reader`` readers on the same node share one segment
(:class:`~shm_broadcast.lifecycle.segment.SharedSegment`, kind ``"mq"``)::

    +------------------+---------------+-------------------+-------------+------------------+
    | header (64 B)    | reader table  | chunk flags       | refusals    | chunk data       |
    | magic, geometry, | pid u64 x n   | per chunk:        | per reader: | max_chunks x     |
    | writer pid,      | ctime f64 x n |  W u8, R_0..R_n-1 |  1 KiB slot |  max_chunk_bytes |
    | ready, shutdown, | state u8 x n  |  (8-byte stride)  |             |  (64-byte        |
    | writer_parked    | parked u8 x n |                   |             |   aligned)       |
    +------------------+---------------+-------------------+-------------+------------------+

Message ``k`` goes to chunk ``k % max_chunks``; writer and readers each keep
their own counter, so the flags alone say whose turn it is.

State machine of one chunk (W = written flag, R_i = read flag of reader i)::

                     writer: all R_i == 1 (or W == 0 at start)
        +----------+  -> W := 0                        +-----------+
        |   FREE   | ----------------------------------> |  WRITING  |
        | W=1,R=1..| (initially W=0, R=0..: also FREE)   |  W=0      |
        +----------+                                     +-----------+
             ^                                                 | writer: copy payload,
             | last reader:                                    | then R_i := 0 (all i),
             | R_i := 1                                        | then W := 1
             |                                                 v
        +-----------+   reader i: R_i == 0 and W == 1    +-----------+
        | PARTIALLY | <--------------------------------  | PUBLISHED |
        |   READ    |   copy out, then R_i := 1 (or 2)   | W=1, R=0..|
        +-----------+  -------- (each reader once) ----> +-----------+

Verdicts. A reader marks a message it *refused* with ``R_i := 2``
(:data:`REFUSED`) instead of 1, after writing its reason into its refusal
slot (:meth:`ShmRingBuffer.write_refusal`; one slot per reader, outside the
chunks, so a refusal never touches a payload other readers still read). A
writer that waits for the chunk to be FREE and then loads ``R_i`` before the
slot (load/load, as for the payload) sees the reason whole: the confirmed
sends of :meth:`shm_broadcast.queue.message_queue.MessageQueue.enqueue_confirmed`.
One slot per reader suffices: a confirmed writer reads the reasons of
message ``k`` before it publishes ``k + 1``, and a reader has finished every
earlier message before it judges ``k``, so no other refusal of that reader
can be written meanwhile. FREE means every ``R_i`` is non-zero, whichever
verdict it holds.

* The writer only touches a chunk's payload in WRITING, which it enters only
  when every reader has set its R_i (or the chunk was never written).
* Reader i only touches the payload while ``R_i == 0 and W == 1``; it reads
  ``R_i`` *first*, then ``W``. Reading ``R_i == 0`` means the writer's
  ``R_i := 0`` of this round is visible, hence also its earlier ``W := 0``; a
  following ``W == 1`` can then only be this round's publish, never the stale
  ``W`` of the previous round (reading ``W`` first would allow exactly that).

Memory ordering. Every flag is one byte written with a single store *after*
the payload (``memoryview`` item assignment, one ``MOV`` byte store), and read
with a single load *before* the payload. CPython executes each such access in
a separate C call, so the compiler cannot reorder them; the CPU can:

* x86-64 (TSO): stores become visible in program order and loads are not
  reordered with older loads, nor stores with older loads. So "payload, then
  flag" (store/store), "flag, then payload" (load/load) and "payload read,
  then R_i := 1" (load/store) are all ordered by the hardware; no fence is
  needed on the data path (:meth:`release_fence`/:meth:`acquire_fence` are
  no-ops there).
* Weaker models (ARM64, POWER): those reorderings are allowed, so both fences
  become a full barrier (:meth:`full_fence`).
* The one pattern TSO does *not* order is store -> load, which is what the
  park/doorbell handshake needs (a Dekker pattern): a reader stores
  ``parked := 1`` then loads ``W``; the writer stores ``W := 1`` then loads
  ``parked``. Without a barrier both loads can see the old values (each store
  still in its core's store buffer): the reader sleeps, the writer rings no
  bell -- a lost wakeup. Both sides therefore call :meth:`full_fence` between
  their store and their load, on every architecture. :meth:`full_fence` is an
  uncontended ``threading.Lock`` acquire + release; CPython implements it with
  an atomic read-modify-write (a ``LOCK``-prefixed instruction on x86, which
  drains the store buffer, i.e. a full barrier; on ARM64 glibc's semaphores use
  acquire/release atomics). Belt and braces: a parked side never blocks longer
  than ``WaitPolicy.park_poll_s`` before re-reading the flags, so even a lost
  wakeup costs at most that, never a hang.

The same handshake runs in reverse when the ring is full: the writer sets
``writer_parked``, fences, re-checks the chunk, and sleeps; a reader sets its
``R_i``, fences, and pokes the writer if ``writer_parked`` is set.

Who clears a parked flag. The side that rings also clears the flag, just
before its ``sendto`` (:meth:`take_parked_readers`, :meth:`take_writer_parked`);
the sleeper clears its own flag again when it wakes. Ringing is the costly
part (a ``sendto`` that wakes an idle CPU runs the wake-up in the ringer's
time), and a sleeper takes a kernel wake-up and a scheduling delay to run
again, so without this the writer's early bell (before encoding) and its bell
after publishing would both ring one sleeper that is still on its way back. A plain load + store is
enough, no atomic exchange: the ringer's ``parked := 0`` can only overwrite a
*newer* ``parked := 1`` of the sleeper if that newer store came between the
ringer's load and its store; the sleeper's park starts by draining its
doorbell, then stores 1, so the ringer's ``sendto`` -- issued after its store
-- lands in the doorbell after that drain and wakes the newer park. The worst
case is one spurious wake-up, never a lost one.

Diagnostics. Two reads outside the protocol serve only the queue's warnings
and statistics (:mod:`shm_broadcast.queue.laggards`); neither stores
anything, so the protocol above holds unchanged. The writer counts each
reader's unread chunks from the flags (:meth:`ShmRingBuffer.unread_counts`),
loads of bytes the readers store concurrently: a reader that reads
meanwhile may be counted short of what it has read by then, as any reading
of a moving reader is. A reader waiting long
for message ``k`` reads the writer's header and publish stamp in the chunk
of message ``k - 1``, which it has released: the stamp first, then the
header's message number, and it trusts the stamp only if that number is
still ``k - 1``. The writer stores a chunk's header before its stamp, so on
x86-64 (stores seen in order, loads not reordered) a stamp of a newer
message comes with a newer header and is discarded; on weaker models a
message published during those two loads can slip through, which makes a
warning's age wrong, never a message.
"""

from __future__ import annotations

import ctypes
import platform
import struct
import threading

from shm_broadcast.checks import check_int
from shm_broadcast.errors import SegmentError
from shm_broadcast.lifecycle.segment import SharedSegment

__all__ = ["ShmRingBuffer", "CHUNK_HEADER", "READER_EMPTY", "READER_ATTACHED", "READER_CLOSED",
           "TAKEN", "REFUSED"]

_MAGIC = b"GCMQRB02"
_HDR = struct.Struct("<8sIIQQd")  # magic, n_reader, max_chunks, chunk_bytes, writer pid, ctime
_OFF_READY = 48
_OFF_SHUTDOWN = 49
_OFF_WRITER_PARKED = 50
_HEADER_BYTES = 64
_ALIGN = 64
#: Bytes reserved at the start of each chunk for the message header.
CHUNK_HEADER = 32

#: ``R_i`` values once reader ``i`` is done with a message: taken, or refused
#: (its reason in reader ``i``'s refusal slot).
TAKEN, REFUSED = 1, 2
#: Bytes of one reader's refusal slot (a u32 length, then UTF-8).
_REFUSAL_SLOT = 1024
_U32 = struct.Struct("<I")

READER_EMPTY = 0
READER_ATTACHED = 1
READER_CLOSED = 2

_STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _noop() -> None:
    return None


class _Geometry:
    """Byte offsets of every region, computed from the three sizes."""

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int) -> None:
        self.n_reader = n_reader
        self.max_chunks = max_chunks
        self.chunk_bytes = max_chunk_bytes
        self.pid_off = _HEADER_BYTES
        self.ctime_off = self.pid_off + 8 * n_reader
        self.state_off = self.ctime_off + 8 * n_reader
        self.parked_off = self.state_off + n_reader
        self.flags_off = _align(self.parked_off + n_reader, _ALIGN)
        self.flag_stride = _align(1 + n_reader, 8)
        self.refusals_off = _align(self.flags_off + self.flag_stride * max_chunks, _ALIGN)
        self.data_off = _align(self.refusals_off + _REFUSAL_SLOT * n_reader, _ALIGN)
        self.data_stride = _align(max_chunk_bytes, _ALIGN)
        self.total = self.data_off + self.data_stride * max_chunks


class ShmRingBuffer:
    """The shared ring: geometry, flags and the protocol operations on them.

    Create with :meth:`create` (the writer, which owns and unlinks the
    segment) or :meth:`attach` (a reader). Not thread-safe; one object per
    process side.

    Attributes:
        name: Segment name (in ``/dev/shm``).
        n_reader: Number of readers served through the ring.
        max_chunks: Number of chunks.
        max_chunk_bytes: Bytes per chunk, including :data:`CHUNK_HEADER`.
        buf: ``memoryview`` of the whole segment.
        base_addr: Address of the mapping in this process (for ``memmove``).
    """

    def __init__(self, segment: SharedSegment, geometry: _Geometry) -> None:
        self._seg = segment
        self._g = geometry
        self.name = segment.name
        self.n_reader = geometry.n_reader
        self.max_chunks = geometry.max_chunks
        self.max_chunk_bytes = geometry.chunk_bytes
        self.buf: memoryview = segment.buf
        # The address only; no ctypes object is kept, so no buffer export
        # blocks SharedSegment.close().
        self.base_addr: int = ctypes.addressof(ctypes.c_char.from_buffer(segment.buf))
        #: Offset of each chunk's ``W`` byte (its ``R_i`` bytes follow) and of
        #: its data: computed once, shared by these methods and the hot paths
        #: that inline a flag access (via :meth:`flag_offsets`, :meth:`data_offset`).
        self._w_at = [geometry.flags_off + c * geometry.flag_stride
                      for c in range(geometry.max_chunks)]
        self._data_at = [geometry.data_off + c * geometry.data_stride
                         for c in range(geometry.max_chunks)]
        self._ones = b"\x01" * geometry.n_reader
        self._zeros = b"\x00" * geometry.n_reader
        self._fence_lock = threading.Lock()
        strong = _STRONGLY_ORDERED
        #: True where the CPU orders the data path by itself (x86-64, TSO):
        #: the release/acquire fences are no-ops and hot paths may skip them.
        self.strongly_ordered: bool = strong
        self.release_fence = _noop if strong else self.full_fence
        self.acquire_fence = _noop if strong else self.full_fence

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, n_reader: int, max_chunk_bytes: int, max_chunks: int) -> ShmRingBuffer:
        """Create the segment (owned by this process) and initialise the header.

        Args:
            n_reader: Readers served through shared memory (>= 1).
            max_chunk_bytes: Bytes per chunk (> :data:`CHUNK_HEADER`).
            max_chunks: Number of chunks (>= 1).

        Raises:
            ValueError: A size is out of range.
            ShmSpaceError: ``/dev/shm`` is too small.
        """
        n_reader = check_int(n_reader, "n_reader", minimum=1)
        max_chunk_bytes = check_int(max_chunk_bytes, "max_chunk_bytes", minimum=CHUNK_HEADER + 64)
        max_chunks = check_int(max_chunks, "max_chunks", minimum=1)
        g = _Geometry(n_reader, max_chunk_bytes, max_chunks)
        seg = SharedSegment.create("mq", g.total)
        _HDR.pack_into(seg.buf, 0, _MAGIC, n_reader, max_chunks, max_chunk_bytes, 0, 0.0)
        return cls(seg, g)

    @classmethod
    def attach(cls, name: str) -> ShmRingBuffer:
        """Map an existing ring created by a writer.

        Raises:
            SegmentError: The segment is gone or is not a ring of this version.
        """
        seg = SharedSegment.attach(name)
        try:
            magic, n, chunks, chunk_bytes, _pid, _ct = _HDR.unpack_from(seg.buf, 0)
            if magic != _MAGIC:
                raise SegmentError(f"segment {name!r} is not a message-queue ring (bad magic)")
            g = _Geometry(n, chunk_bytes, chunks)
            if g.total > seg.size:
                raise SegmentError(f"segment {name!r} is smaller than its header claims")
        except BaseException:
            seg.close()
            raise
        return cls(seg, g)

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Idempotent."""
        self._seg.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._seg.closed

    # ------------------------------------------------- raw flag offsets
    # For hot paths that inline the flag accesses (a woken reader runs with
    # cold caches, where every Python call costs microseconds): the byte
    # offsets in :attr:`buf` behind is_readable/mark_read/the parked flags.
    def flag_offsets(self, chunk: int, reader: int) -> tuple[int, int]:
        """Offsets of chunk ``chunk``'s ``W`` byte and of its ``R_reader`` byte."""
        off = self._w_at[chunk]
        return off, off + 1 + reader

    def reader_parked_offset(self, reader: int) -> int:
        """Offset of ``reader``'s parked byte (1 = sleeping on its doorbell)."""
        return self._g.parked_off + reader

    def parked_span(self) -> tuple[int, int]:
        """``(start, stop)`` of the readers' parked bytes in :attr:`buf`.

        ``buf[start:stop] != bytes(n_reader)`` means some reader is parked;
        take a fresh slice each time (a kept slice would pin the mapping).
        """
        g = self._g
        return g.parked_off, g.parked_off + g.n_reader

    #: Offset of the writer's parked byte (see :meth:`take_writer_parked`).
    writer_parked_offset: int = _OFF_WRITER_PARKED

    # --------------------------------------------------------------- fences
    def full_fence(self) -> None:
        """Full memory barrier (store->load included); see the module docstring."""
        lock = self._fence_lock
        lock.acquire()
        lock.release()

    # -------------------------------------------------------------- offsets
    def data_offset(self, chunk: int) -> int:
        """Offset in :attr:`buf` of chunk ``chunk``'s first byte."""
        return self._data_at[chunk]

    # ------------------------------------------------------- writer protocol
    def is_free(self, chunk: int) -> bool:
        """Whether the writer may overwrite ``chunk`` (FREE state)."""
        off = self._w_at[chunk]
        buf = self.buf
        flags = buf[off + 1 : off + 1 + self.n_reader]
        return flags == self._ones or buf[off] == 0 or 0 not in flags

    def lagging_readers(self, chunk: int) -> list[int]:
        """Readers that have not yet read ``chunk`` (their ``R_i`` is 0)."""
        off = self._w_at[chunk]
        if self.buf[off] == 0:
            return []
        return [r for r in range(self.n_reader) if self.buf[off + 1 + r] == 0]

    def unread_counts(self) -> list[int]:
        """For each reader, how many published messages it has not read yet.

        For the writer, between its writes (no chunk is WRITING then): every
        published chunk (``W == 1``) holds one of the last ``max_chunks``
        messages and a reader reads in order, so reader ``i``'s published
        chunks with ``R_i == 0`` number exactly the messages written minus
        those it has read. Plain loads of flags the readers may be setting
        meanwhile: each count is right for the moment its flags were loaded
        (see "Diagnostics" in the module docstring).
        """
        buf = self.buf
        n = self.n_reader
        counts = [0] * n
        for off in self._w_at:
            if buf[off] == 1:
                for r, flag in enumerate(buf[off + 1 : off + 1 + n]):
                    if flag == 0:
                        counts[r] += 1
        return counts

    def begin_write(self, chunk: int) -> None:
        """FREE -> WRITING: clear ``W`` before touching the payload."""
        self.buf[self._w_at[chunk]] = 0

    def publish(self, chunk: int) -> None:
        """WRITING -> PUBLISHED: clear every ``R_i``, then set ``W``."""
        off = self._w_at[chunk]
        self.release_fence()
        self.buf[off + 1 : off + 1 + self.n_reader] = self._zeros
        self.buf[off] = 1

    def take_parked_readers(self) -> list[int]:
        """Clear the parked flags that are set and return those readers' indices.

        The caller must ring every returned reader's doorbell *after* this call:
        see "Who clears a parked flag" in the module docstring for why a plain
        load + store (no atomic exchange) cannot lose a wake-up.
        """
        g = self._g
        buf = self.buf
        base = g.parked_off
        if buf[base : base + g.n_reader] == self._zeros:
            return []
        taken = [r for r in range(g.n_reader) if buf[base + r]]
        for r in taken:
            buf[base + r] = 0
        return taken

    # ------------------------------------------------------- reader protocol
    def is_readable(self, chunk: int, reader: int) -> bool:
        """Whether ``chunk`` is PUBLISHED and unread by ``reader`` (R first, then W)."""
        off = self._w_at[chunk]
        buf = self.buf
        return buf[off + 1 + reader] == 0 and buf[off] == 1

    def mark_read(self, chunk: int, reader: int) -> None:
        """Set ``R_reader`` after the payload has been copied out."""
        self.release_fence()
        self.buf[self._w_at[chunk] + 1 + reader] = 1

    # -------------------------------------------------------------- verdicts
    def write_refusal(self, reader: int, reason: str) -> None:
        """Put ``reason`` (cut to the slot) in ``reader``'s refusal slot, before it
        sets ``R_reader := REFUSED`` on the chunk it holds PUBLISHED and unread."""
        off = self._g.refusals_off + reader * _REFUSAL_SLOT
        text = reason.encode("utf-8", "replace")[: _REFUSAL_SLOT - _U32.size]
        _U32.pack_into(self.buf, off, len(text))
        self.buf[off + _U32.size : off + _U32.size + len(text)] = text

    def verdicts(self, chunk: int) -> list[str | None]:
        """Each reader's verdict on a FREE chunk the writer published: None where it
        took the message, its reason where it refused it."""
        flags = bytes(self.buf[self._w_at[chunk] + 1 : self._w_at[chunk] + 1 + self.n_reader])
        self.acquire_fence()  # R_i loads before the slots' (no-op on x86)
        out: list[str | None] = []
        for r, flag in enumerate(flags):
            if flag != REFUSED:
                out.append(None)
                continue
            off = self._g.refusals_off + r * _REFUSAL_SLOT
            (n,) = _U32.unpack_from(self.buf, off)
            n = min(n, _REFUSAL_SLOT - _U32.size)
            out.append(bytes(self.buf[off + _U32.size : off + _U32.size + n])
                       .decode("utf-8", "replace"))
        return out

    # ------------------------------------------------------- shared header
    def set_writer(self, pid: int, create_time: float) -> None:
        """Record the writer's identity in the header."""
        struct.pack_into("<Qd", self.buf, 24, pid, create_time)

    def writer_identity(self) -> tuple[int, float]:
        """Return the writer's ``(pid, create_time)`` from the header."""
        pid, ct = struct.unpack_from("<Qd", self.buf, 24)
        return int(pid), float(ct)

    def set_ready(self) -> None:
        """Mark the queue connected (every reader attached)."""
        self.buf[_OFF_READY] = 1

    def is_ready(self) -> bool:
        """Whether the writer marked the queue connected."""
        return self.buf[_OFF_READY] == 1

    def set_shutdown(self) -> None:
        """Tell every reader that no message will follow those already published."""
        self.buf[_OFF_SHUTDOWN] = 1

    def is_shutdown(self) -> bool:
        """Whether the writer shut the queue down."""
        return self.buf[_OFF_SHUTDOWN] == 1

    def set_writer_parked(self, parked: bool) -> None:
        """Declare (or clear) that the writer sleeps waiting for a free chunk."""
        self.buf[_OFF_WRITER_PARKED] = 1 if parked else 0

    def take_writer_parked(self) -> bool:
        """Clear the writer's parked flag if set; returns whether it was (then ring it)."""
        buf = self.buf
        if buf[_OFF_WRITER_PARKED] != 1:
            return False
        buf[_OFF_WRITER_PARKED] = 0
        return True

    def set_reader_parked(self, reader: int, parked: bool) -> None:
        """Declare (or clear) that ``reader`` sleeps on its doorbell."""
        self.buf[self._g.parked_off + reader] = 1 if parked else 0

    def register_reader(self, reader: int, pid: int, create_time: float) -> None:
        """Record a reader's identity, then mark it attached.

        Raises:
            ValueError: ``reader`` is out of range.
            SegmentError: Another process already registered as this reader.
        """
        g = self._g
        if not 0 <= reader < g.n_reader:
            raise ValueError(f"reader index must be in [0, {g.n_reader}), got {reader}")
        if self.buf[g.state_off + reader] != READER_EMPTY:
            other = self.reader_identity(reader)[0]
            raise SegmentError(
                f"reader slot {reader} of ring {self.name!r} is already taken by pid {other}"
            )
        struct.pack_into("<Q", self.buf, g.pid_off + 8 * reader, pid)
        struct.pack_into("<d", self.buf, g.ctime_off + 8 * reader, create_time)
        self.release_fence()
        self.buf[g.state_off + reader] = READER_ATTACHED

    def set_reader_state(self, reader: int, state: int) -> None:
        """Set a reader's state byte (:data:`READER_CLOSED` on close)."""
        self.buf[self._g.state_off + reader] = state

    def reader_state(self, reader: int) -> int:
        """Return :data:`READER_EMPTY`, :data:`READER_ATTACHED` or :data:`READER_CLOSED`."""
        return self.buf[self._g.state_off + reader]

    def reader_identity(self, reader: int) -> tuple[int, float]:
        """Return the registered ``(pid, create_time)`` of ``reader``."""
        g = self._g
        (pid,) = struct.unpack_from("<Q", self.buf, g.pid_off + 8 * reader)
        (ct,) = struct.unpack_from("<d", self.buf, g.ctime_off + 8 * reader)
        return int(pid), float(ct)

    def __repr__(self) -> str:
        return (
            f"ShmRingBuffer({self.name!r}, n_reader={self.n_reader}, "
            f"max_chunks={self.max_chunks}, max_chunk_bytes={self.max_chunk_bytes})"
        )

