"""A group's tensor-dict calls: ``broadcast_tensor_dict``, ``send/recv_tensor_dict`` and
their asynchronous forms.

A dict travels as its metadata and payload
(:mod:`coordinator.wire.tensor_dict_format`). Payload routing:

* the message queue (when the group has one and ``src`` is its writer) carries
  the metadata, and CPU tensors travel inside the same message, out of band;
* ``send_tensor_dict`` between two ranks of a host on a CPU group: the
  direction's shared-memory link carries metadata and tensors as one message
  (:mod:`coordinator.p2p.shm_links`, :mod:`coordinator.p2p.link_messages`);
* otherwise metadata travels once over the CPU group, and each non-empty
  tensor follows: tensors on the group's device through the device
  communicator, CPU tensors (on a GPU group) over the CPU group.

Receivers allocate their own tensors. Empty tensors send no payload.

Pipeline sends can use the all-gather optimisation: when the tensor is
replicated across an ``all_gather_group`` (say the TP group) of ``n`` ranks, each
sender sends only its ``1/n`` slice and the receiving TP ranks rebuild the
whole tensor with one all-gather among themselves.

Point-to-point dicts keep the group's point-to-point order and run
asynchronously on its channels (:mod:`coordinator.p2p.point_to_point`). An
asynchronous receive with an ``all_gather_group`` receives the slices on the
channel and rebuilds the tensors there too, trading slices point to point with
the other ranks of that group (:func:`exchange_slices`: an all-gather on the
worker would take a place among that group's collectives that depends on
timing). A CUDA group's receive leaves the all-gathers to the handle's first
``wait()`` (:mod:`coordinator.p2p.handle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from time import monotonic
from typing import Any, Protocol

import torch
import torch.distributed as dist

from coordinator.calls.call_book import CallBook
from coordinator.calls.group_view import GroupView
from coordinator.calls.peers import check_peer, note_untold
from coordinator.errors import CollectiveMismatch, GroupCoordError
from coordinator.group.object_calls import ObjectCalls
from coordinator.p2p import link_messages
from coordinator.p2p.channels import RECV, SEND
from coordinator.p2p.handle import P2PHandle
from coordinator.p2p.point_to_point import PointToPoint
from coordinator.wire import object_comm
from coordinator.wire.object_comm import SERIALIZE_ERRORS, SourceFailure
from coordinator.wire.tensor_dict_format import (
    INLINE,
    TENSOR,
    AllGatherGroup,
    SlicedDict,
    alloc,
    check_metadata,
    dtype_of,
    flatten_tensor_dict,
    own_slices,
    plain,
    rebuild_slices,
    snapshot,
)
from device_comms import validation
from device_comms.torch_dist.torch_communicator import wire_view
from device_comms.validation import dense

__all__ = ["TensorDictCalls", "DictGroup", "AllGatherGroup", "slicing_plan"]


class DictGroup(GroupView, Protocol):
    """What the tensor-dict calls use of their group."""

    @property
    def mq_broadcaster(self) -> Any: ...
    @property
    def mq_writer_rank(self) -> int: ...


class TensorDictCalls:
    """The tensor-dict calls of one group (see the module docstring).

    Args:
        group: The group.
        book: The group's call bookkeeping (numbers, closed state, explanations).
        objects: The group's object calls (metadata broadcasts, metadata point to point).
        p2p: The group's point-to-point calls (order, channels, links).
        group_class: The class an ``all_gather_group`` must be an instance of
            (the group's own class).
    """

    def __init__(self, group: DictGroup, book: CallBook, objects: ObjectCalls,
                 p2p: PointToPoint, group_class: type[AllGatherGroup]) -> None:
        self._group = group
        self._book = book
        self._objects = objects
        self._p2p = p2p
        self._group_class = group_class

    # ------------------------------------------------------------------ broadcast
    def broadcast_tensor_dict(self, tensor_dict: Mapping[Any, Any] | None, src: int,
                              group: dist.ProcessGroup | None,
                              metadata_group: dist.ProcessGroup | None) -> dict[Any, Any] | None:
        """``GroupCoordinator.broadcast_tensor_dict``: ``src``'s dict to every rank."""
        book, g = self._book, self._group
        n = book.begin("broadcast_tensor_dict")  # the group's token, then the number
        try:
            seq = n + book.p2p_calls
            entry = book.record("broadcast_tensor_dict",
                                transport=_broadcast_transport(g, src, group, metadata_group),
                                root=src)
            started = monotonic()
            try:
                got = self._broadcast_checked(tensor_dict, src, group, metadata_group)
            except BaseException as e:
                book.failed("broadcast_tensor_dict", seq, e, entry, writer=g.mq_writer_rank,
                            started=started)
                raise
            book.completed(entry)
            return got
        finally:
            book.end()

    def _broadcast_checked(self, tensor_dict: Mapping[Any, Any] | None, src: int,
                           group: dist.ProcessGroup | None,
                           metadata_group: dist.ProcessGroup | None) -> dict[Any, Any] | None:
        g = self._group
        validation.check_group(group, "group", allow_none=True)
        validation.check_group(metadata_group, "metadata_group", allow_none=True)
        try:
            src = validation.check_rank(src, g.world_size, "src")
        except (TypeError, ValueError) as e:
            if group is None and metadata_group is None:  # plain gloo cannot carry the news
                self._objects.reject_broadcast("broadcast_tensor_dict", e)
            raise
        if g.rank_in_group != src:
            return self._broadcast_received(src, group, metadata_group)
        if not isinstance(tensor_dict, Mapping):
            err = TypeError(f"tensor_dict must be a dict on src, got {type(tensor_dict).__name__}")
            if g.world_size > 1:  # the receivers are waiting: make them raise too
                self._abort_broadcast(src, group, metadata_group, str(err))
            raise err
        if g.world_size == 1:
            self._book.check_live("broadcast_tensor_dict")
            return dict(tensor_dict)
        return self._broadcast_from_here(tensor_dict, src, group, metadata_group)

    def _broadcast_from_here(self, tensor_dict: Mapping[Any, Any], src: int,
                             group: dist.ProcessGroup | None,
                             metadata_group: dist.ProcessGroup | None) -> dict[Any, Any]:
        """The source's side: metadata, then each non-empty tensor."""
        g = self._group
        overrides = group is not None or metadata_group is not None
        use_mq = not overrides and g.mq_broadcaster is not None and src == g.mq_writer_rank
        try:
            meta, payload = flatten_tensor_dict(tensor_dict, inline_cpu=use_mq, device=g.device)
        except (TypeError, ValueError) as e:
            self._abort_broadcast(src, group, metadata_group, str(e))
            raise
        try:
            self._broadcast_meta(meta, src, group, metadata_group)
        except SERIALIZE_ERRORS as e:
            self._abort_broadcast(src, group, metadata_group, f"{type(e).__name__}: {e}")
            raise TypeError(
                f"broadcast_tensor_dict on group {g.unique_name!r}: tensor_dict holds a value "
                f"that cannot be serialised ({type(e).__name__}: {e})"
            ) from e
        for t in payload:
            if t.numel():
                self._broadcast_tensor(dense(t), src, group, metadata_group)
        return dict(tensor_dict)

    def _broadcast_received(self, src: int, group: dist.ProcessGroup | None,
                            metadata_group: dist.ProcessGroup | None) -> dict[Any, Any]:
        """A receiver's side: the metadata, checked, then a new tensor per entry."""
        g = self._group
        meta = self._broadcast_meta(None, src, group, metadata_group)
        if isinstance(meta, SourceFailure):
            raise CollectiveMismatch(
                f"broadcast_tensor_dict on group {g.unique_name!r}: the source rank {src} "
                f"rejected its input ({meta.message}); fix the call on rank {src}",
                queue=g.unique_name, peers=(src,),
            )
        check_metadata(meta, g.device.type, src)
        out: dict[Any, Any] = {}
        for key, kind, value in meta:
            if kind == TENSOR:
                t = alloc(value, g.device)
                if t.numel():
                    self._broadcast_tensor(t, src, group, metadata_group)
                out[key] = t
            elif kind == INLINE:
                out[key] = plain(value)
            else:
                out[key] = value
        return out

    def _abort_broadcast(self, src: int, group: dist.ProcessGroup | None,
                         metadata_group: dist.ProcessGroup | None, message: str) -> None:
        """On ``src``: send an error marker where receivers expect metadata, so they
        raise instead of waiting for a broadcast that will never come."""
        self._broadcast_meta(SourceFailure(message), src, group, metadata_group)

    def _broadcast_meta(self, obj: Any, src: int, group: dist.ProcessGroup | None,
                        metadata_group: dist.ProcessGroup | None) -> Any:
        """Broadcast the metadata object (no failure checks; callers do them).

        Through the group's message queue or as codec bytes over the CPU group
        (``metadata_group`` when given); never pickled unless the group opted in.
        """
        if group is not None or metadata_group is not None:
            return self._objects.broadcast_raw(obj, src, metadata_group or self._group.cpu_group,
                                               op="broadcast_tensor_dict")
        return self._objects.broadcast_raw(obj, src, op="broadcast_tensor_dict")

    def _broadcast_tensor(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None,
                          metadata_group: dist.ProcessGroup | None) -> None:
        g = self._group
        on_cpu = t.device.type == "cpu"
        if group is not None or metadata_group is not None:
            pg = (metadata_group or g.cpu_group) if on_cpu else (group or g.device_group)
            dist.broadcast(wire_view(t), src=g.ranks[src], group=pg)
        elif t.device.type == g.device.type:
            g.comm.broadcast(t, src=src)
        else:  # CPU tensor in a GPU group: over the CPU group
            dist.broadcast(wire_view(t), src=g.ranks[src], group=g.cpu_group)

    # ------------------------------------------------------------------ point to point
    def send_tensor_dict(self, tensor_dict: Mapping[Any, Any], dst: int | None,
                         all_gather_group: Any, all_gather_tensors: Mapping[Any, bool] | None,
                         ) -> dict[Any, Any] | None:
        """``GroupCoordinator.send_tensor_dict``: ``tensor_dict`` to ``dst``, in its turn."""
        g = self._group
        if dst is None:
            dst = (g.rank_in_group + 1) % g.world_size
        dst = validation.check_rank(dst, g.world_size, "dst")
        if g.world_size == 1:
            self._book.check_live("send_tensor_dict")
            if not isinstance(tensor_dict, Mapping):
                raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
            self._check_all_gather_group(all_gather_group)
            return tensor_dict  # type: ignore[return-value]  # vLLM returns the dict itself
        check_peer(dst, "dst", g.world_size, g.rank_in_group)
        p2p = self._p2p
        self._book.run("send_tensor_dict", p2p.ordered, SEND, dst, "send_tensor_dict",
                       self._send, tensor_dict, dst, all_gather_group, all_gather_tensors,
                       partner=dst, p2p=True)
        return None

    def recv_tensor_dict(self, src: int | None, all_gather_group: Any) -> dict[Any, Any] | None:
        """``GroupCoordinator.recv_tensor_dict``: a dict from ``src``, in its turn."""
        g = self._group
        if src is None:
            src = (g.rank_in_group - 1) % g.world_size
        src = validation.check_rank(src, g.world_size, "src")
        if g.world_size == 1:
            self._book.check_live("recv_tensor_dict")
            self._check_all_gather_group(all_gather_group)
            return None
        check_peer(src, "src", g.world_size, g.rank_in_group)
        p2p = self._p2p
        got: dict[Any, Any] = self._book.run(  # what self._recv returns
            "recv_tensor_dict", p2p.ordered, RECV, src, "recv_tensor_dict",
            self._recv, src, all_gather_group, partner=src, p2p=True)
        return got

    def _check_all_gather_group(self, group: Any) -> AllGatherGroup | None:
        """``all_gather_group``: None or a group of this group's class.

        Raises:
            TypeError: Anything else.
        """
        if group is None or isinstance(group, self._group_class):
            return group
        raise TypeError(f"all_gather_group must be a {self._group_class.__name__}, got "
                        f"{type(group).__name__}")

    def _send(self, tensor_dict: Mapping[Any, Any], dst: int, all_gather_group: Any,
              all_gather_tensors: Mapping[Any, bool] | None) -> None:
        """Send a dict (not a call of its own: the caller numbers and orders it).

        A ``tensor_dict`` this rank cannot send (not a mapping, a meta or sparse
        tensor, a value the codec refuses) is reported to the receiver in place of
        the dict, as ``send`` reports its bad arguments: it raises instead of
        waiting for its timeout.
        """
        g = self._group
        try:
            if not isinstance(tensor_dict, Mapping):
                raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
            gather = self._check_all_gather_group(all_gather_group)
            n = gather.world_size if gather is not None else 1
            slicing = slicing_plan(tensor_dict, n, all_gather_tensors)
            meta, payload = flatten_tensor_dict(tensor_dict, slicing=slicing, parts=n,
                                                device=g.device)
        except (TypeError, ValueError) as e:
            self._reject_send(dst, e)
            raise
        if gather is not None:  # sliced: send only this rank's 1/n
            payload = own_slices(meta, payload, n, gather.rank_in_group)
        link = self._p2p.links.sender(dst)
        if link is not None:
            self._send_on_link(link, meta, payload, dst)
            return
        try:
            self._objects.send(meta, dst, object_comm.DICT_META)
        except TypeError as e:  # the receiver was told by the object send
            raise TypeError(
                f"send_tensor_dict on group {g.unique_name!r}: tensor_dict holds a value that "
                f"cannot be serialised ({e.__cause__ or e})"
            ) from e
        for t in payload:
            if t.numel():
                self._send_tensor(dense(t), dst)

    def _reject_send(self, dst: int, e: BaseException) -> None:
        """Send, in place of the dict ``dst`` waits for, why this rank's call failed:
        on the direction's link (settling it if this is its first call) the
        receiver raises ``PeerRejectedError``; on the CPU group, ``CollectiveMismatch``
        naming this rank. Failing to tell is noted on ``e``."""
        reason = f"{type(e).__name__}: {e}"
        try:
            link = self._p2p.links.sender(dst)
            if link is not None:
                link.enqueue(link_messages.rejection(reason))
            else:
                self._objects.send_failure("send_tensor_dict", reason, dst,
                                           object_comm.DICT_META)
        except (GroupCoordError, RuntimeError) as notify:
            note_untold(e, dst, self._group.unique_name, notify)

    def _send_on_link(self, link: Any, meta: list[list[Any]], payload: list[torch.Tensor],
                      dst: int) -> None:
        """The dict on its link; a value the codec refuses is reported to the receiver."""
        name, links = self._group.unique_name, self._p2p.links
        try:
            refusal = link_messages.send(link, meta, payload,
                                         lambda e: links.break_direction(SEND, dst, e))
        except SERIALIZE_ERRORS as e:  # encoding comes first: nothing was published
            link.enqueue(link_messages.failure(f"{type(e).__name__}: {e}"))
            raise TypeError(
                f"send_tensor_dict on group {name!r}: tensor_dict holds a value that "
                f"cannot be serialised ({type(e).__name__}: {e})"
            ) from e
        if refusal is not None:
            raise link_messages.refused(name, "send_tensor_dict", refusal, dst)

    def _recv(self, src: int, all_gather_group: Any,
              op: str = "recv_tensor_dict") -> dict[Any, Any]:
        """Receive a dict (not a call of its own: the caller numbers and orders it), its
        sliced tensors rebuilt by all-gathers over ``all_gather_group`` (``op``: the
        call, named by errors).

        A bad ``all_gather_group`` (not a group, or not the sender's kind) is
        raised after the dict has been received, so the sender's call completes
        and the direction stays in step.
        """
        try:
            gather = self._check_all_gather_group(all_gather_group)
            bad_group: TypeError | None = None
        except TypeError as e:
            gather, bad_group = None, e
        got, problem = self._recv_slices(src, gather, op)
        if bad_group is not None:
            raise bad_group
        if problem:
            raise ValueError(problem)
        return rebuild_slices(got, gather) if gather is not None else got.out

    def _recv_exchanged(self, src: int, gather: AllGatherGroup) -> dict[Any, Any]:
        """``irecv_tensor_dict`` with an ``all_gather_group`` on a CPU group, on the
        direction's worker: receive this rank's slices, then rebuild the tensors by
        trading slices with the other ranks of ``gather`` (:func:`exchange_slices`)."""
        got, problem = self._recv_slices(src, gather, "irecv_tensor_dict")
        if problem:
            raise ValueError(problem)
        return exchange_slices(got, gather)

    def _recv_slices(self, src: int, gather: AllGatherGroup | None,
                     op: str) -> tuple[SlicedDict, str]:
        """Receive a dict, a sliced tensor as this rank's slice; and what is wrong
        with it for ``gather`` ("" when nothing; ``op`` names the call): a tensor
        sliced into other than ``gather``'s size is received all the same (the
        sender is blocked on its sends) and left out of the dict."""
        meta, fill = self._recv_meta(src)
        out: dict[Any, Any] = {}
        sliced: list[tuple[Any, torch.Tensor, tuple[int, ...]]] = []
        problem = ""
        have = gather.world_size if gather is not None else None
        for key, kind, value in meta:
            if kind != TENSOR:  # an honest sender inlines no tensor here; a peer's may be odd
                out[key] = plain(value) if kind == INLINE else value
                continue
            parts = int(value[3])
            if not parts:
                out[key] = fill(value, 0, key)
                continue
            piece = fill(value, parts, key)
            if have != parts:
                given = ("no all_gather_group" if have is None
                         else f"an all_gather_group of size {have}")
                problem = problem or (
                    f"the sender sliced tensor {key!r} into {parts} parts for an all-gather, "
                    f"but {op} was called with {given}; pass the same kind of "
                    f"all_gather_group on both sides"
                )
                continue
            out[key] = piece
            sliced.append((key, piece, tuple(value[2])))
        return SlicedDict(out, sliced), problem

    def _recv_meta(self, src: int) -> tuple[list[list[Any]], Filler]:
        """The dict's checked metadata, and how to fill each of its tensors: from the
        direction's link, or from the CPU group and the communicator."""
        g = self._group
        links = self._p2p.links
        link = links.receiver(src)
        if link is None:
            meta = check_metadata(self._objects.recv(src, object_comm.DICT_META), g.device.type,
                                  src)

            def fill(desc: list[Any], parts: int, key: Any) -> torch.Tensor:
                return self._recv_tensor(alloc(desc, g.device, parts or 1), src)

            return meta, fill
        pieces = link_messages.receive(
            link, src, lambda e: links.break_direction(RECV, src, e),
            link_messages.DICT, g.unique_name, g.device.type)
        if not isinstance(pieces, link_messages.Pieces):  # (receive refuses a lone tensor here)
            raise TypeError(f"internal: a dict's link message gave {type(pieces).__name__}")

        def take(desc: list[Any], parts: int, key: Any) -> torch.Tensor:
            numel = math.prod(desc[2]) // (parts or 1)
            flat = pieces.take(dtype_of(desc[1]), numel, key)
            return flat if parts else flat.reshape(desc[2])

        return pieces.meta, take

    def _send_tensor(self, t: torch.Tensor, dst: int) -> None:
        g = self._group
        if t.device.type == g.device.type:
            g.comm.send(t, dst=dst)
        else:  # CPU tensor in a GPU group: over the CPU group
            dist.send(wire_view(t), dst=g.ranks[dst], group=g.cpu_group)

    def _recv_tensor(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into a tensor shaped like ``buf`` (returns the filled tensor)."""
        g = self._group
        if not buf.numel():
            return buf
        if buf.device.type == g.device.type:
            return g.comm.recv(buf.shape, buf.dtype, src=src)
        dist.recv(wire_view(buf), src=g.ranks[src], group=g.cpu_group)
        return buf

    # ------------------------------------------------------------------ asynchronous
    def isend_tensor_dict(self, tensor_dict: Mapping[Any, Any], dst: int | None,
                          all_gather_group: Any = None,
                          all_gather_tensors: Mapping[Any, bool] | None = None) -> P2PHandle:
        """``GroupCoordinator.isend_tensor_dict``: start sending ``tensor_dict`` to ``dst``."""
        g, p2p = self._group, self._p2p
        dst, seq, entry = p2p.begin("isend_tensor_dict", dst, "dst", +1, allow_alone=True)
        try:
            if not isinstance(tensor_dict, Mapping):
                raise TypeError(f"tensor_dict must be a dict, got {type(tensor_dict).__name__}")
            gather = self._check_all_gather_group(all_gather_group)
            n = gather.world_size if gather is not None else 1
            # Same checks as the blocking call (the slicing asked for, sparse tensors,
            # devices), before anything is queued.
            slicing = slicing_plan(tensor_dict, n, all_gather_tensors)
            flatten_tensor_dict(tensor_dict, slicing=slicing, parts=n, device=g.device)
        except (TypeError, ValueError) as e:
            if g.world_size > 1 and g.device.type == "cpu":  # the receiver is told, in order
                p2p.submit(SEND, dst, "isend_tensor_dict", seq, self._reject_send, dst, e,
                           quiet=True)
            self._book.note_failure("isend_tensor_dict", seq, e, entry)
            raise
        if g.world_size == 1:
            return p2p.done("isend_tensor_dict", dst, seq, None, entry)
        now = snapshot(tensor_dict)  # later changes to the caller's values do not travel
        if g.device.type == "cuda":
            return p2p.cuda().isend_tensor_dict(now, dst, seq, gather, slicing)
        return p2p.handle(p2p.submit(SEND, dst, "isend_tensor_dict", seq, self._send, now,
                                     dst, gather, slicing, entry=entry))

    def irecv_tensor_dict(self, src: int | None, all_gather_group: Any = None) -> P2PHandle:
        """``GroupCoordinator.irecv_tensor_dict``: start receiving a dict from ``src``;
        with ``all_gather_group``, sliced tensors are rebuilt on the direction's
        worker (a CUDA group's: by the handle's first ``wait()``)."""
        g, p2p = self._group, self._p2p
        src, seq, entry = p2p.begin("irecv_tensor_dict", src, "src", -1, allow_alone=True)
        try:
            gather = self._check_all_gather_group(all_gather_group)
        except TypeError as e:
            self._book.note_failure("irecv_tensor_dict", seq, e, entry)
            raise
        if g.world_size == 1:
            return p2p.done("irecv_tensor_dict", src, seq, None, entry)
        if g.device.type == "cuda":
            return p2p.cuda().irecv_tensor_dict(src, seq, gather)
        if gather is None:
            return p2p.handle(p2p.submit(RECV, src, "irecv_tensor_dict", seq, self._recv, src,
                                         None, "irecv_tensor_dict", entry=entry))
        return p2p.handle(p2p.submit(RECV, src, "irecv_tensor_dict", seq, self._recv_exchanged,
                                     src, gather, entry=entry))


def exchange_slices(got: SlicedDict, gather: AllGatherGroup) -> dict[Any, Any]:
    """Rebuild the sliced tensors of ``got`` by trading slices with the other ranks
    of ``gather`` point to point: each sends its slice of every sliced tensor to
    every other rank and receives theirs, then concatenates them in rank order.

    This is how an asynchronous receive rebuilds, on its worker thread: an
    all-gather is a collective, whose place among ``gather``'s other collectives
    would depend on when the worker got there; point-to-point calls keep their
    own order per peer and direction (:mod:`coordinator.p2p.point_to_point`), the
    order in which each rank's receives of the dicts finish. Every rank of
    ``gather`` receives its dicts in the same order, so the slices pair up, as
    long as no other thread of these ranks sends or receives between them over
    ``gather`` at the same time. Each wait is bounded by ``gather``'s timeout.

    Returns:
        ``got.out``, its sliced keys now holding the whole tensors.
    """
    out = got.out
    n, me = gather.world_size, gather.rank_in_group
    peers = [r for r in range(n) if r != me]
    sends: list[Any] = []
    recvs: list[dict[int, Any]] = []
    for _, piece, _ in got.sliced:
        sends += [gather.isend(piece, r) for r in peers]
        recvs.append({r: gather.irecv((piece.shape, piece.dtype), r) for r in peers})
    for (key, piece, shape), theirs in zip(got.sliced, recvs, strict=True):
        parts = [piece if r == me else theirs[r].wait() for r in range(n)]
        out[key] = torch.cat(parts).reshape(shape)
    for h in sends:
        h.wait()
    return out


def _broadcast_transport(g: DictGroup, src: Any, group: Any, metadata_group: Any) -> str | None:
    """The transport a dict broadcast names in the recorder: ``queue`` through the
    group's message queue, torch.distributed over the caller's groups, else
    None (the group's communicator, named at dump time)."""
    if group is not None or metadata_group is not None:
        return "gloo" if g.device.type == "cpu" else "torch"
    if g.mq_broadcaster is not None and src == g.mq_writer_rank:
        return "queue"
    return None


#: Fills a received dict's tensor: ``fill(descriptor, parts, key)``.
Filler = Callable[[list[Any], int, Any], torch.Tensor]


def slicing_plan(tensor_dict: Mapping[Any, Any], n: int,
                 overrides: Mapping[Any, bool] | None) -> dict[Any, bool]:
    """Which tensors of ``tensor_dict`` travel as ``1/n`` slices for an all-gather
    group of ``n`` ranks: those whose size divides by ``n``, unless ``overrides``
    (``all_gather_tensors``) says otherwise per key. With ``n`` 1 (no group, or a
    group of one rank: TP=1 under vLLM's pipeline code) every tensor travels
    whole, whatever ``overrides`` says, as in vLLM, where its one slice is the
    whole tensor.

    Raises:
        TypeError: ``overrides`` is not a mapping.
        ValueError: ``overrides`` forces a slice of a tensor whose size does not
            divide by ``n``.
    """
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"all_gather_tensors must be a dict of key -> bool, got {type(overrides).__name__}"
        )
    plan: dict[Any, bool] = {}
    for key, t in tensor_dict.items():
        if not isinstance(t, torch.Tensor):
            continue
        if n == 1:
            plan[key] = False
            continue
        divisible = t.numel() > 0 and t.numel() % n == 0
        want = overrides.get(key, divisible) if overrides else divisible
        if want and not divisible:
            raise ValueError(
                f"all_gather_tensors[{key!r}] is True but tensor {key!r} has {t.numel()} "
                f"elements, not divisible by the all_gather_group size {n}"
            )
        plan[key] = bool(want)
    return plan
