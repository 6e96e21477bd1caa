"""Single tensors of ``send`` / ``recv`` (and ``isend`` / ``irecv``) on a shared-memory link.

Between two ranks of a host a direction settles at its first call of either
kind, a tensor or a tensor dict (:mod:`coordinator.p2p.shm_links`); once on a
link, a plain tensor travels there as a one-entry message tagged
:data:`~coordinator.p2p.link_messages.TENSOR_ONLY`: one copy into the ring and
one out, instead of the CPU group's header exchange and socket transfer, each
a round trip through the kernel (docs/performance.md has the figures). A direction
settled on the CPU group keeps using the communicator's ``send``/``recv``.

A tensor's send meets its receiver, as gloo's and the CPU group's do. The
message is a confirmed enqueue
(:meth:`~shm_broadcast.queue.message_queue.MessageQueue.enqueue_confirmed`): the
sender returns once the receiver judged it, and the receiver's verdict is
read in the ring before its slot is released::

    sender                                   receiver
    enqueue ["t1", tensor]  ---------------> dequeue, judge (shape, dtype, kind of call)
    wait for the verdict    <--------------- taken | refused with a reason
    return | raise                           return the tensor | raise

So the CPU group's guarantees hold on a link: a receiver that skips its call
makes the sender time out naming it (``CommTimeout``); one that asks for
another shape or dtype, or waits in ``recv_tensor_dict``, makes both raise
``CollectiveMismatch``; a rank whose arguments are bad still takes part and
its peer raises ``PeerRejectedError`` naming it (a bad sender's rejection
message is eager: it raises at once, and the receiver learns it when it
reads). A tensor larger than one part (:data:`~coordinator.p2p.link_messages.PART_BYTES`)
sends its header confirmed, then its parts: refused, no part follows.

Why both sides agree without a word. Calls of one direction with one peer
run one at a time in issue order
(:meth:`coordinator.p2p.point_to_point.PointToPoint.ordered`), and a link is
FIFO, so a rank's ``k``-th message to ``p`` is ``p``'s ``k``-th
from it. Tensor dicts are confirmed the same way
(:mod:`coordinator.p2p.link_messages`): a dict where ``recv`` waits, or a tensor
where ``recv_tensor_dict`` waits, is refused and both ranks raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from coordinator.calls.group_view import GroupView
from coordinator.calls.peers import note_untold
from coordinator.errors import CollectiveMismatch, DecodeError, GroupCoordError
from coordinator.p2p import link_messages
from coordinator.p2p.channels import RECV, SEND
from coordinator.p2p.shm_links import ShmLinks
from coordinator.wire.tensor_dict_format import dtype_of, flatten_tensor_dict, plain, sent_numels
from device_comms import DeviceCommunicator, validation

__all__ = ["send", "recv", "reject", "reject_through_comm"]

_KEY = "tensor"


def send(group: GroupView, links: ShmLinks, tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to group rank ``dst``: on the direction's link if it has one
    (settling it at the first call), else through the communicator."""
    if not _on_host(group, dst):
        return group.comm.send(tensor, dst)
    try:
        t = validation.check_tensor(tensor, "tensor", group.device)
    except (TypeError, ValueError) as e:
        reject(group, links, SEND, dst, e)
        raise
    link = links.sender(dst, "send")
    if link is None:
        return group.comm.send(t, dst)
    try:
        piece = link_messages.plain_piece(t)
        whole = piece.dtype == t.dtype and piece.nbytes <= link_messages.PART_BYTES
        if whole:  # the common case in one message the codec checks itself: [tag, tensor]
            refusal = link_messages.confirmed(
                link, [link_messages.TENSOR_ONLY, piece],
                lambda e: links.break_direction(SEND, dst, e))
        else:
            meta, payload = flatten_tensor_dict({_KEY: t}, device=group.device)
    except (TypeError, ValueError) as e:
        if isinstance(e, (CollectiveMismatch, DecodeError)):
            raise
        link.enqueue(link_messages.failure(f"{type(e).__name__}: {e}"))
        raise
    if not whole:
        refusal = link_messages.send(link, meta, payload,
                                     lambda e: links.break_direction(SEND, dst, e),
                                     tag=link_messages.TENSOR_ONLY)
    if refusal is not None:
        raise link_messages.refused(group.unique_name, "send", refusal, dst)


