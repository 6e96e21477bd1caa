"""A group's object calls: ``broadcast_object(_list)``, and objects point to point.

Objects travel as msgspec (pickle only where the group opted in) through the
group's signed CPU communicator, so a rejected, skipped or mismatched call
raises on every rank (:mod:`coordinator.wire.object_comm`); a broadcast from
the writer of the group's message queue goes through the queue, each message
stamped with its collective call's number
(:mod:`coordinator.group.broadcast_stamps`).

:class:`ObjectCalls` owns what these calls keep between calls: the stamps of
queue messages this rank must skip, and the signed CPU communicator of a GPU
group (built at first use). It serves the other parts of the group too:
:meth:`ObjectCalls.broadcast_raw` carries a tensor dict's metadata,
:meth:`ObjectCalls.send` / :meth:`ObjectCalls.recv` a link offer or a dict's
metadata point to point.
"""

from __future__ import annotations

from time import monotonic
from typing import Any, Protocol

import torch
import torch.distributed as dist

from coordinator.calls.call_book import CallBook
from coordinator.calls.group_view import GroupView
from coordinator.calls.peers import check_peer
from coordinator.errors import CollectiveMismatch, CommTimeout
from coordinator.group import broadcast_stamps as stamps
from coordinator.wire import object_comm
from coordinator.wire.object_comm import SERIALIZE_ERRORS, SourceFailure
from device_comms import DeviceCommunicator, TorchDistributedCommunicator, validation
from shm_broadcast.codec.message_codec import Codec

__all__ = ["ObjectCalls", "ObjectGroup"]


class ObjectGroup(GroupView, Protocol):
    """What the object calls use of their group."""

    @property
    def codec(self) -> Codec | object_comm.ObjectCodec: ...
    @property
    def mq_broadcaster(self) -> Any: ...
    @property
    def mq_writer_rank(self) -> int: ...


