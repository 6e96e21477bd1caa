"""Collective construction of a MessageQueue over a process group.

:func:`create_from_process_group` works with a ``torch.distributed``
ProcessGroup (a CPU-capable one, e.g. gloo) or a StatelessProcessGroup (see
:mod:`shm_broadcast.ranks.group_adapter`):

0. every rank checks its own arguments and the ranks agree on them
   (:func:`~shm_broadcast.ranks.agreement.agree`: a rank with bad arguments raises
   its own error, the others ``PeerRejectedError`` naming it, and a writer or
   reader list that differs between ranks is a ``CollectiveMismatch``);
1. every rank learns which ranks share the writer's node
   (:func:`~shm_broadcast.ranks.topology.in_the_same_node_as`);
2. the writer creates the queue with those readers local and the others
   remote, and broadcasts its handle (or its creation error, so no rank is
   left waiting);
3. readers connect, and every participant waits until the queue is ready.

The queue class comes in as an argument (:class:`QueueClass`, what
:meth:`MessageQueue.create_from_process_group
<shm_broadcast.queue.message_queue.MessageQueue.create_from_process_group>` passes:
itself), so this module depends on the queue's interface only and the
dependency runs one way, from ``message_queue`` to here.

Building blocks for a GroupCoordinator:

* broadcaster from rank ``w``: ``MessageQueue.create_from_process_group(g, writer_rank=w)``;
* one reader, many writers (results back to a driver): for each writer
  ``w != r``, ``MessageQueue.create_from_process_group(g, writer_rank=w,
  reader_ranks=[r])`` -- each call is collective and returns ``None`` on
  uninvolved ranks.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, TypeVar

import msgspec

from shm_broadcast.checks import as_int, check_bool, check_rank, check_timeout
from shm_broadcast.errors import CollectiveMismatch, DecodeError
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.options import (
    DEFAULT_READY_TIMEOUT,
    check_ring_options,
    check_wait_policy,
    check_warn_interval,
)
from shm_broadcast.queue.transport import new_keypair
from shm_broadcast.ranks.agreement import agree
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.ranks.topology import in_the_same_node_as
from shm_broadcast.waiting.policy import WaitPolicy

__all__ = ["create_from_process_group", "ConnectedQueue", "QueueClass"]


class ConnectedQueue(Protocol):
    """What this module does with a queue once it exists."""

    def export_handle(self) -> Handle:
        """The writer's handle, for the readers."""

    def wait_until_ready(self, timeout: float | None = ...) -> None:
        """Block until every side is connected."""

    def close(self) -> None:
        """Release the queue (on a failure of the collective)."""


Q = TypeVar("Q", bound=ConnectedQueue, covariant=True)


class QueueClass(Protocol[Q]):
    """How this module makes a queue: the writer's constructor and the readers'
    ``create_from_handle`` (:class:`~shm_broadcast.queue.message_queue.MessageQueue`'s)."""

    def __call__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None, max_chunk_bytes: int, max_chunks: int,
                 connect_ip: str | None, *, name: str | None, wait_policy: WaitPolicy | None,
                 allow_pickle: bool, writer_rank: int | None,
                 remote_reader_keys: dict[int, bytes] | None,
                 warn_interval: float | None) -> Q:
        """Create the writer's queue."""

    def create_from_handle(self, handle: Handle, rank: int, *, wait_policy: WaitPolicy | None,
                           allow_pickle: bool, curve_keypair: tuple[bytes, bytes] | None,
                           warn_interval: float | None) -> Q:
        """Connect a reader to the writer ``handle`` describes."""


