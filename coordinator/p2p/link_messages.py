"""What a tensor dict becomes on a shared-memory link (:mod:`coordinator.p2p.shm_links`).

A dict is its metadata (:func:`coordinator.wire.tensor_dict_format.flatten_tensor_dict`:
plain values, and a ``[device, dtype, shape, parts]`` descriptor per tensor)
and its *pieces*, the non-empty payload tensors in order, contiguous: as
themselves where the codec carries their dtype, else as flat ``uint8`` bytes
(sub-byte and bit types); subclasses and autograd do not travel, so a
receiver gets plain new tensors, as over the CPU group::

    ["td", meta, inline pieces]            the dict; then, in order,
    ["part", bytes of a piece] ...         the streamed pieces, part by part (uint8)
    ["fail", text]                         instead of the dict: the sender's codec
                                           refused a value (CollectiveMismatch)
    ["rej", text]                          instead of a tensor: the sender rejected
                                           its own arguments (PeerRejectedError)
    ["t1", meta, inline pieces]            one tensor of ``send``/``isend``
                                           (:mod:`coordinator.p2p.link_tensors`): a
                                           dict of one entry, parts as a dict's
    ["t1", tensor]                         the same when it fits one part and its
                                           dtype travels as itself

Which pieces are streamed follows from the metadata alone (:func:`streamed`),
so the receiver knows what to expect before reading anything: none when all
pieces fit in one part (:data:`PART_BYTES`, a ring chunk less room for the
metadata), else every piece over a quarter part. Streaming keeps a large
dict in the ring, one part per chunk, the receiver copying part ``k`` out
while the sender writes part ``k + 1``; one message larger than a chunk would
take the queue's overflow socket instead.

A call's message (a dict's or a tensor's, the header of a large one) is a
confirmed enqueue: the receiver judges it in :func:`receive` before
releasing its slot (form, kind of call, metadata, a tensor's shape and
dtype), and a refused message has no parts after it. Parts, failures and
rejections are eager. A confirmed send or a receive that times out closes
the direction (``broken``): a message that comes late would pair with a
later call.

The receiver checks every message before using it: its form, each inline
piece's dtype and size against its descriptor, the count of inline pieces, and
each part's size (:data:`PART_BYTES`, the last part what its piece still
lacks: :class:`Pieces`); anything else is
:class:`~coordinator.errors.DecodeError`. A streamed piece's buffer is
allocated when its first part arrived, not on the header's claim, and the
dict's metadata cannot claim more bytes than the host has
(:func:`coordinator.wire.tensor_dict_format.check_metadata`).
A dict that fails partway through its parts (a timeout, a dead peer, a bad
part) leaves the link out of order: both sides then close that direction
(:meth:`coordinator.p2p.shm_links.ShmLinks.break_direction`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from coordinator.errors import CollectiveMismatch, CommTimeout, DecodeError, PeerRejectedError
from coordinator.p2p.link_offer import CHUNK_BYTES
from coordinator.wire.tensor_dict_format import check_metadata, dtype_of, plain, sent_numels
from shm_broadcast.describe import describe

__all__ = ["PART_BYTES", "DICT", "TENSOR_ONLY", "streamed", "send", "confirmed", "plain_piece",
           "failure",
           "rejection", "tag_of", "receive", "refused", "lone_tensor", "Pieces"]

#: How a refusal's reason begins when the receiver rejected its own call.
_REJECTED = "rejected: "
#: The tag of a tensor dict's message, and of a single tensor's.
DICT, TENSOR_ONLY = "td", "t1"
_CALLS = {DICT: "send_tensor_dict", TENSOR_ONLY: "send"}

#: Bytes of one message's tensors at most: a link's ring chunk less 64 KiB for
#: the metadata and the message's header.
PART_BYTES = CHUNK_BYTES - (64 << 10)


def streamed(sizes: list[int]) -> list[bool]:
    """Which pieces (their byte sizes, in order) follow the dict as parts."""
    if sum(sizes) <= PART_BYTES:
        return [False] * len(sizes)
    return [n > PART_BYTES // 4 for n in sizes]


def send(link: Any, meta: list[list[Any]], payload: list[torch.Tensor],
         broken: Callable[[BaseException], None], tag: str = DICT) -> str | None:
    """Enqueue a dict on ``link``: its message, then the parts of its streamed pieces.

    Args:
        broken: Called with the error when the receiver's verdict does not come
            in time or a part fails after the dict's message went out (the
            link's order is then lost), before the error propagates.
        tag: :data:`DICT`, or :data:`TENSOR_ONLY` for one tensor of ``send``.

    Returns:
        The receiver's refusal of the message (its reason; then no part was
        sent), else None.

    Raises:
        TypeError etc.: The codec refused a value of ``meta``; nothing was sent.
    """
    pieces = [plain_piece(t) for t in payload if t.numel()]
    flags = streamed([p.numel() * p.element_size() for p in pieces])
    inline = [p for p, f in zip(pieces, flags, strict=True) if not f]
    refusal = confirmed(link, [tag, meta, inline], broken)
    if refusal is not None:
        return refusal
    try:
        for p, f in zip(pieces, flags, strict=True):
            if f:
                flat = p.reshape(-1).view(torch.uint8)
                for a in range(0, flat.numel(), PART_BYTES):
                    link.enqueue(["part", flat[a : a + PART_BYTES]])
    except BaseException as e:
        broken(e)
        raise
    return None


def confirmed(link: Any, msg: list[Any], broken: Callable[[BaseException], None]) -> str | None:
    """Enqueue a call's message and wait for the receiver's verdict: its refusal
    reason, or None where it took the message. A timeout calls ``broken`` (the
    message stays in the ring, where a late receiver would pair it with a
    later call), then propagates."""
    try:
        verdict: str | None = link.enqueue_confirmed(msg)[0]  # the verdict of its one reader
        return verdict
    except CommTimeout as e:
        broken(e)
        raise


def plain_piece(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a contiguous plain tensor the codec carries: itself where
    its dtype travels, else its flat bytes (sub-byte and bit types); subclasses
    and autograd do not travel."""
    from device_comms.validation import dense
    from shm_broadcast.codec.message_codec import carries_dtype

    if t.requires_grad:
        t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    t = dense(t)
    return t if carries_dtype(t.dtype) else t.reshape(-1).view(torch.uint8)


