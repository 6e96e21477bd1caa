"""Tensor dicts between two ranks of one host, through shared memory.

On a CPU group whose communicator shares memory with the peer,
``send_tensor_dict`` / ``recv_tensor_dict`` (and their asynchronous forms)
move each dict as *one* message of a one-reader
:class:`~shm_broadcast.queue.message_queue.MessageQueue` per direction and peer, a
*link*: the metadata and every tensor's bytes together, copied once into the
ring and once out. Over the CPU group the same dict costs the metadata plus
one gloo send per tensor, each a socket round trip and a kernel wake-up
(docs/performance.md has the figures). Single
tensors of ``send`` / ``recv`` take the link too, each meeting its receiver
(:mod:`coordinator.p2p.link_tensors`).

Settling a direction. The first call a rank makes toward ``dst`` (a tensor
dict or a tensor) begins with an *offer* over the CPU group (an object of
kind :data:`~coordinator.wire.object_comm.LINK_OFFER`): ``[MAGIC, handle]`` when
the sender opened a link (its communicator shares memory with ``dst``,
``GROUPCOORD_P2P_SHM`` is not ``0``, ``/dev/shm`` had room), else
``[MAGIC, None]``. The receiver's first ``recv_tensor_dict`` or ``recv`` from
that rank reads the offer, checks it (:mod:`coordinator.p2p.link_offer`) and attaches, or
stays on the CPU group; both sides then wait (at most the group's timeout, in
slices that notice a dead peer) until the link is connected. The sender alone
decides, so the two sides cannot disagree, and the choice holds for the
group's life::

    direction:  UNSETTLED --(offer sent / offer read)--> LINK | CPU GROUP
                LINK --(a call failed partway or timed out: its order is lost)--> CLOSED
                an error while settling leaves it UNSETTLED (the next call offers again)

GPU groups never offer: their tensors go through the device communicator.

Order. Calls of one direction with one peer run one at a time in issue order
(:meth:`coordinator.p2p.point_to_point.PointToPoint.ordered` and the channel
threads), and a link is FIFO, so a rank's ``n``-th dict to ``p`` is ``p``'s ``n``-th dict from it.

Meeting. A send on a link returns once its receiver took the message (a
dict larger than a chunk: its first message; the parts then stream through
the ring), as gloo's send does: the receiver judges it before releasing its
slot, so a receiver that never comes makes the sender time out naming it,
and one that refuses (another kind of call, shape or dtype, its own bad
arguments) makes it raise (:mod:`coordinator.p2p.link_tensors`,
:mod:`coordinator.p2p.link_messages`).

What a dict becomes on a link (one message, or a header and parts for dicts
larger than a ring chunk) is :mod:`coordinator.p2p.link_messages`. The queue's
codec takes the group's ``allow_pickle`` (off: nothing received is
unpickled).

Closing. :meth:`ShmLinks.shutdown` wakes any call blocked on a link (from any
thread) with ``ClosedError``; :meth:`ShmLinks.close` closes the queues (the
writer unlinks its segment; a crashed writer's segment is reaped like every
queue's, see :mod:`shm_broadcast.lifecycle.exit_cleanup`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from coordinator.calls.call_book import CallBook
from coordinator.calls.group_view import GroupView
from coordinator.errors import (
    ClosedError,
    CommTimeout,
    DecodeError,
    GroupCoordError,
    PeerDiedError,
)
from coordinator.p2p import link_offer
from coordinator.p2p.channels import LIVENESS_S, RECV, SEND
from coordinator.p2p.link_offer import CHUNK_BYTES, CHUNKS
from coordinator.wire.object_comm import LINK_OFFER, ObjectChannel
from shm_broadcast.checks import env_flag

if TYPE_CHECKING:
    from shm_broadcast.queue.message_queue import MessageQueue

__all__ = ["ShmLinks", "ENABLE_ENV", "CHUNK_BYTES", "CHUNKS"]

logger = logging.getLogger(__name__)

#: ``0`` on a sending rank: its tensor dicts keep to the CPU group.
ENABLE_ENV = "GROUPCOORD_P2P_SHM"
_CPU_GROUP = "cpu-group"  # a settled direction without a link


class ShmLinks:
    """A group's links, one per direction and peer, opened at first use.

    Args:
        group: The group.
        objects: The group's object calls, which carry the offers over its CPU group.
        book: The group's call bookkeeping (whether a waited-for peer is gone).
    """

    def __init__(self, group: GroupView, objects: ObjectChannel, book: CallBook) -> None:
        self._group = group
        self._objects = objects
        self._book = book
        self._lock = threading.Lock()
        self._settled: dict[tuple[str, int], Any] = {}
        self._queues: list[MessageQueue] = []  # settled or settling: shutdown reaches both
        self._broken: dict[tuple[str, int], tuple[str, bool]] = {}
        self._closed = False
        env_flag(ENABLE_ENV, True)  # a bad GROUPCOORD_P2P_SHM raises when the group is made

    def sender(self, dst: int, op: str = "send_tensor_dict") -> MessageQueue | None:
        """The link to group rank ``dst``, or None for the CPU group (settles on first
        use; ``op``, the call settling it, is named in errors)."""
        return self._link(SEND, dst, op)

    def receiver(self, src: int, op: str = "recv_tensor_dict") -> MessageQueue | None:
        """The link from group rank ``src``, or None for the CPU group (settles on
        first use; ``op``, the call settling it, is named in errors)."""
        return self._link(RECV, src, op)

    def settled(self, direction: str, peer: int) -> MessageQueue | None:
        """The link of one direction if it has settled on one, else None (unsettled
        or on the CPU group); never settles (:mod:`coordinator.p2p.link_tensors`).

        Raises:
            ClosedError: The direction's link was closed after a failed dict.
        """
        got = self._settled.get((direction, peer))
        if got is None or got is _CPU_GROUP:
            return None
        if self._broken:
            self._check_broken(direction, peer)
        link: MessageQueue = got  # neither unsettled nor _CPU_GROUP
        return link

    def on_link(self, direction: str, peer: int) -> bool:
        """Whether one direction has settled on a link (a closed one included);
        never settles nor raises."""
        got = self._settled.get((direction, peer))
        return got is not None and got is not _CPU_GROUP

    def _link(self, direction: str, peer: int, op: str) -> MessageQueue | None:
        if self._group.device.type != "cpu":
            return None
        got = self._settled.get((direction, peer))
        if self._broken:
            self._check_broken(direction, peer)
        if got is None:
            got = self._offer(peer, op) if direction == SEND else self._accept(peer, op)
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
    def _offer(self, dst: int, op: str) -> Any:
        q = self._open_writer(dst)
        try:
            self._objects.send(link_offer.offer(
                q.export_handle().to_bytes() if q is not None else None), dst, LINK_OFFER)
            if q is not None:
                self._wait_ready(q, dst, op)
        except Exception:
            self._drop(q)
            if self._closed:  # the group was destroyed while this call waited (gloo's error)
                raise self._closed_error() from None
            raise
        except BaseException:
            self._drop(q)
            raise
        return self._keep(SEND, dst, q)

    def _accept(self, src: int, op: str) -> Any:
        try:
            got = self._objects.recv(src, LINK_OFFER)
        except Exception:
            if self._closed:  # the group was destroyed while this call waited (gloo's error)
                raise self._closed_error() from None
            raise
        handle = link_offer.check_offer(got, self._group, src, self._book.errors.pids[src])
        if handle is None:
            return self._keep(RECV, src, None)
        q = self._attach(handle, src, op)
        try:
            q.default_timeout = self._group.timeout
            self._register(q)
            self._wait_ready(q, src, op)
        except GroupCoordError:
            self._drop(q)
            if self._closed:
                raise self._closed_error() from None
            raise
        except Exception as e:  # what a crafted handle can still provoke (zmq, sizes)
            self._drop(q)
            raise self._unopened(src, e, op) from e
        return self._keep(RECV, src, q)

    def _attach(self, handle: Any, src: int, op: str) -> MessageQueue:
        """The reader of the link ``handle`` (an accepted offer) describes.

        Raises:
            PeerDiedError: ``src`` died since it offered (its ring is gone).
            DecodeError: The link does not open: whatever the queue raised (a
                ring gone or already read by another reader, as a replayed
                offer's is, a socket that does not connect) is the sender's doing.
        """
        from shm_broadcast.queue.message_queue import MessageQueue

        g = self._group
        try:
            return MessageQueue.create_from_handle(handle, g.rank_in_group,
                                                   allow_pickle=g.allow_pickle,
                                                   resizable_tensors=True)
        except Exception as e:
            dead = self._book.dead_partner(op, src)
            raise (dead or self._unopened(src, e, op)) from e

    def _unopened(self, src: int, e: BaseException, op: str) -> DecodeError:
        return DecodeError(f"group {self._group.unique_name!r}: {op} from rank "
                           f"{src}: its link does not open ({type(e).__name__}: {e})",
                           peers=(src,))

    def _wait_ready(self, q: MessageQueue, peer: int, op: str) -> None:
        """``q.wait_until_ready`` within the group's timeout, in slices between
        which a peer whose process is gone ends the wait (``PeerDiedError``)."""
        end = time.monotonic() + self._group.timeout
        while True:
            try:
                q.wait_until_ready(max(0.0, min(LIVENESS_S, end - time.monotonic())))
                return
            except CommTimeout:
                dead = self._book.dead_partner(op, peer)
                if dead is not None:
                    raise dead from None
                if time.monotonic() >= end:
                    raise

    def break_direction(self, direction: str, peer: int, error: BaseException) -> None:
        """Close one direction's link after a call failed partway through it or timed
        out: the link's order is lost, so later calls there raise ``ClosedError``
        (``PeerDiedError`` when ``error`` was the peer's death), and the peer's
        wait on it ends with ``ClosedError`` too."""
        with self._lock:
            self._broken[(direction, peer)] = (f"{type(error).__name__}: {error}"[:300],
                                               isinstance(error, PeerDiedError))
            q = self._settled.get((direction, peer))
        if q is not None and q is not _CPU_GROUP:
            q.shutdown()

    def _check_broken(self, direction: str, peer: int) -> None:
        got = self._broken.get((direction, peer))
        if got is not None:
            why, died = got
            side = "to" if direction == SEND else "from"
            if died:  # the same condition raises the same class: the peer is gone
                raise PeerDiedError(
                    f"group {self._group.unique_name!r}: the link {side} rank {peer} was "
                    f"closed when its peer died ({why})", peers=(peer,))
            raise ClosedError(
                f"group {self._group.unique_name!r}: the link {side} rank {peer} was closed "
                f"when an earlier call failed partway or timed out ({why}); destroy the group",
                peers=(peer,))

    def _open_writer(self, dst: int) -> MessageQueue | None:
        """A new link's writer, or None where the CPU group must carry the dicts."""
        g = self._group
        if not env_flag(ENABLE_ENV, True):
            return None
        if not g.comm.shares_memory_with(dst):
            return None
        from shm_broadcast.errors import SegmentError
        from shm_broadcast.queue.message_queue import MessageQueue

        try:
            q = MessageQueue(
                n_reader=1, n_local_reader=1, local_reader_ranks=[dst],
                max_chunk_bytes=CHUNK_BYTES, max_chunks=CHUNKS,
                name=f"{g.unique_name}-p2p-{g.rank_in_group}to{dst}",
                writer_rank=g.rank_in_group, allow_pickle=g.allow_pickle,
            )
        except SegmentError as e:  # /dev/shm full or unusable: the CPU group still works
            logger.warning("group %r: tensor dicts to rank %d go over the CPU group: %s",
                           g.unique_name, dst, e)
            return None
        q.default_timeout = g.timeout
        self._register(q)
        return q

    def _register(self, q: MessageQueue) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._queues.append(q)
        if closed:
            q.close()
            raise self._closed_error()

    def _keep(self, direction: str, peer: int, q: MessageQueue | None) -> Any:
        with self._lock:
            closed = self._closed
            if not closed:
                self._settled[(direction, peer)] = q if q is not None else _CPU_GROUP
        if closed:
            self._drop(q)
            raise self._closed_error()
        return q if q is not None else _CPU_GROUP

    def _drop(self, q: MessageQueue | None) -> None:
        if q is None:
            return
        with self._lock:
            if q in self._queues:
                self._queues.remove(q)
        q.close()

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"group {self._group.unique_name!r} was destroyed")