def create_from_process_group(
    queue_cls: QueueClass[Q],
    group: Any,
    max_chunk_bytes: int,
    max_chunks: int,
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
) -> Q | None:
    """Create and connect a queue collectively; every rank of ``group`` calls it.

    Args:
        queue_cls: The queue class (:class:`QueueClass`).
        group: torch ProcessGroup (CPU-capable) or StatelessProcessGroup.
        max_chunk_bytes: Ring chunk size.
        max_chunks: Ring chunks.
        writer_rank: Group rank of the writer.
        reader_ranks: Group ranks that read; default every rank but the writer.
            Ranks are group-local, and are the ranks in the queue's errors.
        name: Queue name for errors (default ``mq-w<writer_rank>-<pid>``).
        connect_ip: IP for the TCP endpoints if some readers are on other nodes.
        wait_policy: Waiting policy for this rank's side.
        timeout: Seconds every participant waits for the queue to connect.
        allow_pickle: Opt every side in to pickle (:mod:`shm_broadcast.codec.message_codec`);
            off by default. Every rank must pass the same value.
        blocking: Wait here until the queue is connected (default). False:
            return at once; each side calls ``wait_until_ready()`` before its
            first message (vLLM's keyword).
        warn_interval: Seconds a side waits before it logs who holds it up
            (see :mod:`shm_broadcast.queue.laggards`); default
            ``$GROUPCOORD_MQ_WARN_INTERVAL``, else 10 s. Checked on every
            rank; each side uses its own.
        external_writer_handle: On ``writer_rank``: the handle (or its bytes)
            of a queue whose writer lives outside the group (vLLM's keyword).
            Nothing is created then: the writer rank broadcasts that handle
            and *every* rank of the group, ``writer_rank`` included, connects
            to it as the reader of its own group rank (so the external queue
            must have been made for readers ``0 .. world_size - 1``). The
            handle travels without its client secret: a remote reader must
            pass the handle itself (with the queue's shared key:
            ``shared_reader_key``). Other ranks' value is otherwise not used,
            as in vLLM; ``reader_ranks`` must then be None.

    Returns:
        The queue on the writer and the readers, ``None`` on other ranks;
        with an external writer's handle, a reader's queue on every rank.

    Raises:
        TypeError, ValueError: This rank's arguments are invalid (every other
            rank raises ``PeerRejectedError`` naming it).
        PeerRejectedError: Another rank's arguments were invalid.
        CollectiveMismatch: Ranks named different writers or readers, or the
            writer failed to create the queue (on readers; the writer
            re-raises its own error).
        QueueTimeout: The queue did not connect within ``timeout``.
    """
    og = object_group(group)
    qname = name or f"mq-w{writer_rank}-{os.getpid()}"
    try:
        writer_rank = check_rank(writer_rank, og.world_size, "writer_rank")
        readers = _resolve_readers(reader_ranks, writer_rank, og.world_size)
        _check_options(max_chunk_bytes, max_chunks, connect_ip, wait_policy, timeout,
                       warn_interval)
        check_bool(blocking, "blocking")
        external = _external_bytes(external_writer_handle, reader_ranks)
    except (TypeError, ValueError) as e:
        agree(og, e, "create_from_process_group", qname)
        raise  # agree raised e already
    agree(og, None, "create_from_process_group", qname, [writer_rank, readers])
    # Whether the writer is outside the group: the writer rank's handle decides, for
    # every rank (the others' own handles count only as their copy of it).
    is_writer = og.rank == writer_rank
    outside = og.broadcast(external is not None if is_writer else None, src=writer_rank,
                           op="create_from_process_group (writer)")
    if outside is True:
        return _connect_to_external(queue_cls, og, writer_rank, external if is_writer else None,
                                    wait_policy, allow_pickle, warn_interval,
                                    timeout if blocking else None, external)
    same_node = in_the_same_node_as(og, source_rank=writer_rank, name=qname)
    local = [r for r in readers if same_node[r]]
    my_keys, reader_keys = _exchange_reader_keys(og, [r for r in readers if r not in local])
    mq = None if og.rank != writer_rank else _create_on_writer(
        queue_cls, og, readers, local, max_chunk_bytes, max_chunks, connect_ip,
        qname, wait_policy, allow_pickle, reader_keys, warn_interval)
    handle = _receive_handle(og, mq, writer_rank)
    try:
        if og.rank in readers:
            mq = queue_cls.create_from_handle(handle, og.rank, wait_policy=wait_policy,
                                              allow_pickle=allow_pickle, curve_keypair=my_keys,
                                              warn_interval=warn_interval)
        if mq is not None and blocking:
            mq.wait_until_ready(timeout)
    except BaseException:
        if mq is not None:
            mq.close()
        raise
    return mq


def _external_bytes(handle: Any, reader_ranks: Any) -> bytes | None:
    """``external_writer_handle`` as bytes (None: none given).

    Raises:
        TypeError: It is neither a :class:`Handle` nor bytes.
        ValueError: ``reader_ranks`` was given too (every rank reads then).
    """
    if handle is None:
        return None
    if isinstance(handle, Handle):
        data = handle.to_bytes()
    elif isinstance(handle, bytes | bytearray | memoryview):
        data = bytes(handle)
    else:
        raise TypeError(f"external_writer_handle must be a shm_broadcast Handle or its bytes, "
                        f"got {type(handle).__name__}")
    Handle.from_bytes(data)  # a ValueError naming what is wrong, before anyone connects
    if reader_ranks is not None:
        raise ValueError("reader_ranks must be None with an external_writer_handle: every "
                         f"rank of the group reads the external queue, got {reader_ranks!r}")
    return data