def recv(group: GroupView, links: ShmLinks, size: torch.Size | Sequence[int],
         dtype: torch.dtype, src: int) -> torch.Tensor:
    """Receive a tensor of ``size`` and ``dtype`` from group rank ``src``: from the
    direction's link if it has one (settling it at the first call), else through
    the communicator."""
    if not _on_host(group, src):
        return group.comm.recv(size, dtype, src)
    try:
        shape = validation.check_spec(size, dtype)
    except (TypeError, ValueError) as e:
        reject(group, links, RECV, src, e)
        raise
    link = links.receiver(src, "recv")
    if link is None:
        return group.comm.recv(shape, dtype, src)

    def check(sent: torch.Size, sent_dtype: torch.dtype) -> None:
        if sent != shape or sent_dtype != dtype:
            raise CollectiveMismatch(
                f"recv on group {group.unique_name!r}: expected a tensor of shape "
                f"{tuple(shape)} and {dtype} from rank {src}, which sent {tuple(sent)} and "
                f"{sent_dtype}", peers=(src,))

    got = _take(group, links, link, src, check)
    return plain(got)  # a peer's codec may mark it a Parameter or requiring grad


def reject(group: GroupView, links: ShmLinks, direction: str, peer: int,
           e: BaseException) -> None:
    """Take part in a ``send``/``recv`` whose arguments failed as the rejected call it
    is (an ``isend``/``irecv``'s, in the direction's order), so that the peer
    raises ``PeerRejectedError`` instead of waiting: on the direction's link
    (settling it if this is its first call), or through the communicator.
    Failing to tell is noted on ``e``."""
    kind = "send" if direction == SEND else "recv"
    reason = f"{type(e).__name__}: {e}"
    try:
        if direction == SEND:
            link = links.sender(peer, kind)
            if link is not None:
                link.enqueue(link_messages.rejection(reason))
        else:
            link = links.receiver(peer, kind)
            if link is not None:
                _take(group, links, link, peer, None, rejected=reason)
    except (CollectiveMismatch, DecodeError):
        return  # the peer's own call was wrong too: taken; this rank raises its own error
    except (GroupCoordError, RuntimeError) as notify:  # RuntimeError: gloo, settling the link
        note_untold(e, peer, group.unique_name, notify)
        return
    if link is None:
        reject_through_comm(group.comm, kind, e, peer)


def reject_through_comm(comm: DeviceCommunicator, kind: str, e: BaseException,
                        peer: int) -> None:
    """Take part in a ``send``/``recv`` (``kind``) of the communicator as a rank whose
    arguments failed with ``e``, so that ``peer`` raises ``PeerRejectedError``."""
    comm.reject(kind, e, peer)


def _take(group: GroupView, links: ShmLinks, link: Any, src: int,
          check: Callable[[torch.Size, torch.dtype], None] | None,
          rejected: str = "") -> torch.Tensor:
    """The next tensor from ``src`` (see :func:`coordinator.p2p.link_messages.receive`);
    a timeout closes the direction (a late message would pair with a later call)."""
    got = link_messages.receive(link, src, lambda e: links.break_direction(RECV, src, e),
                                link_messages.TENSOR_ONLY, group.unique_name,
                                group.device.type, check, rejected)
    if got is None or isinstance(got, torch.Tensor):
        return got  # type: ignore[return-value]  # None: refused as rejected, nobody reads it
    numels = sent_numels(got.meta)
    descs = [d for _, d in numels]
    taken = [got.take(dtype_of(d[1]), n, _KEY) for n, d in numels]
    return taken[0].reshape(descs[0][2])


def _on_host(group: GroupView, r: Any) -> bool:
    """Whether ``r`` is another rank of a CPU group (a peer a link may reach)."""
    return (group.device.type == "cpu" and isinstance(r, int) and not isinstance(r, bool)
            and 0 <= r < group.world_size and r != group.rank_in_group)
