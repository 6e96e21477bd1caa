"""Object calls of :class:`~coordinator.group.group_coordinator.GroupCoordinator`:
``broadcast_object(_list)``, ``send_object``, ``recv_object``.

Objects travel as msgspec (pickle only where the group opted in) through the
group's signed CPU communicator, so a rejected, skipped or mismatched call
raises on every rank (:mod:`coordinator.group.object_comm`,
:mod:`coordinator.group.broadcast_stamps`). A mixin: the coordinator provides the
group state and the call machinery (``_run``, ``_cpu_call``, ``_check_peer``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from coordinator.errors import CollectiveMismatch, CommTimeout
from coordinator.group import broadcast_stamps as stamps
from coordinator.group import object_comm
from coordinator.group.call_errors import WAIT_ERRORS, CallErrors, peer_rank
from coordinator.group.object_comm import SERIALIZE_ERRORS, SourceFailure
from coordinator.p2p import async_p2p
from coordinator.p2p.async_p2p import RECV, SEND
from device_comms import DeviceCommunicator, TorchDistributedCommunicator, validation
from shm_broadcast.codec.message_codec import Codec

__all__ = ["GroupObjectCalls"]


class GroupObjectCalls:
    """The object calls of a group (mixed into ``GroupCoordinator``)."""

    unique_name: str
    rank_in_group: int
    world_size: int
    ranks: list[int]
    timeout: float
    codec: Codec
    cpu_group: Any
    calls: int
    _errors: CallErrors

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Broadcast a Python object from ``src``; returns it on every rank.

        Uses the message queue when the group has one and ``src`` is its
        writer, else broadcasts of the group's CPU communicator (signed calls:
        a rank making another call there raises ``CollectiveMismatch`` on
        every rank). Either way the object travels as msgspec
        msgpack with tensors and arrays out of band (see
        :mod:`shm_broadcast.codec.message_codec` for what is carried exactly); nothing is
        pickled unless the group was created with ``allow_pickle=True``.

        Raises:
            TypeError: On ``src``: ``obj`` cannot be encoded (the message names
                the type and the ``allow_pickle`` opt-in). The other ranks are
                told and raise ``CollectiveMismatch`` instead of waiting forever.
            DecodeError: On a receiver: the bytes received are malformed.
        """
        self.calls = seq = self.calls + 1
        started = time.monotonic()
        self.collectives += 1
        try:
            return self._broadcast_object(obj, src)
        except WAIT_ERRORS as e:
            self._errors.explain("broadcast_object", seq, e, writer=self.mq_writer_rank,
                                 started=started)
            raise

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        try:
            validation.check_rank(src, self.world_size, "src")
        except (TypeError, ValueError) as e:
            self._reject_broadcast("broadcast_object", e)
            raise
        if self.world_size == 1:
            return obj
        if self.rank_in_group == src:
            try:
                return self._broadcast_raw(obj, src)
            except SERIALIZE_ERRORS as e:
                self._broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src)
                raise TypeError(
                    f"broadcast_object on group {self.unique_name!r}: obj of type "
                    f"{type(obj).__name__} cannot be serialised ({type(e).__name__}: {e})"
                ) from e
        got = self._broadcast_raw(None, src)
        if isinstance(got, SourceFailure):
            raise CollectiveMismatch(
                f"broadcast_object on group {self.unique_name!r}: the source rank {src} could "
                f"not send its object ({got.message}); fix the call on rank {src}",
                queue=self.unique_name, peers=(src,),
            )
        return got

    def _broadcast_raw(self, obj: Any, src: int, group: dist.ProcessGroup | None = None,
                       op: str = "broadcast_object", queue: bool = True) -> Any:
        """One object from ``src`` to all, unchecked.

        Through the message queue when ``queue``, ``group`` is None and ``src``
        is its writer (the message carries this collective call's number, see
        :mod:`coordinator.group.broadcast_stamps`); else as bytes through this
        group's signed CPU communicator (``group`` None), or as plain gloo
        broadcasts over ``group``.
        """
        if (queue and group is None and self.mq_broadcaster is not None
                and src == self.mq_writer_rank):
            self._check_live(op)
            mq = self.mq_broadcaster  # the group's timeout is its default
            if self.rank_in_group == src:
                mq.broadcast_object(stamps.stamp(obj, self.collectives, op))
                return obj
            try:
                msg = mq.broadcast_object(None)
                while self._stale(msg):
                    msg = mq.broadcast_object(None)
            except CommTimeout:  # this call's message, if it comes, is read by nobody
                self._skipped_stamps.add(self.collectives)
                raise
            return stamps.unstamp(msg, self.collectives, op, self.unique_name, src, self.calls)
        self._check_live(op)
        if group is None:
            bcast = object_comm.comm_broadcast(self._cpu_comm(), src)
        else:
            bcast = object_comm.gloo_broadcast(self.ranks[src], group)
        is_src = self.rank_in_group == src
        return object_comm.broadcast_object(obj if is_src else None, src, bcast,
                                            self.codec, is_src, op)

    def _reject_broadcast(self, op: str, error: BaseException, queue: bool = True) -> None:
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
        if self.world_size == 1:
            return
        if queue and self.mq_broadcaster is not None:
            if self.rank_in_group == self.mq_writer_rank:
                self.mq_broadcaster.broadcast_object(stamps.stamp(
                    SourceFailure(f"{type(error).__name__}: {error}"), self.collectives, op))
            else:
                self._skipped_stamps.add(self.collectives)
            return
        self._cpu_comm().reject("broadcast", error)

    def _stale(self, msg: Any) -> bool:
        """Whether a queue message belongs to an earlier call nobody here reads:
        one this rank rejected, or a writer's failure marker for a call this rank
        made through the communicator (see :meth:`_reject_broadcast`)."""
        n = stamps.number_of(msg)
        if n is None:
            return False
        if n in self._skipped_stamps:
            self._skipped_stamps.discard(n)
            return True
        return n < self.collectives and isinstance(msg[2], SourceFailure)

    def _cpu_comm(self) -> DeviceCommunicator:
        """The communicator that carries this group's CPU bytes (objects, metadata):
        the device communicator on a CPU group, else a signed gloo one over
        ``cpu_group``, built at first use."""
        if self.device.type == "cpu":
            return self.comm
        if self._cpu_side is None:
            self._cpu_side = TorchDistributedCommunicator(
                self.cpu_group, torch.device("cpu"), self.cpu_group, self.unique_name,
                timeout=self.timeout)
            self._cpu_side.number_calls(lambda: self.collectives)
        return self._cpu_side

    def broadcast_object_list(
        self, obj_list: list[Any], src: int = 0, group: dist.ProcessGroup | None = None
    ) -> list[Any]:
        """Broadcast a list of objects in place (like ``torch.distributed``, without pickle).

        The list travels as one message through the group's CPU communicator
        (signed calls, as :meth:`broadcast_object`), or as plain gloo
        broadcasts over ``group`` when given; receivers pass a list of the
        same length, whose items are replaced.

        Raises:
            TypeError: On ``src``: an entry cannot be encoded (receivers raise
                ``CollectiveMismatch``); ``obj_list`` is not a list.
            CollectiveMismatch: On a receiver: the source failed, or sent a
                list of another length.
        """
        return self._run("broadcast_object_list", self._broadcast_object_list, obj_list, src,
                         group)

    def _broadcast_object_list(self, obj_list: list[Any], src: int,
                               group: dist.ProcessGroup | None) -> list[Any]:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch ProcessGroup or None, got {type(group).__name__}")
        try:
            if not isinstance(obj_list, list):
                raise TypeError(f"obj_list must be a list, got {type(obj_list).__name__}")
            validation.check_rank(src, self.world_size, "src")
        except (TypeError, ValueError) as e:
            if group is None:  # plain gloo broadcasts over a group cannot carry the news
                self._reject_broadcast("broadcast_object_list", e, queue=False)
            raise
        if self.world_size == 1:
            return obj_list
        op = "broadcast_object_list"
        if self.rank_in_group == src:
            try:
                self._broadcast_raw(list(obj_list), src, group, op, queue=False)
            except SERIALIZE_ERRORS as e:  # nothing was sent: tell the receivers instead
                self._broadcast_raw(SourceFailure(f"{type(e).__name__}: {e}"), src, group, op,
                                    queue=False)
                raise TypeError(
                    f"broadcast_object_list on group {self.unique_name!r}: an entry of "
                    f"obj_list cannot be serialised ({type(e).__name__}: {e})"
                ) from e
            return obj_list
        got = self._broadcast_raw(None, src, group, op, queue=False)
        why = _list_mismatch(got, len(obj_list))
        if why is not None:
            whose = (f"the source rank {src} could not send its objects ({why}); fix the call "
                     f"on rank {src}" if isinstance(got, SourceFailure) else
                     f"the lists differ ({why}); pass obj_list of the same length on every rank")
            raise CollectiveMismatch(
                f"broadcast_object_list on group {self.unique_name!r}: {whose}",
                queue=self.unique_name, peers=(src,),
            )
        obj_list[:] = got
        return obj_list

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a Python object to group rank ``dst`` over the CPU group (no pickle
        unless the group opted in; see :meth:`broadcast_object`).

        Raises:
            TypeError: ``obj`` cannot be encoded; the receiver is told and raises
                ``CollectiveMismatch``.
        """
        self._run("send_object", async_p2p.ordered, self, SEND, dst, "send_object",
                  self._send_object, obj, dst, partner=peer_rank(dst), p2p=True)

    def _send_object(self, obj: Any, dst: int, kind: int = object_comm.OBJECT) -> None:
        """:meth:`send_object` without counting a call (for calls built on it; ``kind``:
        see :mod:`coordinator.group.object_comm`)."""
        self._check_peer(dst, "dst")
        self._cpu_call("send_object", object_comm.send_object, obj, self.ranks[dst],
                       self.cpu_group, self.codec, kind)

    def recv_object(self, src: int) -> Any:
        """Receive a Python object from group rank ``src``.

        Raises:
            CollectiveMismatch: The sender could not encode its object.
            DecodeError: The bytes received are malformed.
        """
        return self._run("recv_object", async_p2p.ordered, self, RECV, src, "recv_object",
                         self._recv_object, src, partner=peer_rank(src), p2p=True)

    def _recv_object(self, src: int, kind: int = object_comm.OBJECT) -> Any:
        """:meth:`recv_object` without counting a call (for calls built on it; ``kind``:
        see :mod:`coordinator.group.object_comm`)."""
        self._check_peer(src, "src")
        return self._cpu_call("recv_object", object_comm.recv_object, self.ranks[src],
                              self.cpu_group, self.codec, kind, src)


def _list_mismatch(got: Any, n: int) -> str | None:
    """Why a received object list cannot fill a receiver's list of ``n`` (None: it can)."""
    if isinstance(got, SourceFailure):
        return got.message
    if type(got) is not list:
        return f"it sent a {type(got).__name__}, not a list"
    if len(got) != n:
        return f"it sent {len(got)} objects, this rank's obj_list has {n}"
    return None
