"""MessageQueue: one writer, many readers, microseconds per message.

Readers on the writer's node read a shared-memory ring
(:class:`~shm_broadcast.ring_buffer.ShmRingBuffer`); readers on other nodes
get the same messages over zmq PUB/SUB on TCP; messages too large for a chunk
reach local readers over zmq too. Objects are encoded with msgspec, tensors
and arrays travel as raw bytes (:mod:`shm_broadcast.codec`).

Typical use::

    # writer process
    mq = MessageQueue(n_reader=2, n_local_reader=2, local_reader_ranks=[1, 2])
    send_to_readers(mq.export_handle())          # any channel; it is small
    mq.wait_until_ready()
    mq.enqueue({"step": 1, "ids": torch.arange(8)})

    # reader process (rank 1)
    mq = MessageQueue.create_from_handle(handle, rank=1)
    mq.wait_until_ready()
    obj = mq.dequeue(timeout=10)

or, collectively over a process group, ``MessageQueue.create_from_process_group``.

Waiting never hangs silently: timeouts raise
:class:`~shm_broadcast.errors.QueueTimeout` naming the queue, side and
lagging peers; without a timeout a dead peer raises
:class:`~shm_broadcast.errors.PeerDiedError` within about
``WaitPolicy.liveness_s + park_poll_s`` (0.3 s by default); :meth:`shutdown`
wakes blocked callers with :class:`~shm_broadcast.errors.QueueClosedError`.

Threading: a queue object belongs to the thread that uses it; only
:meth:`shutdown` may be called from another thread (the blocked call notices
within ``park_poll_s``). Do not use a queue in a process forked after its
creation.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from shm_broadcast.checks import check_int, check_timeout
from shm_broadcast.codec import Codec
from shm_broadcast.errors import QueueRoleError
from shm_broadcast.handle import Handle
from shm_broadcast.local_reader import LocalReader
from shm_broadcast.queue_writer import QueueWriter
from shm_broadcast.remote_reader import RemoteReader
from shm_broadcast.waiting import WaitPolicy

__all__ = ["MessageQueue", "Handle", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS",
           "DEFAULT_READY_TIMEOUT"]

DEFAULT_MAX_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_CHUNKS = 8
DEFAULT_READY_TIMEOUT = 120.0


def _check_timeout(timeout: Any) -> float | None:
    return check_timeout(timeout)


def _check_count(name: str, value: Any, minimum: int) -> None:
    check_int(value, name, minimum=minimum)


class MessageQueue:
    """A one-writer, many-reader broadcast queue.

    Args:
        n_reader: Number of readers in total (>= 0).
        n_local_reader: How many of them run on this node (served through
            shared memory); the rest connect over TCP.
        local_reader_ranks: The ranks the local readers will pass to
            :meth:`create_from_handle`, in any order; default
            ``range(n_local_reader)``.
        max_chunk_bytes: Size of one ring chunk. Messages (msgpack + arrays +
            32 bytes of header) larger than this go over zmq instead.
        max_chunks: Chunks in the ring: how far the writer may run ahead of
            the slowest local reader.
        connect_ip: IP address to bind the TCP endpoints on (only used with
            remote readers); default ``$GROUPCOORD_HOST_IP`` or the address of
            the default route.
        name: Name used in errors (default ``mq-<pid>``).
        wait_policy: Spin/yield/park timing (:class:`WaitPolicy`).
        allow_pickle: Opt in to pickle for values msgspec cannot carry exactly
            (see :mod:`shm_broadcast.codec`). Off by default: such values raise
            ``TypeError`` in :meth:`enqueue`. Readers must opt in too
            (:meth:`create_from_handle`); only between trusted processes.
        exact_types: Preserve tuples/sets/dataclasses exactly (default); False
            trades that for speed on huge lists (msgspec's lossy mapping).
        writer_rank: This process's rank, for error messages.

    Raises:
        ValueError: An argument is out of range.
        ShmSpaceError: ``/dev/shm`` cannot hold the ring.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
        *,
        name: str | None = None,
        wait_policy: WaitPolicy | None = None,
        allow_pickle: bool = False,
        exact_types: bool = True,
        writer_rank: int | None = None,
    ) -> None:
        _check_count("n_reader", n_reader, 0)
        _check_count("n_local_reader", n_local_reader, 0)
        if n_local_reader > n_reader:
            raise ValueError(
                f"n_local_reader must be <= n_reader ({n_reader}), got {n_local_reader}")
        if local_reader_ranks is None:
            ranks = tuple(range(n_local_reader))
        else:
            ranks = tuple(local_reader_ranks)
            if len(ranks) != n_local_reader or len(set(ranks)) != len(ranks) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
            ):
                raise ValueError(
                    f"local_reader_ranks must be {n_local_reader} distinct ints >= 0, "
                    f"got {local_reader_ranks!r}")
        _check_count("max_chunk_bytes", max_chunk_bytes, 128)
        _check_count("max_chunks", max_chunks, 1)
        if connect_ip is not None and (not isinstance(connect_ip, str) or not connect_ip):
            raise ValueError(f"connect_ip must be None or an IP address string, got {connect_ip!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        policy = _policy(wait_policy)
        self._impl: QueueWriter | LocalReader | RemoteReader = QueueWriter(
            name=name or f"mq-{os.getpid()}",
            n_reader=n_reader,
            local_reader_ranks=ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            policy=policy,
            codec=Codec(allow_pickle=allow_pickle, exact=exact_types),
            writer_rank=writer_rank,
        )
        self._init_common(True, writer_rank)

    def _init_common(self, is_writer: bool, rank: int | None) -> None:
        self._is_writer = is_writer
        self._rank = rank
        self._busy = 0
        self._close_lock = threading.Lock()

    @classmethod
    def create_from_handle(
        cls,
        handle: Handle,
        rank: int,
        *,
        wait_policy: WaitPolicy | None = None,
        allow_pickle: bool = False,
    ) -> "MessageQueue":
        """Connect a reader to the writer described by ``handle``.

        Args:
            handle: From the writer's :meth:`export_handle` (or its bytes form).
            rank: This reader's rank. Ranks in ``handle.local_reader_ranks``
                read through shared memory; any other rank is a remote reader.
            wait_policy: Spin/yield/park timing of this reader.
            allow_pickle: Unpickle values the writer sent through pickle (which
                runs code the writer chose). Off by default: a pickled value
                raises :class:`~shm_broadcast.errors.DecodeError` in
                :meth:`dequeue` and is never unpickled.

        Raises:
            TypeError: ``handle`` is not a :class:`Handle`.
            ValueError: ``rank`` is invalid.
            SegmentError: The ring is gone (writer exited) or the slot is taken.
        """
        if isinstance(handle, (bytes, bytearray, memoryview)):
            handle = Handle.from_bytes(bytes(handle))
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a shm_broadcast.Handle, got {type(handle).__name__}")
        _check_count("rank", rank, 0)
        policy = _policy(wait_policy)
        codec = Codec(allow_pickle=allow_pickle)
        self = cls.__new__(cls)
        if rank in handle.local_reader_ranks:
            index = handle.local_reader_ranks.index(rank)
            self._impl = LocalReader(handle, index, rank, policy, codec)
        else:
            self._impl = RemoteReader(handle, rank, policy, codec)
        self._init_common(False, rank)
        return self

    @classmethod
    def create_from_process_group(
        cls,
        group: Any,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        writer_rank: int = 0,
        reader_ranks: list[int] | None = None,
        *,
        name: str | None = None,
        connect_ip: str | None = None,
        wait_policy: WaitPolicy | None = None,
        timeout: float | None = DEFAULT_READY_TIMEOUT,
        allow_pickle: bool = False,
    ) -> "MessageQueue | None":
        """Build a connected queue collectively over ``group``.

        Every rank of ``group`` must call it. See
        :func:`shm_broadcast.process_group.create_from_process_group`.

        Returns:
            The writer's queue on ``writer_rank``, a reader's queue on each of
            ``reader_ranks`` (default: every other rank), ``None`` elsewhere.
        """
        from shm_broadcast.process_group import create_from_process_group

        return create_from_process_group(
            group, max_chunk_bytes, max_chunks, writer_rank, reader_ranks, name=name,
            connect_ip=connect_ip, wait_policy=wait_policy, timeout=timeout,
            allow_pickle=allow_pickle)

    # ---------------------------------------------------------- properties
    @property
    def is_writer(self) -> bool:
        """Whether this object is the writer side."""
        return self._is_writer

    @property
    def rank(self) -> int | None:
        """The rank given at creation (writer: ``writer_rank``)."""
        return self._rank

    @property
    def transport(self) -> str:
        """``"writer"``, ``"shm"`` (a reader on the writer's node, through the
        ring) or ``"tcp"`` (a reader on another node, through zmq)."""
        if self._is_writer:
            return "writer"
        return "tcp" if isinstance(self._impl, RemoteReader) else "shm"

    @property
    def name(self) -> str:
        """The queue's name."""
        return self._impl.name

    def park_stats(self) -> dict[str, int]:
        """Counters of this side's doorbell parks (diagnostics, cheap to keep).

        Returns:
            ``{"parks": n, "timeouts": m}``: how often this side slept on its
            doorbell, and how many of those sleeps ended by the
            ``park_poll_s`` bound instead of a ring. While the peer is busy, a
            timeout means a wake-up was missed (or the peer stalled that long).
        """
        return dict(self._impl.park_stats)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._impl.closed

    # ------------------------------------------------------------ writer API
    def export_handle(self) -> Handle:
        """Return the :class:`Handle` readers connect with (writer only)."""
        if not self._is_writer:
            raise QueueRoleError(f"queue {self.name!r}: export_handle() is for the writer; "
                                 f"this is reader rank {self._rank}")
        return self._impl.handle

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader (writer only).

        Blocks while the ring is full (the slowest local reader is
        ``max_chunks`` messages behind) or a remote reader is a window behind.
        Tensors are copied before this returns; the caller may reuse them.

        Args:
            obj: Any value (see :mod:`shm_broadcast.codec` for the encoding).
            timeout: Seconds to wait for room; ``None`` waits as long as the
                readers live.

        Raises:
            QueueTimeout: No room within ``timeout``; names lagging readers.
            PeerDiedError: A reader the writer waits for has died.
            QueueClosedError: The queue was shut down or a reader closed it.
            TypeError: ``obj`` holds a value that cannot be sent.
        """
        if not self._is_writer:
            raise QueueRoleError(f"queue {self.name!r}: enqueue() is for the writer; "
                                 f"this is reader rank {self._rank}")
        if timeout is not None:
            timeout = _check_timeout(timeout)
        self._busy += 1
        try:
            self._impl.enqueue(obj, timeout)
        finally:
            self._busy -= 1

    # ------------------------------------------------------------ reader API
    def dequeue(self, timeout: float | None = None) -> Any:
        """Receive the next message (readers only).

        Args:
            timeout: Seconds to wait; ``0`` returns a waiting message or raises
                at once (non-blocking poll); ``None`` waits as long as the
                writer lives.

        Raises:
            QueueTimeout: Nothing arrived within ``timeout``.
            PeerDiedError: The writer died and every message it sent was read.
            DecodeError: The message is malformed, or holds a pickled value
                while this side has ``allow_pickle`` off.
            QueueClosedError: The writer shut the queue down (after every
                earlier message was read) or this side was shut down.
        """
        if self._is_writer:
            raise QueueRoleError(f"queue {self.name!r}: dequeue() is for readers; "
                                 "this is the writer")
        if timeout is not None:
            timeout = _check_timeout(timeout)
        self._busy += 1
        try:
            return self._impl.dequeue(timeout)
        finally:
            self._busy -= 1

    def poll(self) -> bool:
        """Whether :meth:`dequeue` has a message ready now (readers only)."""
        if self._is_writer:
            raise QueueRoleError(f"queue {self.name!r}: poll() is for readers")
        return self._impl.poll()

    def broadcast_object(self, obj: Any = None, timeout: float | None = None) -> Any:
        """Writer: enqueue ``obj`` and return it. Reader: return the next message."""
        if self._is_writer:
            self.enqueue(obj, timeout)
            return obj
        return self.dequeue(timeout)

    # -------------------------------------------------------------- lifecycle
    def wait_until_ready(self, timeout: float | None = DEFAULT_READY_TIMEOUT) -> None:
        """Block until every reader is connected, so no message can be lost.

        Call it on every side after creation (the writer waits for all its
        readers, each reader for the writer's go).

        Raises:
            QueueTimeout: Not everyone connected in time (names who is missing).
            PeerDiedError: A peer died meanwhile.
        """
        timeout = _check_timeout(timeout)
        self._busy += 1
        try:
            self._impl.wait_until_ready(timeout)
        finally:
            self._busy -= 1

    def shutdown(self) -> None:
        """Wake blocked callers with QueueClosedError; safe from any thread.

        On the writer, readers first drain the messages already sent, then
        get QueueClosedError. On a reader, the writer gets QueueClosedError if
        it has to wait for this reader.
        """
        self._impl.shutdown()

    def close(self) -> None:
        """Shut down, close sockets and release (writer: unlink) the segment.

        Idempotent. If another thread is inside a call, it is shut down first
        and given up to 2 s to leave.
        """
        with self._close_lock:
            if self._impl.closed:
                return
            if self._busy:
                self._impl.shutdown()
                end = time.monotonic() + 2.0
                while self._busy and time.monotonic() < end:
                    time.sleep(0.005)
            self._impl.close()

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a MessageQueue cannot be pickled; send its export_handle() instead")

    def __repr__(self) -> str:
        side = "writer" if self._is_writer else f"reader rank {self._rank}"
        state = "closed" if self.closed else "open"
        return f"MessageQueue({self.name!r}, {side}, {state})"


def _policy(wait_policy: WaitPolicy | None) -> WaitPolicy:
    if wait_policy is None:
        return WaitPolicy()
    if not isinstance(wait_policy, WaitPolicy):
        raise TypeError(f"wait_policy must be a WaitPolicy, got {type(wait_policy).__name__}")
    return wait_policy
