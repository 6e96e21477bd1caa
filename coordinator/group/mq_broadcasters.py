"""Message queues over a group: one-to-all broadcasters and all-to-one result queues.

:func:`create_mq_broadcaster` builds the group's one-writer-to-every-other-rank
queue (``GroupCoordinator.create_mq_broadcaster``).

:func:`create_single_reader_mq_broadcasters` gives every rank of a group except
the reader its own one-reader queue, whose only reader is
``reader_rank_in_group``. Workers ``enqueue`` their results; the driver
``dequeue``s from each worker's queue. Readers on the writer's node read
through shared memory, others over TCP.

It is collective over the group's CPU group: handles are exchanged with one
all-gather, so creation costs one round trip whatever the group size.

Every queue made here takes the group's ``allow_pickle`` (off by default): its
writer refuses values msgspec cannot carry, and its readers never unpickle.

Broadcaster readers wait predictively by default (``WaitPolicy.predictive()``,
see :mod:`shm_broadcast.waiting.predictive`): a group's broadcaster carries one
metadata message per engine step, so its readers learn the step period, sleep
parked until shortly before the next step and poll only around it; traffic
that is not periodic falls back to the plain spin -> yield -> park. Pass
``wait_policy=WaitPolicy()`` for the plain policy. Single-reader queues keep
the plain policy.

Every queue made here also takes the group's timeout: it bounds the wait for
the queue to connect, and it is the queue's
:attr:`~shm_broadcast.queue.message_queue.MessageQueue.default_timeout`, so an
``enqueue`` / ``dequeue`` called without a timeout (the group's own
broadcasts, a driver reading results) raises ``QueueTimeout`` naming the
lagging rank after the group's timeout instead of waiting as long as the peer
lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.calls.group_view import GroupView
from coordinator.errors import CollectiveMismatch
from device_comms import validation
from shm_broadcast.checks import check_bool, check_int
from shm_broadcast.ranks.agreement import agree
from shm_broadcast.ranks.group_adapter import object_group

if TYPE_CHECKING:
    from shm_broadcast.queue.message_queue import MessageQueue

__all__ = [
    "create_mq_broadcaster",
    "create_single_reader_mq_broadcasters",
    "SINGLE_READER_CHUNK_BYTES",
    "SINGLE_READER_CHUNKS",
]

# One queue per worker, all on the reader's host: results (sampled tokens,
# small dicts) are small, and larger ones take the overflow path. 1 MiB per
# queue, so 7 workers' queues take 7 MiB of /dev/shm.
SINGLE_READER_CHUNK_BYTES = 256 << 10
SINGLE_READER_CHUNKS = 4


_COLLECTIVE_OPTIONS = frozenset({"max_chunk_bytes", "max_chunks", "connect_ip", "wait_policy",
                                 "warn_interval"})
_HANDLE_OPTIONS = frozenset({"wait_policy", "warn_interval"})


def create_mq_broadcaster(
    group: GroupView,
    writer_rank: int = 0,
    external_writer_handle: Any = None,
    blocking: bool = True,
    **queue_options: Any,
) -> MessageQueue | None:
    """Implementation of :meth:`GroupCoordinator.create_mq_broadcaster` (see there)."""
    from shm_broadcast.queue.message_queue import MessageQueue
    from shm_broadcast.waiting.policy import WaitPolicy

    allowed = _HANDLE_OPTIONS if external_writer_handle is not None else _COLLECTIVE_OPTIONS
    try:
        writer_rank = validation.check_rank(writer_rank, group.world_size, "writer_rank")
        check_bool(blocking, "blocking")
        unknown = sorted(set(queue_options) - allowed)
        if unknown:
            raise TypeError(f"create_mq_broadcaster() got unexpected queue options {unknown}; "
                            f"allowed here: {sorted(allowed)}")
    except (TypeError, ValueError) as e:
        agree(object_group(group.cpu_group), e, "create_mq_broadcaster", group.unique_name)
        raise
    if queue_options.get("wait_policy") is None:
        queue_options["wait_policy"] = WaitPolicy.predictive()
    made = MessageQueue.create_from_process_group(
        group.cpu_group, writer_rank=writer_rank, name=f"{group.unique_name}-mq",
        timeout=group.timeout, allow_pickle=group.allow_pickle, blocking=blocking,
        external_writer_handle=external_writer_handle, **queue_options)
    if made is not None:
        made.default_timeout = group.timeout
    return made


#: The longest reason a writer whose queue failed sends its peers.
_REASON_MAX = 500


def create_single_reader_mq_broadcasters(
    group: GroupView,
    reader_rank_in_group: int = 0,
    blocking: bool = False,
    max_chunk_bytes: int = SINGLE_READER_CHUNK_BYTES,
    max_chunks: int = SINGLE_READER_CHUNKS,
) -> tuple[MessageQueue | None, list[MessageQueue | None]]:
    """Create one queue per non-reader rank, all read by ``reader_rank_in_group``.

    Args:
        group: The group (every rank calls this).
        reader_rank_in_group: Group rank that reads every queue.
        blocking: Wait until all queues are connected before returning. With
            False, call ``wait_until_ready()`` on every returned queue (both
            sides) before the first message.
        max_chunk_bytes: Chunk size of each queue's ring.
        max_chunks: Chunks per ring.

    Returns:
        ``(my_writer, readers)``: on a writer rank, its own queue and ``[]``; on
        the reader, ``None`` and a list indexed by group rank holding the queue
        read from that rank (``None`` at the reader's own index).
    """
    from shm_broadcast.queue.message_queue import MessageQueue
    from shm_broadcast.ranks.topology import in_the_same_node_as

    og = object_group(group.cpu_group)
    op = "create_single_reader_mq_broadcasters"
    try:
        reader_rank_in_group = validation.check_rank(reader_rank_in_group, group.world_size,
                                                     "reader_rank_in_group")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, got {type(blocking).__name__}")
        max_chunk_bytes = check_int(max_chunk_bytes, "max_chunk_bytes", minimum=128)
        max_chunks = check_int(max_chunks, "max_chunks", minimum=1)
    except (TypeError, ValueError) as e:
        if group.world_size > 1:
            agree(og, e, op, group.unique_name)
        raise
    me, reader = group.rank_in_group, reader_rank_in_group
    if group.world_size == 1:
        return None, [None]
    agree(og, None, op, group.unique_name, reader)
    same_node = in_the_same_node_as(group.cpu_group, source_rank=reader, name=group.unique_name)
    keypair, reader_key = _reader_keys(group, me, reader, all(same_node))
    writer: MessageQueue | None = None
    entry: Any = None  # this rank's handle, or ("error", why) when its queue failed
    failure: BaseException | None = None
    if me != reader:
        try:
            writer = MessageQueue(
                n_reader=1,
                n_local_reader=1 if same_node[me] else 0,
                local_reader_ranks=[reader] if same_node[me] else [],
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                name=f"{group.unique_name}-to{reader}-from{me}",
                writer_rank=me,
                allow_pickle=group.allow_pickle,
                remote_reader_keys=None if same_node[me] else {reader: reader_key},
            )
            writer.default_timeout = group.timeout
            entry = writer.export_handle().to_bytes()
        except Exception as e:  # the others are told in the exchange, then this re-raises
            failure, entry = e, ("error", f"{type(e).__name__}: {e}"[:_REASON_MAX])
    try:
        handles: list[Any] = og.all_gather(entry, op="create_single_reader_mq_broadcasters",
                                           name=group.unique_name)
        if failure is not None:
            raise failure
        failed = {r: h[1] for r, h in enumerate(handles)
                  if isinstance(h, (list, tuple)) and len(h) == 2 and h[0] == "error"}
        if failed:
            first = min(failed)
            raise CollectiveMismatch(
                f"group {group.unique_name!r}, op {op}: the writer(s) {sorted(failed)} could not "
                f"create their message queue (rank {first}: {failed[first]}); no queue was "
                f"made on any rank", queue=group.unique_name, peers=tuple(sorted(failed)))
    except BaseException:  # a peer failed during the exchange: this rank's queue goes too
        if writer is not None:
            writer.close()
        raise
    readers = _attach_readers(writer, handles, me, reader, blocking, group.allow_pickle, keypair,
                              group.timeout)
    return writer, readers


def _reader_keys(group: GroupView, me: int, reader: int,
                 all_local: bool) -> tuple[tuple[bytes, bytes] | None, Any]:
    """The reader's own CURVE keypair (for writers on other nodes) and its public key.

    Only the public key travels (msgpack over the CPU group), so no handle
    carries a secret. Nothing is exchanged when every writer shares the
    reader's node.
    """
    if all_local:
        return None, None
    from shm_broadcast.errors import DecodeError
    from shm_broadcast.queue.transport import new_keypair

    keypair = new_keypair() if me == reader else None
    public = object_group(group.cpu_group).broadcast(
        keypair[0] if keypair is not None else None, reader,
        op="create_single_reader_mq_broadcasters (reader key)")
    if not isinstance(public, bytes) or len(public) != 40:
        raise DecodeError(f"group {group.unique_name!r}: the reader (rank {reader}) sent no "
                          f"valid CURVE public key ({type(public).__name__})", peers=(reader,))
    return keypair, public


def _attach_readers(writer: MessageQueue | None, handles: list[Any], me: int, reader: int,
                    blocking: bool, allow_pickle: bool, keypair: tuple[bytes, bytes] | None,
                    timeout: float) -> list[MessageQueue | None]:
    """On the reader, open every writer's queue (each with ``timeout`` as its
    default); optionally wait, at most ``timeout``, for all to connect.

    On failure every queue this rank holds (its writer included) is closed.
    """
    from shm_broadcast.queue.message_queue import MessageQueue

    readers: list[MessageQueue | None] = []
    try:
        if me == reader:
            for r, h in enumerate(handles):
                q = None if r == reader else MessageQueue.create_from_handle(
                    h, reader, allow_pickle=allow_pickle, curve_keypair=keypair)
                readers.append(q)
                if q is not None:
                    q.default_timeout = timeout
        if blocking:
            for q in [writer, *readers]:
                if q is not None:
                    q.wait_until_ready(timeout)
    except BaseException:
        for q in [writer, *readers]:
            if q is not None:
                q.close()
        raise
    return readers
