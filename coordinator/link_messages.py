"""What a tensor dict becomes on a shared-memory link (:mod:`coordinator.shm_links`).

A dict is its metadata (:func:`coordinator.tensor_dict.flatten_tensor_dict`:
plain values, and a ``[device, dtype, shape, parts]`` descriptor per tensor)
and its *pieces*, the non-empty payload tensors in order, contiguous and
detached (a receiver gets plain new tensors, as over the CPU group)::

    ["td", meta, inline pieces]            the dict; then, in order,
    ["part", flat slice of a piece] ...    the streamed pieces' bytes
    ["fail", text]                         instead of the dict: the sender's codec
                                           refused a value (CollectiveMismatch)

Which pieces are streamed follows from the metadata alone (:func:`streamed`),
so the receiver knows what to expect before reading anything: none when all
pieces fit in one part (:data:`PART_BYTES`, a ring chunk less room for the
metadata), else every piece over a quarter part. Streaming keeps a large
dict in the ring, one part per chunk, the receiver copying part ``k`` out
while the sender writes part ``k + 1``; one message larger than a chunk would
take the queue's overflow socket instead.

The receiver checks every message before using it: its form, each inline
piece's dtype and element count against its descriptor, the count of inline
pieces, and each part's dtype and size against what its piece still lacks
(:class:`Pieces`). Anything else is :class:`~coordinator.errors.DecodeError`.
"""

from __future__ import annotations

from typing import Any

import torch

from coordinator.errors import CollectiveMismatch, DecodeError
from coordinator.shm_links import CHUNK_BYTES

__all__ = ["PART_BYTES", "streamed", "send", "failure", "Pieces"]

#: Bytes of one message's tensors at most: a link's ring chunk less 64 KiB for
#: the metadata and the message's header.
PART_BYTES = CHUNK_BYTES - (64 << 10)


def streamed(sizes: list[int]) -> list[bool]:
    """Which pieces (their byte sizes, in order) follow the dict as parts."""
    if sum(sizes) <= PART_BYTES:
        return [False] * len(sizes)
    return [n > PART_BYTES // 4 for n in sizes]


def send(link: Any, meta: list[list[Any]], payload: list[torch.Tensor]) -> None:
    """Enqueue a dict on ``link``: its message, then the parts of its streamed pieces.

    Raises:
        TypeError etc.: The codec refused a value of ``meta``; nothing was sent.
    """
    from device_comms.validation import dense

    pieces = [dense(t.detach()) for t in payload if t.numel()]
    flags = streamed([p.numel() * p.element_size() for p in pieces])
    link.enqueue(["td", meta, [p for p, f in zip(pieces, flags) if not f]])
    for p, f in zip(pieces, flags):
        if f:
            flat, step = p.reshape(-1), max(1, PART_BYTES // p.element_size())
            for a in range(0, flat.numel(), step):
                link.enqueue(["part", flat[a : a + step]])


def failure(text: str) -> list[Any]:
    """The message that tells the receiver the dict could not be sent."""
    return ["fail", text]


class Pieces:
    """The tensors of one received dict, handed out in metadata order.

    Args:
        link: The link (for the streamed pieces' parts).
        msg: The dict's message, as dequeued.
        src_global: The sender's global rank (for errors).

    Raises:
        CollectiveMismatch: The sender could not encode its dict.
        DecodeError: The message is not a dict's message.
    """

    def __init__(self, link: Any, msg: Any, src_global: int) -> None:
        if type(msg) is list and len(msg) == 2 and msg[0] == "fail" and type(msg[1]) is str:
            raise CollectiveMismatch(
                f"recv_tensor_dict: the sender (global rank {src_global}) could not send its "
                f"tensor dict ({msg[1][:2000]}); fix the call on that rank", peers=(src_global,))
        if (type(msg) is not list or len(msg) != 3 or msg[0] != "td" or type(msg[2]) is not list
                or not all(type(p) is torch.Tensor for p in msg[2])):
            raise DecodeError(f"recv_tensor_dict: malformed link message from global rank "
                              f"{src_global}: {type(msg).__name__} {msg!r:.80}")
        self.meta: Any = msg[1]
        self._inline: list[torch.Tensor] = msg[2]
        self._link, self._src = link, src_global
        self._flags: list[bool] = []
        self._next = self._taken = 0

    def expect(self, sizes: list[int]) -> None:
        """Take the byte sizes of the non-empty pieces the checked metadata describes."""
        self._flags = streamed(sizes)
        if sum(not f for f in self._flags) != len(self._inline):
            raise DecodeError(f"recv_tensor_dict: the link message from global rank {self._src} "
                              f"holds {len(self._inline)} tensors, its metadata describes "
                              f"{sum(not f for f in self._flags)} sent with it")

    def take(self, dtype: torch.dtype, numel: int, key: Any) -> torch.Tensor:
        """The next piece: ``numel`` elements of ``dtype``, flat (empty: a new tensor)."""
        if not numel:
            return torch.empty(0, dtype=dtype)
        streamed_piece = self._flags[self._next]
        self._next += 1
        if streamed_piece:
            return self._stream(dtype, numel, key)
        piece = self._inline[self._taken]
        self._taken += 1
        if piece.dtype != dtype or piece.numel() != numel:
            raise DecodeError(f"recv_tensor_dict: tensor {key!r} should be {numel} elements of "
                              f"{dtype}, the link message holds {piece.numel()} of {piece.dtype}")
        return piece.reshape(-1)

    def _stream(self, dtype: torch.dtype, numel: int, key: Any) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        done = 0
        while done < numel:
            msg = self._link.dequeue()
            part = msg[1] if type(msg) is list and len(msg) == 2 and msg[0] == "part" else None
            if (type(part) is not torch.Tensor or part.dtype != dtype or part.dim() != 1
                    or not 0 < part.numel() <= numel - done):
                raise DecodeError(f"recv_tensor_dict: expected a part of tensor {key!r} "
                                  f"({numel - done} more elements of {dtype}) from global rank "
                                  f"{self._src}, got {type(msg).__name__} {msg!r:.80}")
            out[done : done + part.numel()].copy_(part)
            done += part.numel()
        return out
