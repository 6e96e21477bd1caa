"""MessageQueue: one writer, many readers, microseconds per message.

Readers on the writer's node read a shared-memory ring
(:class:`~shm_broadcast.queue.ring_buffer.ShmRingBuffer`); readers on other nodes
get the same messages over zmq PUB/SUB on TCP; messages too large for a chunk
reach local readers over zmq too. Objects are encoded with msgspec, tensors
and arrays travel as raw bytes (:mod:`shm_broadcast.codec.message_codec`).

Typical use::

    # writer process
    mq = MessageQueue(n_reader=2, n_local_reader=2, local_reader_ranks=[1, 2])
    send_to_readers(mq.export_handle())          # any channel; it is small
    # (of several readers on other nodes, each gets its own: mq.export_handle(rank=r))
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
A paused peer (``SIGSTOP``, a debugger, swapping) is not a dead one: it is
waited for, up to the timeout (see :mod:`shm_broadcast.waiting.policy`). A call
without a ``timeout`` uses :attr:`MessageQueue.default_timeout`, which a
``GroupCoordinator`` sets to its group's timeout on the queues it creates.
A wait that lasts longer than ``warn_interval`` (10 s unless
``$GROUPCOORD_MQ_WARN_INTERVAL`` or the argument says otherwise) is logged
on the ``shm_broadcast.queue`` logger, naming who holds it up: the writer
names each reader behind with its outstanding messages, a reader names the
writer and how long ago its last message arrived
(:mod:`shm_broadcast.queue.laggards`); :meth:`MessageQueue.lag_stats` gives
the writer's per-reader lag at any time.

Threading: a queue object belongs to the thread that uses it; only
:meth:`shutdown` may be called from another thread (the blocked call notices
within ``park_poll_s``). Do not use a queue in a process forked after its
creation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from shm_broadcast.checks import check_bool, check_int, check_timeout
from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.errors import ConcurrentCallError, QueueRoleError
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.local_reader import LocalReader
from shm_broadcast.queue.options import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    DEFAULT_READY_TIMEOUT,
    check_ring_options,
    check_wait_policy,
    check_warn_interval,
)
from shm_broadcast.queue.process_group import create_from_process_group
from shm_broadcast.queue.remote_reader import RemoteReader
from shm_broadcast.queue.transport import MAX_RANK
from shm_broadcast.queue.writer import QueueWriter
from shm_broadcast.waiting.policy import WaitPolicy

__all__ = ["MessageQueue", "Handle", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS",
           "DEFAULT_READY_TIMEOUT", "check_ring_options"]



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
            remote readers); default :func:`shm_broadcast.ranks.host_address.host_ip`
            (``$GROUPCOORD_HOST_IP``, else the source address of the route to
            ``$MASTER_ADDR``, else of the default route).
        name: Name used in errors (default ``mq-<pid>``).
        wait_policy: Spin/yield/park timing (:class:`WaitPolicy`).
        allow_pickle: Opt in to pickle for values msgspec cannot carry exactly
            (see :mod:`shm_broadcast.codec.message_codec`). Off by default: such values raise
            ``TypeError`` in :meth:`enqueue`. Readers must opt in too
            (:meth:`create_from_handle`); only between trusted processes.
        exact_types: Preserve tuples/sets/dataclasses exactly (default); False
            trades that for speed on huge lists (msgspec's lossy mapping).
        writer_rank: This process's rank, for error messages.
        remote_reader_keys: ``{rank: Z85 CURVE public key}`` of every remote
            reader, each generated by that reader; the TCP endpoints then admit
            exactly those keys (:meth:`create_from_process_group` does this).
            Without it, a queue with one remote reader makes one client
            keypair, carried by :meth:`export_handle`'s handle (every other
            holder is a local reader, i.e. this user); with more, the writer
            makes a keypair for each remote rank, handed out only in that
            rank's handle (:meth:`export_handle` with ``rank``), and the
            handle every reader gets carries no secret. Either way each
            remote reader's key admits that reader alone.
        shared_reader_key: Opt in to one client keypair shared by several
            remote readers, carried by :meth:`export_handle`'s handle (for a
            caller that hands one handle to all its readers): that handle is
            then a credential of every remote reader, and the writer can tell
            its remote readers' frames apart only by connection. Excludes
            ``remote_reader_keys``.
        warn_interval: Seconds a wait for room lasts before the writer logs
            which readers are behind (slot, rank, messages outstanding), and
            between such warnings; a positive finite number. Default:
            ``$GROUPCOORD_MQ_WARN_INTERVAL``, else 10 s.
        enable_shm_tensor_arena: vLLM's option to move tensors through shared
            memory instead of pickling them; taken (a bool) for vLLM's call
            form and changes nothing, since local readers always get a
            message's tensors from the ring's shared memory.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range (or
            ``$GROUPCOORD_MQ_WARN_INTERVAL`` is not a positive number).
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
        remote_reader_keys: dict[int, bytes] | None = None,
        shared_reader_key: bool = False,
        warn_interval: float | None = None,
        enable_shm_tensor_arena: bool = False,
    ) -> None:
        n_reader = check_int(n_reader, "n_reader", minimum=0)
        check_bool(enable_shm_tensor_arena, "enable_shm_tensor_arena")
        n_local_reader = check_int(n_local_reader, "n_local_reader", minimum=0)
        if n_local_reader > n_reader:
            raise ValueError(
                f"n_local_reader must be <= n_reader ({n_reader}), got {n_local_reader}")
        ranks = _local_ranks(local_reader_ranks, n_local_reader)
        max_chunk_bytes, max_chunks = check_ring_options(max_chunk_bytes, max_chunks, connect_ip)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        check_bool(allow_pickle, "allow_pickle")
        check_bool(exact_types, "exact_types")
        check_bool(shared_reader_key, "shared_reader_key")
        if writer_rank is not None:
            writer_rank = check_int(writer_rank, "writer_rank", minimum=0)
        warn = check_warn_interval(warn_interval)
        policy = _policy(wait_policy)
        writer = QueueWriter(
            name=name or f"mq-{os.getpid()}",
            n_reader=n_reader,
            local_reader_ranks=ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            policy=policy,
            codec=Codec(allow_pickle=allow_pickle, exact=exact_types),
            writer_rank=writer_rank,
            remote_reader_keys=remote_reader_keys,
            shared_reader_key=shared_reader_key,
            warn_interval=warn,
        )
        self._init_common(writer, writer_rank)

    def _init_common(self, impl: QueueWriter | LocalReader | RemoteReader,
                     rank: int | None) -> None:
        self._impl = impl
        #: ``_impl`` again, typed by side: exactly one of the two is set.
        self._writer: QueueWriter | None = impl if isinstance(impl, QueueWriter) else None
        self._reader: LocalReader | RemoteReader | None = (
            None if isinstance(impl, QueueWriter) else impl)
        self._rank = rank
        # One call at a time: a second thread's call raises ConcurrentCallError
        # instead of interleaving with the first on the ring (close() and
        # shutdown() are the calls meant for other threads).
        self._one_call = threading.Lock()
        self._close_lock = threading.Lock()
        self._default_timeout: float | None = None

    @classmethod
    def create_from_handle(
        cls,
        handle: Handle,
        rank: int,
        *,
        wait_policy: WaitPolicy | None = None,
        allow_pickle: bool = False,
        curve_keypair: tuple[bytes, bytes] | None = None,
        resizable_tensors: bool = False,
        warn_interval: float | None = None,
    ) -> MessageQueue:
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
            curve_keypair: A remote reader's own Z85 ``(public, secret)`` CURVE
                keys, whose public half the writer was given
                (``remote_reader_keys``); without it the handle must carry a
                client keypair: this rank's (``export_handle(rank=rank)``), or
                the queue's one key (a single remote reader's, or shared by
                opt-in: ``shared_reader_key``).
            resizable_tensors: Decode tensors into storage torch allocates
                (resizable, like ``torch.empty``'s) instead of a NumPy copy
                (see :class:`~shm_broadcast.codec.message_codec.Codec`'s ``resizable``).
            warn_interval: Seconds a wait for a message lasts before this
                reader logs it (naming the writer and how long ago the last
                message arrived), and between such warnings; a positive
                finite number. Default: ``$GROUPCOORD_MQ_WARN_INTERVAL``,
                else 10 s.

        Raises:
            TypeError: ``handle`` is not a :class:`Handle`, or
                ``warn_interval`` is not a number.
            ValueError: ``rank`` is invalid, a remote ``rank`` has no CURVE
                keys (none given, none in the handle, or another rank's), or
                ``warn_interval`` is not a positive finite number.
            SegmentError: The ring is gone (writer exited) or the slot is taken.
        """
        if isinstance(handle, (bytes, bytearray, memoryview)):
            handle = Handle.from_bytes(bytes(handle))
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be a shm_broadcast.Handle, got {type(handle).__name__}")
        rank = check_int(rank, "rank", minimum=0)
        warn = check_warn_interval(warn_interval)
        policy = _policy(wait_policy)
        codec = Codec(allow_pickle=allow_pickle, resizable=resizable_tensors)
        self = cls.__new__(cls)
        reader: LocalReader | RemoteReader
        if rank in handle.local_reader_ranks:
            index = handle.local_reader_ranks.index(rank)
            reader = LocalReader(handle, index, rank, policy, codec, warn)
        else:
            check_int(rank, "rank (of a remote reader)", maximum=MAX_RANK)
            reader = RemoteReader(handle, rank, policy, codec, client_keypair=curve_keypair,
                                  warn_interval=warn)
        self._init_common(reader, rank)
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
        blocking: bool = True,
        warn_interval: float | None = None,
        external_writer_handle: Handle | bytes | None = None,
    ) -> MessageQueue | None:
        """Build a connected queue collectively over ``group``.

        Every rank of ``group`` must call it. See
        :func:`shm_broadcast.queue.process_group.create_from_process_group`.

        Returns:
            The writer's queue on ``writer_rank``, a reader's queue on each of
            ``reader_ranks`` (default: every other rank), ``None`` elsewhere;
            with ``external_writer_handle`` on ``writer_rank``, a reader's
            queue of that external writer on every rank.
        """
        return create_from_process_group(
            cls, group, max_chunk_bytes, max_chunks, writer_rank, reader_ranks, name=name,
            connect_ip=connect_ip, wait_policy=wait_policy, timeout=timeout,
            allow_pickle=allow_pickle, blocking=blocking, warn_interval=warn_interval,
            external_writer_handle=external_writer_handle)

    # ---------------------------------------------------------- properties
    @property
    def is_writer(self) -> bool:
        """Whether this object is the writer side."""
        return self._writer is not None

    @property
    def rank(self) -> int | None:
        """The rank given at creation (writer: ``writer_rank``)."""
        return self._rank

    @property
    def transport(self) -> str:
        """``"writer"``, ``"shm"`` (a reader on the writer's node, through the
        ring) or ``"tcp"`` (a reader on another node, through zmq)."""
        if self._writer is not None:
            return "writer"
        return "tcp" if isinstance(self._impl, RemoteReader) else "shm"

    @property
    def name(self) -> str:
        """The queue's name."""
        return self._impl.name

    def park_stats(self) -> dict[str, int]:
        """Counters of this side's waiting (diagnostics, cheap to keep).

        Returns:
            ``{"parks": n, "timeouts": m, ...}``: how often this side slept on
            its doorbell, and how many of those sleeps ended by the
            ``park_poll_s`` bound instead of a ring. While the peer is busy, a
            timeout means a wake-up was missed (or the peer stalled that long).
            A shared-memory reader also counts ``sleeps`` (planned sleeps of a
            predictive policy) and ``sleeps_rung`` (those a ring cut short: the
            message came early); with a predictive policy, the predictor's
            counters follow: ``planned``/``unplanned`` waits and where each
            awaited message fell relative to its window (``early``,
            ``on_time``, ``late``), plus ``ready`` (no wait was needed),
            ``contended`` (polls cut short because another task shared the
            CPU), ``cpu_moves`` (moves to another CPU after such a poll),
            ``cpu_moves_no_free_cpu`` (such moves not made: no CPU was free) and
            ``mode_poll``/``mode_park`` (how windows were spent). See
            :mod:`shm_broadcast.waiting.predictive`.
        """
        out = dict(self._impl.park_stats)
        out.update(getattr(self._impl, "predictor_stats", {}))
        return out

    def lag_stats(self) -> dict[str, Any]:
        """Writer only: how far behind each reader is, computed when asked (the
        message path keeps no extra count).

        Returns:
            ``{"written": n, "readers": [{"reader": slot, "rank": r, "remote":
            bool, "outstanding": k}, ...]}``: the messages sent so far and,
            per reader (local readers in slot order, then remote readers by
            rank, once connected), its ring slot (None for a remote reader),
            its rank, whether it is remote, and ``written`` minus what it has
            read. A local reader's count comes from the ring's flags (at most
            ``max_chunks``); a remote reader's from its acknowledgements,
            which it sends every ``remote_window // 4`` messages, so its
            count may run that many ahead of its reading.

        Raises:
            QueueRoleError: This is a reader.
            QueueClosedError: The queue is closed.
        """
        if not self._writer:
            raise QueueRoleError(f"queue {self.name!r}: lag_stats() is for the writer; "
                                 f"this is reader rank {self._rank}")
        return self._writer.lag_stats()

    def security_stats(self) -> dict[str, int]:
        """Writer only: what the writer refused so far (each dropped, never applied).

        Returns:
            ``{"auth_denied", "auth_over_limit", "handshake_failed",
            "bad_control", "control_dropped", "subscriptions_dropped"}``: unknown
            client keys, known keys beyond their connections, handshakes that
            did not complete, malformed or forged control frames, frames of a
            connection that used up its invalid frames, and subscriptions that
            are not the queue's (or beyond a key's budget); see
            ``docs/security-channels.md``.
        """
        if not self._writer:
            raise QueueRoleError(f"queue {self.name!r}: security_stats() is for the writer")
        return dict(self._writer.security_stats())

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._impl.closed

    @property
    def default_timeout(self) -> float | None:
        """Seconds :meth:`enqueue`, :meth:`dequeue` and :meth:`broadcast_object`
        wait when called without a ``timeout`` (None, the default: as long as
        the peer lives). Settable; a ``GroupCoordinator`` sets its group's
        timeout on the queues it creates.

        Raises:
            TypeError, ValueError: On setting a value that is not a timeout
                (:func:`~shm_broadcast.checks.check_timeout`).
        """
        return self._default_timeout

    @default_timeout.setter
    def default_timeout(self, value: float | None) -> None:
        self._default_timeout = check_timeout(value, "default_timeout")

    # ------------------------------------------------------------ writer API
    def export_handle(self, rank: int | None = None) -> Handle:
        """Return the :class:`Handle` readers connect with (writer only).

        Args:
            rank: The reader the handle is for. Without it, or for a local
                reader, the handle every reader may get: it carries no secret,
                except the one remote reader's key of a queue with a single
                remote reader, or a key shared by opt-in
                (``shared_reader_key``). For a remote reader of a queue with
                several, made without ``remote_reader_keys``, the handle with
                that rank's own client keypair (made on the first call for the
                rank): send it to that reader only.

        Raises:
            TypeError, ValueError: ``rank`` is not a rank, is the writer's own,
                is beyond :data:`~shm_broadcast.queue.transport.MAX_RANK`, or is
                a remote rank beyond the queue's number of remote readers.
            QueueClosedError: The queue was closed (its segment is gone).
        """
        if not self._writer:
            raise QueueRoleError(f"queue {self.name!r}: export_handle() is for the writer; "
                                 f"this is reader rank {self._rank}")
        if rank is not None:
            rank = check_int(rank, "rank", minimum=0)
        return self._writer.handle_for(rank)

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj`` to every reader (writer only).

        Blocks while the ring is full (the slowest local reader is
        ``max_chunks`` messages behind) or a remote reader is a window behind.
        Tensors are copied before this returns; the caller may reuse them.

        Args:
            obj: Any value (see :mod:`shm_broadcast.codec.message_codec` for the encoding).
            timeout: Seconds to wait for room; ``None``: :attr:`default_timeout`
                (itself None unless set: wait as long as the readers live).

        Raises:
            QueueTimeout: No room within ``timeout``; names lagging readers.
            PeerDiedError: A reader the writer waits for has died.
            QueueClosedError: The queue was shut down or a reader closed it.
            TypeError: ``obj`` holds a value that cannot be sent.
        """
        if not self._writer:
            raise QueueRoleError(f"queue {self.name!r}: enqueue() is for the writer; "
                                 f"this is reader rank {self._rank}")
        timeout = self._default_timeout if timeout is None else check_timeout(timeout)
        if not self._one_call.acquire(False):  # another thread is in a call
            self._refuse("enqueue")
        try:
            self._writer.enqueue(obj, timeout)
        finally:
            self._one_call.release()

    def enqueue_confirmed(self, obj: Any, timeout: float | None = None) -> list[str | None]:
        """Send ``obj`` like :meth:`enqueue`, then wait until every reader has taken
        it, or refused it with :meth:`dequeue`'s ``verdict`` (writer only; every
        reader on this host).

        A meeting send: it returns only once the readers came, and tells the
        writer what they made of the message.

        Args:
            obj: As for :meth:`enqueue`.
            timeout: Seconds for room in the ring and the readers' verdicts
                together; ``None``: :attr:`default_timeout`.

        Returns:
            One entry per reader, in slot order: None where the reader took the
            message, its reason (text, at most ~1 KiB) where it refused it.

        Raises:
            QueueTimeout: No room, or a reader did not come, within ``timeout``;
                names the readers.
            QueueRoleError: A reader is remote (verdicts travel in the ring).
            PeerDiedError, QueueClosedError, TypeError: As for :meth:`enqueue`.
        """
        if not self._writer:
            raise QueueRoleError(f"queue {self.name!r}: enqueue_confirmed() is for the writer; "
                                 f"this is reader rank {self._rank}")
        timeout = self._default_timeout if timeout is None else check_timeout(timeout)
        if not self._one_call.acquire(False):  # another thread is in a call
            self._refuse("enqueue_confirmed")
        try:
            return self._writer.enqueue_confirmed(obj, timeout)
        finally:
            self._one_call.release()

    # ------------------------------------------------------------ reader API
    def dequeue(self, timeout: float | None = None, indefinite: bool = False, *,
                verdict: Callable[[Any], str | None] | None = None) -> Any:
        """Receive the next message (readers only).

        Args:
            timeout: Seconds to wait; ``0`` returns a waiting message or raises
                at once (non-blocking poll); ``None``: :attr:`default_timeout`
                (itself None unless set: wait as long as the writer lives).
            verdict: Called with the decoded message before its slot is
                released; a returned string refuses the message with that
                reason (told to a writer waiting in :meth:`enqueue_confirmed`),
                None takes it. A message that fails to decode, or whose
                ``verdict`` raises, is refused with the error's text and the
                error propagates. The message is returned either way. Readers
                on the writer's host only.
            indefinite: Wait with no time limit, whatever ``timeout`` and
                :attr:`default_timeout` say (vLLM's argument, second as in its
                ``dequeue(timeout, indefinite)``: a worker's busy loop between
                requests); the writer's death still ends the wait.

        Raises:
            QueueTimeout: Nothing arrived within ``timeout``.
            PeerDiedError: The writer died and every message it sent was read.
            DecodeError: The message is malformed, or holds a pickled value
                while this side has ``allow_pickle`` off.
            QueueClosedError: The writer shut the queue down (after every
                earlier message was read) or this side was shut down.
        """
        if not self._reader:
            raise QueueRoleError(f"queue {self.name!r}: dequeue() is for readers; "
                                 "this is the writer")
        if check_bool(indefinite, "indefinite"):
            timeout = None
        elif timeout is None:
            timeout = self._default_timeout
        else:
            timeout = check_timeout(timeout)
        if verdict is not None and not callable(verdict):
            raise TypeError(f"verdict must be a callable or None, got {type(verdict).__name__}")
        if not self._one_call.acquire(False):  # another thread is in a call
            self._refuse("dequeue")
        try:
            if verdict is None:
                return self._reader.dequeue(timeout)
            if not isinstance(self._reader, LocalReader):
                raise QueueRoleError(f"queue {self.name!r}: a verdict needs a reader on the "
                                     f"writer's host; this reader is remote")
            return self._reader.dequeue(timeout, verdict)
        finally:
            self._one_call.release()

    def poll(self) -> bool:
        """Whether :meth:`dequeue` has a message ready now (readers only)."""
        if not self._reader:
            raise QueueRoleError(f"queue {self.name!r}: poll() is for readers")
        return self._reader.poll()

    def broadcast_object(self, obj: Any = None, timeout: float | None = None) -> Any:
        """Writer: enqueue ``obj`` and return it. Reader: return the next message."""
        if self._writer:
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
        timeout = check_timeout(timeout)
        if not self._one_call.acquire(False):  # another thread is in a call
            self._refuse("wait_until_ready")
        try:
            self._impl.wait_until_ready(timeout)
        finally:
            self._one_call.release()

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
            if not self._one_call.acquire(blocking=False):  # another thread is in a call
                self._impl.shutdown()
                if not self._one_call.acquire(timeout=2.0):
                    self._impl.close()
                    return
            try:
                self._impl.close()
            finally:
                self._one_call.release()

    def _refuse(self, op: str) -> None:
        """Refuse call ``op``: another thread is in a call of this queue object.

        Raises:
            ConcurrentCallError: Always.
        """
        raise ConcurrentCallError(
            f"queue {self.name!r}: {op}() was called while another thread is in a call of "
            f"this queue object; a queue side serves one call at a time: use one queue "
            f"object per thread, or a lock", queue=self.name)

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a MessageQueue cannot be pickled; send its export_handle() instead")

    def __repr__(self) -> str:
        side = "writer" if self._writer is not None else f"reader rank {self._rank}"
        state = "closed" if self.closed else "open"
        return f"MessageQueue({self.name!r}, {side}, {state})"


def _local_ranks(ranks: Any, n_local_reader: int) -> tuple[int, ...]:
    """``local_reader_ranks`` checked: ``n_local_reader`` distinct ints >= 0
    (default ``0 .. n_local_reader - 1``).

    Raises:
        TypeError: Not a sequence of ints.
        ValueError: Wrong count, a duplicate or a negative rank.
    """
    if ranks is None:
        return tuple(range(n_local_reader))
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"local_reader_ranks must be a list of ints, got {type(ranks).__name__} "
                        f"({ranks!r:.60})")
    ranks = [check_int(r, f"local_reader_ranks[{i}]", minimum=0) for i, r in enumerate(ranks)]
    if len(ranks) != n_local_reader or len(set(ranks)) != len(ranks):
        raise ValueError(f"local_reader_ranks must be {n_local_reader} distinct ints >= 0 "
                         f"(n_local_reader), got {list(ranks)!r:.120}")
    return tuple(ranks)


def _policy(wait_policy: WaitPolicy | None) -> WaitPolicy:
    """``wait_policy`` checked, or the default policy for None."""
    return check_wait_policy(wait_policy) or WaitPolicy()
