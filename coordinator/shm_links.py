"""Tensor dicts between two ranks of one host, through shared memory.

On a CPU group whose communicator shares memory with the peer,
``send_tensor_dict`` / ``recv_tensor_dict`` (and their asynchronous forms)
move each dict as *one* message of a one-reader
:class:`~shm_broadcast.message_queue.MessageQueue` per direction and peer, a
*link*: the metadata and every tensor's bytes together, copied once into the
ring and once out. Over the CPU group the same dict costs the metadata plus
one gloo send per tensor, each a socket round trip and a kernel wake-up
(hundreds of microseconds each between two local processes).

Settling a direction. The first tensor dict a rank sends to ``dst`` begins
with an *offer* over the CPU group (``send_object``): ``[MAGIC, handle]`` when
the sender opened a link (its communicator shares memory with ``dst``,
``GROUPCOORD_P2P_SHM`` is not ``0``, ``/dev/shm`` had room), else
``[MAGIC, None]``. The receiver's first ``recv_tensor_dict`` from that rank
reads the offer and attaches, or stays on the CPU group; both sides then wait
(at most the group's timeout) until the link is connected. The sender alone
decides, so the two sides cannot disagree, and the choice holds for the
group's life::

    direction:  UNSETTLED --(offer sent / offer read)--> LINK | CPU GROUP
                an error while settling leaves it UNSETTLED (the next call offers again)

GPU groups never offer: their tensors go through the device communicator.

Order. Calls of one direction with one peer run one at a time in issue order
(:func:`coordinator.async_p2p.ordered` and the channel threads), and a link is
FIFO, so a rank's ``n``-th dict to ``p`` is ``p``'s ``n``-th dict from it.

Buffering. A send returns once its dict is in the ring: a sender may run up
to :data:`CHUNKS` dicts ahead of its receiver (then it waits, at most the
group's timeout, naming the receiver), as an eager send does. A receiver that
never comes is therefore seen by the sender only when the ring is full, or
at the direction's first dict (the offer waits for it).

What a dict becomes on a link (one message, or a header and parts for dicts
larger than a ring chunk) is :mod:`coordinator.link_messages`. The queue's
codec takes the group's ``allow_pickle`` (off: nothing received is
unpickled).

Closing. :meth:`ShmLinks.shutdown` wakes any call blocked on a link (from any
thread) with ``ClosedError``; :meth:`ShmLinks.close` closes the queues (the
writer unlinks its segment; a crashed writer's segment is reaped like every
queue's, see :mod:`shm_broadcast.exit_cleanup`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from coordinator.errors import ClosedError, DecodeError
from coordinator.p2p_channels import RECV, SEND

if TYPE_CHECKING:
    from shm_broadcast.message_queue import MessageQueue

    from coordinator.group_coordinator import GroupCoordinator

__all__ = ["ShmLinks", "ENABLE_ENV", "MAGIC", "CHUNK_BYTES", "CHUNKS"]

logger = logging.getLogger(__name__)

#: ``0`` on a sending rank: its tensor dicts keep to the CPU group.
ENABLE_ENV = "GROUPCOORD_P2P_SHM"
#: First element of every offer (and its version).
MAGIC = "groupcoord-p2p-link/1"
#: Ring chunk of a link: a dict's message, or one part of its large tensors
#: (:mod:`coordinator.link_messages`), fits in one.
CHUNK_BYTES = 2 << 20
#: Chunks per link: how many dicts a sender may run ahead of its receiver.
CHUNKS = 2
_MAX_HANDLE_BYTES = 1 << 16
_CPU_GROUP = "cpu-group"  # a settled direction without a link


class ShmLinks:
    """A group's links, one per direction and peer, opened at first use.

    Args:
        coord: The group (its CPU group carries the offers).
    """

    def __init__(self, coord: "GroupCoordinator") -> None:
        self._coord = coord
        self._lock = threading.Lock()
        self._settled: dict[tuple[str, int], Any] = {}
        self._queues: list["MessageQueue"] = []  # settled or settling: shutdown reaches both
        self._closed = False

    def sender(self, dst: int) -> "MessageQueue | None":
        """The link to group rank ``dst``, or None for the CPU group (settles on first use)."""
        if self._coord.device.type != "cpu":
            return None
        got = self._settled.get((SEND, dst))
        if got is None:
            got = self._offer(dst)
        return None if got is _CPU_GROUP else got

    def receiver(self, src: int) -> "MessageQueue | None":
        """The link from group rank ``src``, or None for the CPU group (settles on first use)."""
        if self._coord.device.type != "cpu":
            return None
        got = self._settled.get((RECV, src))
        if got is None:
            got = self._accept(src)
        return None if got is _CPU_GROUP else got

    def shutdown(self) -> None:
        """Wake every call blocked on a link with ``ClosedError``; later ones raise it too."""
        with self._lock:
            self._closed = True
            queues = list(self._queues)
        for q in queues:
            q.shutdown()

    def close(self) -> None:
        """Shut down, then close every link (writers unlink their segments). Idempotent."""
        self.shutdown()
        with self._lock:
            queues, self._queues = self._queues, []
            self._settled.clear()
        for q in queues:
            q.close()

    # ------------------------------------------------------------------ settling
    def _offer(self, dst: int) -> Any:
        coord = self._coord
        q = self._open_writer(dst)
        try:
            handle = q.export_handle().to_bytes() if q is not None else None
            coord._send_object([MAGIC, handle], dst)
            if q is not None:
                q.wait_until_ready(coord.timeout)
        except BaseException:
            self._drop(q)
            raise
        return self._keep(SEND, dst, q)

    def _accept(self, src: int) -> Any:
        coord = self._coord
        handle = _check_offer(coord._recv_object(src), src, coord.rank_in_group)
        if handle is None:
            return self._keep(RECV, src, None)
        from shm_broadcast.message_queue import MessageQueue

        q = MessageQueue.create_from_handle(handle, coord.rank_in_group,
                                            allow_pickle=coord.allow_pickle)
        q.default_timeout = coord.timeout
        self._register(q)
        try:
            q.wait_until_ready(coord.timeout)
        except BaseException:
            self._drop(q)
            raise
        return self._keep(RECV, src, q)

    def _open_writer(self, dst: int) -> "MessageQueue | None":
        """A new link's writer, or None where the CPU group must carry the dicts."""
        coord = self._coord
        if os.environ.get(ENABLE_ENV, "1").strip() == "0":
            return None
        if not coord.comm.shares_memory_with(dst):
            return None
        from shm_broadcast.errors import SegmentError
        from shm_broadcast.message_queue import MessageQueue

        try:
            q = MessageQueue(
                n_reader=1, n_local_reader=1, local_reader_ranks=[dst],
                max_chunk_bytes=CHUNK_BYTES, max_chunks=CHUNKS,
                name=f"{coord.unique_name}-p2p-{coord.rank_in_group}to{dst}",
                writer_rank=coord.rank_in_group, allow_pickle=coord.allow_pickle,
            )
        except SegmentError as e:  # /dev/shm full or unusable: the CPU group still works
            logger.warning("group %r: tensor dicts to rank %d go over the CPU group: %s",
                           coord.unique_name, dst, e)
            return None
        q.default_timeout = coord.timeout
        self._register(q)
        return q

    def _register(self, q: "MessageQueue") -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._queues.append(q)
        if closed:
            q.close()
            raise self._closed_error()

    def _keep(self, direction: str, peer: int, q: "MessageQueue | None") -> Any:
        with self._lock:
            closed = self._closed
            if not closed:
                self._settled[(direction, peer)] = q if q is not None else _CPU_GROUP
        if closed:
            self._drop(q)
            raise self._closed_error()
        return q if q is not None else _CPU_GROUP

    def _drop(self, q: "MessageQueue | None") -> None:
        if q is None:
            return
        with self._lock:
            if q in self._queues:
                self._queues.remove(q)
        q.close()

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"group {self._coord.unique_name!r} was destroyed")