def failure(text: str) -> list[Any]:
    """The message that tells the receiver the dict could not be sent."""
    return ["fail", text]


def rejection(text: str) -> list[Any]:
    """The message a sender whose arguments were bad sends in place of its tensor."""
    return ["rej", text]


def tag_of(msg: Any) -> Any:
    """The tag of a link message (``msg[0]`` of a list led by a str), else None."""
    return msg[0] if type(msg) is list and msg and type(msg[0]) is str else None


def receive(link: Any, src: int, broken: Callable[[BaseException], None], tag: str,
            group: str, device_type: str,
            check: Callable[[torch.Size, torch.dtype], None] | None = None,
            rejected: str = "") -> torch.Tensor | Pieces | None:
    """Take the next message of a call waiting for ``tag``, judged before its slot
    is released (its sender waits for the verdict).

    Args:
        check: For ``recv``: called with the shape and dtype a tensor's message
            carries; raises ``CollectiveMismatch`` to refuse it.
        rejected: This rank rejected its own call: refuse the message with
            this reason (the sender raises ``PeerRejectedError``).

    Returns:
        The tensor of a one-part tensor message; :class:`Pieces` (metadata
        checked) for the rest; None where this rank refused as ``rejected``.

    Raises:
        CollectiveMismatch: The sender sent the other kind, another shape or
            dtype, or could not send; PeerRejectedError: it rejected its own
            call; DecodeError: the message is malformed. The message was
            refused (nothing follows it) or was a failure.
    """
    got: list[Any] = []

    def verdict(msg: Any) -> str | None:
        if rejected:
            return _REJECTED + rejected if tag_of(msg) in _CALLS else None
        one = lone_tensor(msg, src)
        if one is not None:
            if tag == DICT:  # a whole message: refused, nothing follows
                _wrong_kind(TENSOR_ONLY, tag, src, group)
            if check is not None:
                check(one.shape, one.dtype)
            got.append(one)
            return None
        pieces = Pieces(link, msg, src, broken, tag, group)
        pieces.meta = check_metadata(pieces.meta, device_type, src)
        numels = sent_numels(pieces.meta)
        if check is not None:  # a tensor's message: one whole tensor, as sent
            descs = [d for _, d in numels]
            if len(descs) != 1 or descs[0][3]:
                raise DecodeError(f"recv: the link message from rank {src} "
                                  f"holds {len(descs)} tensors, not one whole tensor")
            check(torch.Size(descs[0][2]), dtype_of(descs[0][1]))
        pieces.expect([n * dtype_of(d[1]).itemsize for n, d in numels if n])
        got.append(pieces)
        return None

    try:
        link.dequeue(verdict=verdict)
    except CommTimeout as e:  # a message that comes later would pair with a later call
        broken(e)
        raise
    return got[0] if got else None