def _connect_to_external(queue_cls: QueueClass[Q], og: Any, writer_rank: int,
                         external: bytes | None, wait_policy: WaitPolicy | None,
                         allow_pickle: bool, warn_interval: float | None,
                         ready_timeout: float | None, own: bytes | None) -> Q:
    """Every rank connects, as the reader of its group rank, to the queue whose handle
    the writer rank holds (``external``, there); waits ``ready_timeout`` if given.

    The group's channel may be plain TCP, so the handle travels without its
    client secret (a remote reader's credential): a rank that passed the same
    handle itself (``own``) connects with its own copy, secret included; the
    others with the public part, which is all a local reader needs.
    """
    public = _public(external) if external is not None else None
    data = og.broadcast(public, src=writer_rank,
                        op="create_from_process_group (external handle)")
    try:
        if type(data) is not bytes:
            raise ValueError(f"got {type(data).__name__}")
        handle = Handle.from_bytes(data)
    except ValueError as e:
        raise DecodeError(f"rank {writer_rank} sent no queue handle: {e}",
                          peers=(writer_rank,)) from None
    if own is not None and _public(own) == data:
        handle = Handle.from_bytes(own)
    mq = queue_cls.create_from_handle(handle, og.rank, wait_policy=wait_policy,
                                      allow_pickle=allow_pickle, curve_keypair=None,
                                      warn_interval=warn_interval)
    if ready_timeout is not None:
        try:
            mq.wait_until_ready(ready_timeout)
        except BaseException:
            mq.close()
            raise
    return mq


def _public(data: bytes) -> bytes:
    """A serialised handle without its client secret."""
    handle = Handle.from_bytes(data)
    if handle.curve_client_secret is None:
        return data
    return msgspec.structs.replace(handle, curve_client_secret=None).to_bytes()


def _check_options(max_chunk_bytes: Any, max_chunks: Any, connect_ip: Any,
                   wait_policy: Any, timeout: Any, warn_interval: Any) -> None:
    """The queue's options, checked on every rank (the writer alone uses the sizes,
    but a reader's bad value is the same mistake and must not pass silently)."""
    check_ring_options(max_chunk_bytes, max_chunks, connect_ip)
    check_wait_policy(wait_policy)
    check_timeout(timeout)
    check_warn_interval(warn_interval)


def _resolve_readers(reader_ranks: list[int] | None, writer_rank: int, world: int) -> list[int]:
    """The reader ranks: the given ones, checked, or every rank but the writer."""
    if reader_ranks is None:
        return [r for r in range(world) if r != writer_rank]
    given = [as_int(r) for r in reader_ranks]
    readers = [r for r in given if r is not None and 0 <= r < world]
    if (
        len(readers) != len(given)
        or len(set(readers)) != len(readers)
        or writer_rank in readers
    ):
        raise ValueError(
            f"reader_ranks must be distinct group ranks in [0, {world}) other than the "
            f"writer ({writer_rank}), got {reader_ranks!r}")
    return readers


def _exchange_reader_keys(og: Any, remote: list[int]
                          ) -> tuple[tuple[bytes, bytes] | None, dict[int, bytes] | None]:
    """Each remote reader makes its own CURVE keypair; every rank learns the public keys.

    Only public keys travel (msgpack over the group), so the queue's handle
    carries no secret. Returns this rank's keypair (remote readers only) and
    ``{rank: public key}`` (None when no reader is remote: no exchange then).
    """
    if not remote:
        return None, None
    mine = new_keypair() if og.rank in remote else None
    publics = og.all_gather(mine[0] if mine is not None else None,
                            op="create_from_process_group (reader keys)")
    keys: dict[int, bytes] = {}
    for r in remote:
        key = publics[r]
        if not isinstance(key, bytes) or len(key) != 40:
            raise DecodeError(f"rank {r} sent no valid CURVE public key for the queue "
                              f"({type(key).__name__}); nothing was created", peers=(r,))
        keys[r] = key
    return mine, keys


def _create_on_writer(queue_cls: QueueClass[Q], og: Any, readers: list[int], local: list[int],
                      max_chunk_bytes: int, max_chunks: int, connect_ip: str | None, name: str,
                      wait_policy: WaitPolicy | None, allow_pickle: bool,
                      reader_keys: dict[int, bytes] | None, warn_interval: float | None) -> Q:
    """Create the writer's queue; on failure tell the readers why, then re-raise."""
    writer_rank = og.rank
    try:
        return queue_cls(len(readers), len(local), local, max_chunk_bytes, max_chunks,
                         connect_ip, name=name, wait_policy=wait_policy,
                         writer_rank=writer_rank, allow_pickle=allow_pickle,
                         remote_reader_keys=reader_keys, warn_interval=warn_interval)
    except BaseException as e:
        og.broadcast(("error", f"{type(e).__name__}: {e}"), src=writer_rank,
                     op="create_from_process_group (handle)")
        raise


def _receive_handle(og: Any, mq: ConnectedQueue | None, writer_rank: int) -> Handle:
    """Broadcast the writer's handle; a writer-side failure is a CollectiveMismatch here."""
    payload = ("ok", mq.export_handle().to_bytes()) if mq is not None else None
    try:
        payload = og.broadcast(payload, src=writer_rank,
                               op="create_from_process_group (handle)")
    except BaseException:
        if mq is not None:
            mq.close()
        raise
    if payload[0] != "ok":
        raise CollectiveMismatch(
            f"the writer (rank {writer_rank}) could not create the message queue: {payload[1]}",
            peers=(writer_rank,))
    return Handle.from_bytes(payload[1])