class ObjectCalls:
    """The object calls of one group (see the module docstring).

    Args:
        group: The group.
        book: The group's call bookkeeping (numbers, closed state, explanations).
    """

    def __init__(self, group: ObjectGroup, book: CallBook) -> None:
        self._group = group
        self._book = book
        #: Collective numbers whose queue message this rank must skip: it
        #: rejected its own arguments to those calls and read nothing.
        self._skipped_stamps: set[int] = set()
        self._cpu_side: DeviceCommunicator | None = None

    # ------------------------------------------------------------------ broadcasts
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``GroupCoordinator.broadcast_object``: ``obj`` from ``src`` to every rank."""
        book, g = self._book, self._group
        n = book.begin("broadcast_object")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            entry = book.record("broadcast_object", transport=(
                "queue" if g.mq_broadcaster is not None and src == g.mq_writer_rank else None),
                root=src)
            started = monotonic()
            try:
                got = self._broadcast_object(obj, src)
            except BaseException as e:
                book.failed("broadcast_object", seq, e, entry, writer=g.mq_writer_rank,
                            started=started)
                raise
            book.completed(entry)
            return got
        finally:
            book.end()

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        g = self._group
        try:
            src = validation.check_rank(src, g.world_size, "src")
        except (TypeError, ValueError) as e:
            self.reject_broadcast("broadcast_object", e)
            raise
        if g.world_size == 1:
            self._book.check_live("broadcast_object")
            return obj
        if g.rank_in_group == src:
            try:
                return self.broadcast_raw(obj, src)
            except SERIALIZE_ERRORS as e:
                self.broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src)
                raise TypeError(
                    f"broadcast_object on group {g.unique_name!r}: obj of type "
                    f"{type(obj).__name__} cannot be serialised ({type(e).__name__}: {e})"
                ) from e
        got = self.broadcast_raw(None, src)
        if isinstance(got, SourceFailure):
            raise CollectiveMismatch(
                f"broadcast_object on group {g.unique_name!r}: the source rank {src} could "
                f"not send its object ({got.message}); fix the call on rank {src}",
                queue=g.unique_name, peers=(src,),
            )
        return got

    def broadcast_object_list(self, obj_list: list[Any], src: int,
                              group: dist.ProcessGroup | None) -> list[Any]:
        """``GroupCoordinator.broadcast_object_list``: ``obj_list`` filled in place from ``src``."""
        return self._book.run("broadcast_object_list", self._broadcast_object_list, obj_list,
                              src, group, transport=None if group is None else "gloo", root=src)

    def _broadcast_object_list(self, obj_list: list[Any], src: int,
                               group: dist.ProcessGroup | None) -> list[Any]:
        g, op = self._group, "broadcast_object_list"
        validation.check_group(group, "group", allow_none=True)
        try:
            if not isinstance(obj_list, list):
                raise TypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
            src = validation.check_rank(src, g.world_size, "src")
        except (TypeError, ValueError) as e:
            if group is None:  # plain gloo broadcasts over a group cannot carry the news
                self.reject_broadcast(op, e, queue=False)
            raise
        if g.world_size == 1:
            self._book.check_live(op)
            return obj_list
        if g.rank_in_group == src:
            try:
                self.broadcast_raw(list(obj_list), src, group, op, queue=False)
            except SERIALIZE_ERRORS as e:  # nothing was sent: tell the receivers instead
                self.broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src, group, op,
                                   queue=False)
                raise TypeError(
                    f"broadcast_object_list on group {g.unique_name!r}: an entry of "
                    f"obj_list cannot be serialised ({type(e).__name__}: {e})"
                ) from e
            return obj_list
        got = self.broadcast_raw(None, src, group, op, queue=False)
        why = _list_mismatch(got, len(obj_list))
        if why is not None:
            whose = (f"the source rank {src} could not send its objects ({why}); fix the call "
                     f"on rank {src}" if isinstance(got, SourceFailure) else
                     f"the lists differ ({why}); pass obj_list of the same length on every rank")
            raise CollectiveMismatch(
                f"broadcast_object_list on group {g.unique_name!r}: {whose}",
                queue=g.unique_name, peers=(src,),
            )
        obj_list[:] = got
        return obj_list

    def broadcast_raw(self, obj: Any, src: int, group: dist.ProcessGroup | None = None,
                      op: str = "broadcast_object", queue: bool = True) -> Any:
        """One object from ``src`` to all, unchecked (not a call of its own).

        Through the message queue when ``queue``, ``group`` is None and ``src``
        is its writer (the message carries this collective call's number, see
        :mod:`coordinator.group.broadcast_stamps`); else as bytes through this
        group's signed CPU communicator (``group`` None), or as plain gloo
        broadcasts over ``group``.
        """
        g = self._group
        self._book.check_live(op)
        mq = g.mq_broadcaster  # the group's timeout is its default
        if queue and group is None and mq is not None and src == g.mq_writer_rank:
            return self._queue_broadcast(mq, obj, src, op)
        if group is None:
            bcast = object_comm.comm_broadcast(self._cpu_comm(), src)
        else:
            bcast = object_comm.gloo_broadcast(g.ranks[src], group)
        is_src = g.rank_in_group == src
        return object_comm.broadcast_object(obj if is_src else None, src, bcast,
                                            g.codec, is_src, op)

    def _queue_broadcast(self, mq: Any, obj: Any, src: int, op: str) -> Any:
        """The queue's side of :meth:`broadcast_raw`: a stamped message."""
        g, book = self._group, self._book
        if g.rank_in_group == src:
            mq.broadcast_object(stamps.stamp(obj, book.collectives, op))
            return obj
        try:
            msg = mq.broadcast_object(None)
            while self._stale(msg):
                msg = mq.broadcast_object(None)
        except CommTimeout:  # this call's message, if it comes, is read by nobody
            self._skipped_stamps.add(book.collectives)
            raise
        return stamps.unstamp(msg, book.collectives, op, g.unique_name, src, book.calls)

    def reject_broadcast(self, op: str, error: BaseException, queue: bool = True) -> None:
        """This rank rejected its own arguments to broadcast ``op``: let the peers know.

        The peers broadcast either through the group's message queue (their
        ``src`` is its writer) or through the CPU communicator. On the queue, a
        writer sends a failure marker (receivers raise ``CollectiveMismatch``)
        and a reader marks the call's message to be skipped at its next read;
        otherwise the rank takes part in the communicator's broadcast as a
        rejecting rank (receivers raise ``PeerRejectedError``). A reader cannot
        know which way its peers went: if they used the communicator while the
        group has a queue, they wait for this rank until the group's timeout.
        """
        g = self._group
        if g.world_size == 1:
            return
        if queue and g.mq_broadcaster is not None:
            if g.rank_in_group == g.mq_writer_rank:
                g.mq_broadcaster.broadcast_object(stamps.stamp(
                    SourceFailure(f"{type(error).__name__}: {error}"), self._book.collectives,
                    op))
            else:
                self._skipped_stamps.add(self._book.collectives)
            return
        self._cpu_comm().reject("broadcast", error)

    def _stale(self, msg: Any) -> bool:
        """Whether a queue message belongs to an earlier call nobody here reads:
        one this rank rejected, or a writer's failure marker for a call this rank
        made through the communicator (see :meth:`reject_broadcast`)."""
        n = stamps.number_of(msg)
        if n is None:
            return False
        if n in self._skipped_stamps:
            self._skipped_stamps.discard(n)
            return True
        return n < self._book.collectives and isinstance(msg[2], SourceFailure)

    def _cpu_comm(self) -> DeviceCommunicator:
        """The communicator that carries this group's CPU bytes (objects, metadata):
        the device communicator on a CPU group, else a signed gloo one over
        ``cpu_group``, built at first use."""
        g = self._group
        if g.device.type == "cpu":
            return g.comm
        if self._cpu_side is None:
            side = TorchDistributedCommunicator(g.cpu_group, torch.device("cpu"), g.cpu_group,
                                                g.unique_name, timeout=g.timeout)
            book = self._book
            side.number_calls(lambda: book.collectives)
            self._cpu_side = side
        return self._cpu_side

    # ------------------------------------------------------------------ CPU tensors
    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum the CPU ``tensor`` across the group in place, through the
        communicator that carries the group's CPU bytes; returns ``tensor``."""
        comm = self._cpu_comm()
        problem: Exception | None = None
        if not isinstance(tensor, torch.Tensor):
            problem = TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        elif tensor.device.type != "cpu":
            problem = ValueError(f"tensor must be a CPU tensor, got one on {tensor.device}")
        if problem is not None:
            comm.reject("all_reduce", problem)  # the peers raise instead of waiting
            raise problem
        if not tensor.is_contiguous():
            tensor.copy_(comm.all_reduce(tensor))
            return tensor
        return comm.all_reduce(tensor, out=tensor)  # its checks name what else is wrong

    # ------------------------------------------------------------------ point to point
    def send(self, obj: Any, dst: int, kind: int = object_comm.OBJECT) -> None:
        """Send ``obj`` to group rank ``dst``, not counted as a call (``send_object``
        and the calls built on it count themselves; ``kind``: see
        :mod:`coordinator.wire.object_comm`).

        Raises:
            TypeError: ``obj`` cannot be encoded; the receiver is told and raises
                ``CollectiveMismatch``.
        """
        g = self._group
        dst = check_peer(dst, "dst", g.world_size, g.rank_in_group)
        self._book.check_live("send_object")
        object_comm.send_object(obj, g.ranks[dst], g.cpu_group, g.codec, kind)

    def recv(self, src: int, kind: int = object_comm.OBJECT) -> Any:
        """Receive an object from group rank ``src``, not counted as a call (see :meth:`send`).

        Raises:
            CollectiveMismatch: The sender could not encode its object, or sent
                another kind.
            DecodeError: The bytes received are malformed.
        """
        g = self._group
        src = check_peer(src, "src", g.world_size, g.rank_in_group)
        self._book.check_live("recv_object")
        return object_comm.recv_object(g.ranks[src], g.cpu_group, g.codec, kind, src)

    def send_failure(self, op: str, reason: str, dst: int, kind: int) -> None:
        """Send ``reason`` where group rank ``dst`` waits for an object of ``kind`` (its
        receive raises ``CollectiveMismatch`` quoting it); ``op``: the call failing."""
        g = self._group
        self._book.check_live(op)
        object_comm.send_failure(reason, g.ranks[dst], g.cpu_group, kind)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Release the CPU-side communicator, if one was built."""
        side, self._cpu_side = self._cpu_side, None
        if side is not None:
            side.destroy()


def _list_mismatch(got: Any, n: int) -> str | None:
    """Why a received object list cannot fill a receiver's list of ``n`` (None: it can)."""
    if isinstance(got, SourceFailure):
        return got.message
    if type(got) is not list:
        return f"it sent a {type(got).__name__}, not a list"
    if len(got) != n:
        return f"it sent {len(got)} objects, this rank's obj_list has {n}"
    return None