def refused(group: str, op: str, refusal: str, dst: int) -> CollectiveMismatch:
    """The sender's error for a message group rank ``dst`` refused with ``refusal``
    (naming the group rank, as the CPU group's signed calls do)."""
    if refusal.startswith(_REJECTED):
        return PeerRejectedError(group, op, dst, refusal.removeprefix(_REJECTED))
    return CollectiveMismatch(f"{op} on group {group!r}: rank {dst} refused what this rank "
                              f"sent ({refusal.removeprefix('mismatch: ')})", peers=(dst,))


def _wrong_kind(sent: str, tag: str, src: int, group: str) -> None:
    call = "recv" if tag == TENSOR_ONLY else "recv_tensor_dict"
    raise CollectiveMismatch(
        f"{call} on group {group!r}: the sender (rank {src}) called {_CALLS[sent]} where this rank "
        f"called {call}; make the same kind of call on both ranks", peers=(src,))


def lone_tensor(msg: Any, src: int) -> torch.Tensor | None:
    """The tensor of a one-part ``["t1", tensor]`` message, or None for any other message.

    Raises:
        DecodeError: The message has that form but does not hold a tensor.
    """
    if _tag(msg, 2) != TENSOR_ONLY:
        return None
    if type(msg[1]) is not torch.Tensor:
        raise DecodeError(f"recv: malformed link message from rank {src}: "
                          f"{type(msg[1]).__name__} {describe(msg[1])}")
    return msg[1]


def _tag(msg: Any, n: int) -> Any:
    """``msg[0]`` when ``msg`` is a list of ``n`` items led by a str, else None."""
    return msg[0] if type(msg) is list and len(msg) == n and type(msg[0]) is str else None


