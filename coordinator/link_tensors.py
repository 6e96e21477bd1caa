"""Single tensors of ``send`` / ``recv`` (and ``isend`` / ``irecv``) on a settled link.

Once a direction between two ranks of a host has settled on a shared-memory
link (its first tensor dict, :mod:`coordinator.shm_links`), a plain tensor
sent that way travels on the same link, as a one-entry message tagged
:data:`~coordinator.link_messages.TENSOR_ONLY`: one copy into the ring and
one out, instead of the CPU group's header exchange and socket transfer
(hundreds of microseconds per call between two local processes).

Why both sides agree without a word. Calls of one direction with one peer run
one at a time in issue order (:func:`coordinator.async_p2p.ordered`), and a
direction is settled from its first tensor dict on, so before a rank's ``k``-th
call in a direction both ranks have made the same ``k - 1`` calls, and both
see the direction settled, or neither does. A direction that is unsettled or
settled on the CPU group keeps using the communicator's ``send``/``recv``.

Why a single tensor does not settle a direction. A link's sends are eager (a
send returns once its message is in the ring), while the communicator's
``send`` meets its receiver, as gloo's does: a receiver that skips its call
or asks for another shape makes the sender raise there (``CommTimeout``,
``CollectiveMismatch``), and a rank's bad arguments are told to its peer
(``PeerRejectedError``). Code that sends plain tensors keeps those
guarantees until it opts into the link by sending a tensor dict.

What differs on a link. A send returns once the tensor is in the ring (the
ring holds :data:`~coordinator.shm_links.CHUNKS` messages). A call with bad
arguments raises on its caller before anything is sent or taken, and takes
no part (the peer's call pairs with the caller's next one; a rejection could
not reach a sender that already returned); a failure found while sending is
reported to the receiver (a failure message: ``CollectiveMismatch`` there).
A tensor whose shape or dtype differs from what ``recv`` asked for, or a
dict where ``recv`` waits (and a tensor where ``recv_tensor_dict`` waits), is
consumed and raises ``CollectiveMismatch`` on the receiver: the link stays
in order.
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
    link = coord._links.settled(SEND, dst) if _is_peer(coord, dst) else None
    if link is None:
        return coord.comm.send(tensor, dst)
    # A bad argument takes no part on a link (see the module docstring).
    t = validation.check_tensor(tensor, "tensor", coord.device)
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
    link = coord._links.settled(RECV, src) if _is_peer(coord, src) else None
    if link is None:
        return coord.comm.recv(size, dtype, src)
    shape = validation.check_spec(size, dtype)  # takes no part: see the module docstring
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
