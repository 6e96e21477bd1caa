"""Single tensors of ``send`` / ``recv`` (and ``isend`` / ``irecv``) on a link.

A direction between two ranks of a host settles at its first point-to-point
call, a single tensor's as well as a tensor dict's (:mod:`coordinator.shm_links`):
on a shared-memory link where the sender's communicator shares memory with
the receiver, else on the CPU group. On a link a tensor travels as a
one-entry message tagged :data:`~coordinator.link_messages.TENSOR_ONLY`: one
copy into the ring and one out, instead of the CPU group's header exchange
and socket transfer (hundreds of microseconds per call between two local
processes). A direction settled on the CPU group, and every GPU group, keep
using the communicator's ``send``/``recv``.

Why both sides agree. Calls of one direction with one peer run one at a time
in issue order (:func:`coordinator.async_p2p.ordered`), so a rank's ``k``-th
call in a direction pairs with its peer's ``k``-th: the first pair carries
the offer, and every later pair sees the same settled transport.

The first call waits for its peer (the sender until the receiver has
attached, the receiver for the offer), at most the group's timeout.

What differs from the CPU group. A send returns once the tensor is in the
ring (as a tensor dict's does; the ring holds :data:`~coordinator.shm_links.CHUNKS`
messages). A call with bad arguments raises on its caller before anything is
sent, settled or taken, and takes no part (the peer's call pairs with the
caller's next one; see :meth:`~coordinator.shm_links.ShmLinks.rejections_told`
for why only the CPU group tells the peer); a failure found while sending
is reported to the receiver (a failure message: ``CollectiveMismatch``
there). A tensor whose shape or dtype
differs from what ``recv`` asked for, or a dict where ``recv`` waits (and a
tensor where ``recv_tensor_dict`` waits), is consumed and raises
``CollectiveMismatch`` on the receiver: the link stays in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from coordinator import link_messages
from coordinator.errors import CollectiveMismatch, DecodeError
from coordinator.p2p_channels import RECV, SEND
from coordinator.tensor_dict import _dtype, _numels, check_metadata, flatten_tensor_dict
from device_comms import validation

if TYPE_CHECKING:
    from coordinator.group_coordinator import GroupCoordinator

__all__ = ["send", "recv"]

_KEY = "tensor"


def send(coord: "GroupCoordinator", tensor: torch.Tensor, dst: int) -> None:
    """Send ``tensor`` to group rank ``dst``: on the direction's link if it has one,
    else through the communicator."""
    if _is_peer(coord, dst) and coord._links.rejections_told(SEND, dst):
        return coord.comm.send(tensor, dst)
    # A bad argument raises here, before anything is sent or settled: it takes no part.
    t = validation.check_tensor(tensor, "tensor", coord.device)
    _check_peer(coord, dst, "dst", "send")
    link = coord._links.sender(dst, "send")
    if link is None:
        return coord.comm.send(t, dst)
    try:
        piece = link_messages.plain_piece(t)
        if piece.dtype == t.dtype and piece.nbytes <= link_messages.PART_BYTES:
            # The common case in one message the codec checks itself: [tag, tensor].
            link.enqueue([link_messages.TENSOR_ONLY, piece])
            return
        meta, payload = flatten_tensor_dict({_KEY: t}, device=coord.device)
    except (TypeError, ValueError) as e:
        link.enqueue(link_messages.failure(f"{type(e).__name__}: {e}"))
        raise
    link_messages.send(link, meta, payload,
                       lambda e: coord._links.break_direction(SEND, dst, e),
                       tag=link_messages.TENSOR_ONLY)


def recv(coord: "GroupCoordinator", size: torch.Size | Sequence[int], dtype: torch.dtype,
         src: int) -> torch.Tensor:
    """Receive a tensor of ``size`` and ``dtype`` from group rank ``src``: from the
    direction's link if it has one, else through the communicator."""
    if _is_peer(coord, src) and coord._links.rejections_told(RECV, src):
        return coord.comm.recv(size, dtype, src)
    shape = validation.check_spec(size, dtype)  # a bad argument takes no part (see send)
    _check_peer(coord, src, "src", "recv")
    link = coord._links.receiver(src, "recv")
    if link is None:
        return coord.comm.recv(shape, dtype, src)
    src_global = coord.ranks[src]
    msg = link.dequeue()
    out = link_messages.lone_tensor(msg, src_global)
    if out is not None:
        return _matching(coord, out, shape, dtype, src, src_global)
    pieces = link_messages.Pieces(link, msg, src_global,
                                  lambda e: coord._links.break_direction(RECV, src, e),
                                  tag=link_messages.TENSOR_ONLY)
    numels = _numels(check_metadata(pieces.meta, coord.device.type))
    pieces.expect([n * _dtype(d[1]).itemsize for n, d in numels if n])
    # all of it, so that the link stays in order, then: a dict where recv waits?
    taken = [pieces.take(_dtype(d[1]), n, _KEY) for n, d in numels]
    pieces.finish()
    descs = [d for _, d in numels]
    if len(descs) != 1 or descs[0][3]:
        raise DecodeError(f"recv: the link message from global rank {src_global} holds "
                          f"{len(descs)} tensors, not one whole tensor")
    return _matching(coord, taken[0].reshape(descs[0][2]), shape, dtype, src, src_global)


def _is_peer(coord: "GroupCoordinator", r: Any) -> bool:
    """Whether ``r`` is another rank of the group (a valid send/recv peer)."""
    return (isinstance(r, int) and not isinstance(r, bool) and 0 <= r < coord.world_size
            and r != coord.rank_in_group)


def _check_peer(coord: "GroupCoordinator", peer: Any, arg: str, op: str) -> None:
    """``peer`` is another rank of the group (else TypeError/ValueError naming ``arg``)."""
    validation.check_rank(peer, coord.world_size, arg)
    if peer == coord.rank_in_group:
        raise ValueError(f"{arg}={peer} is this rank; {op} needs another rank of the group")


def _matching(coord: "GroupCoordinator", out: torch.Tensor, shape: torch.Size,
              dtype: torch.dtype, src: int, src_global: int) -> torch.Tensor:
    """``out`` if it is what ``recv`` asked for (it was consumed either way)."""
    if out.shape != shape or out.dtype != dtype:
        raise CollectiveMismatch(
            f"recv on group {coord.unique_name!r}: expected a tensor of shape {tuple(shape)} "
            f"and {dtype} from rank {src}, which sent {tuple(out.shape)} and {out.dtype}",
            peers=(src_global,))
    if out.requires_grad:  # a peer's codec may set the flag; a received tensor never needs it
        out = out.detach()
    return out