class Pieces:
    """The tensors of one received dict, handed out in metadata order.

    Args:
        link: The link (for the streamed pieces' parts).
        msg: The dict's message, as dequeued.
        src: The sender's group rank (for errors).
        broken: Called with the error when reading a streamed piece fails (the
            link's order is then lost), before the error propagates.
        tag: The message this call waits for: :data:`DICT` (``recv_tensor_dict``)
            or :data:`TENSOR_ONLY` (``recv``).

    Raises:
        CollectiveMismatch: The sender could not send, or sent the other kind
            (a dict to ``recv``, a tensor to ``recv_tensor_dict``);
            PeerRejectedError: it rejected its own call.
        DecodeError: The message is not a dict's or a tensor's message.
    """

    def __init__(self, link: Any, msg: Any, src: int,
                 broken: Callable[[BaseException], None], tag: str = DICT,
                 group: str = "") -> None:
        call = "recv" if tag == TENSOR_ONLY else "recv_tensor_dict"
        if _tag(msg, 2) == "fail" and type(msg[1]) is str:
            raise CollectiveMismatch(
                f"{call} on group {group!r}: the sender (rank {src}) could not send "
                f"({msg[1][:2000]}); fix the call on that rank", peers=(src,))
        if _tag(msg, 2) == "rej" and type(msg[1]) is str:
            raise PeerRejectedError(group, call, src, msg[1][:2000])
        sent = _tag(msg, 3)
        if sent in _CALLS and sent != tag:  # refused (see receive): nothing follows
            _wrong_kind(sent, tag, src, group)
        if sent not in _CALLS or type(msg[2]) is not list or not all(
                type(p) is torch.Tensor for p in msg[2]):
            raise DecodeError(f"{call}: malformed link message from rank "
                              f"{src}: {type(msg).__name__} {describe(msg)}")
        self.meta: Any = msg[1]
        self._inline: list[torch.Tensor] = msg[2]
        self._link, self._src, self._broken = link, src, broken
        self._flags: list[bool] = []
        self._next = self._taken = 0

    def expect(self, sizes: list[int]) -> None:
        """Take the byte sizes of the non-empty pieces the checked metadata describes."""
        self._flags = streamed(sizes)
        if sum(not f for f in self._flags) != len(self._inline):
            raise DecodeError(f"recv_tensor_dict: the link message from rank {self._src} "
                              f"holds {len(self._inline)} tensors, its metadata describes "
                              f"{sum(not f for f in self._flags)} sent with it")

    def take(self, dtype: torch.dtype, numel: int, key: Any) -> torch.Tensor:
        """The next piece: ``numel`` elements of ``dtype``, flat (empty: a new tensor)."""
        if not numel:
            return torch.empty(0, dtype=dtype, device="cpu")
        nbytes = numel * dtype.itemsize
        streamed_piece = self._flags[self._next]
        self._next += 1
        if streamed_piece:
            try:
                return self._stream(nbytes, key).view(dtype)
            except BaseException as e:
                self._broken(e)
                raise
        piece = plain(self._inline[self._taken])  # a peer's codec may mark it a Parameter
        self._taken += 1
        if piece.dtype == dtype and piece.numel() == numel:
            return piece.reshape(-1)
        if piece.dtype == torch.uint8 and piece.dim() == 1 and piece.numel() == nbytes:
            return piece.view(dtype)  # a dtype the codec does not carry, as bytes
        raise DecodeError(f"recv_tensor_dict: tensor {describe(key)} should be {numel} elements of "
                          f"{dtype}, the link message holds {piece.numel()} of {piece.dtype}")

    def _stream(self, nbytes: int, key: Any) -> torch.Tensor:
        part = self._part(nbytes, 0, key)
        # once a part arrived, not on a claim alone
        out = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        done = 0
        while True:
            # One thread's memcpy: torch's copy_ would start its OpenMP team, which
            # spins against the sender's on a busy host (see docs/performance.md).
            ctypes.memmove(out.data_ptr() + done, part.data_ptr(), part.numel())
            done += part.numel()
            if done == nbytes:
                return out
            part = self._part(nbytes, done, key)

    def _part(self, nbytes: int, done: int, key: Any) -> torch.Tensor:
        """The next part of a streamed piece of ``nbytes`` of which ``done`` arrived."""
        msg = self._link.dequeue(verdict=_no_header)
        part = msg[1] if _tag(msg, 2) == "part" else None
        size = min(PART_BYTES, nbytes - done)  # what send() cuts: full parts, then the rest
        if (type(part) is not torch.Tensor or part.dtype != torch.uint8 or part.dim() != 1
                or part.numel() != size):
            raise DecodeError(f"recv_tensor_dict: expected a part of tensor {describe(key)} "
                              f"({size} of {nbytes - done} more bytes) from rank "
                              f"{self._src}, got {type(msg).__name__} {describe(msg)}")
        return part


def _no_header(msg: Any) -> str | None:
    """Where a part is due, a call's header (whose sender waits) is refused."""
    if tag_of(msg) in _CALLS:
        return "mismatch: the receiver was reading the parts of an earlier message"
    return None