def _check_offer(offer: Any, src: int, me: int) -> Any:
    """The handle of a valid offer (None: no link), else DecodeError."""
    if (type(offer) is not list or len(offer) != 2 or offer[0] != MAGIC
            or not (offer[1] is None or type(offer[1]) is bytes)):
        raise DecodeError(
            f"recv_tensor_dict: rank {src} did not begin with a link offer (the first tensor "
            f"dict of a direction does); got {type(offer).__name__} {offer!r:.80}", peers=(src,))
    if offer[1] is None:
        return None
    if len(offer[1]) > _MAX_HANDLE_BYTES:
        raise DecodeError(f"recv_tensor_dict: rank {src} offered a link handle of "
                          f"{len(offer[1])} bytes (at most {_MAX_HANDLE_BYTES})", peers=(src,))
    from shm_broadcast.handle import Handle

    try:
        handle = Handle.from_bytes(offer[1])
    except ValueError as e:
        raise DecodeError(f"recv_tensor_dict: rank {src} offered a malformed link handle "
                          f"({e})", peers=(src,)) from None
    if tuple(handle.local_reader_ranks) != (me,) or handle.n_reader != 1 or handle.remote_pub:
        raise DecodeError(f"recv_tensor_dict: rank {src} offered a link that is not a "
                          f"shared-memory queue read by this rank alone", peers=(src,))
    return handle
