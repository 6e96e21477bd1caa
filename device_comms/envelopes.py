"""Header-first exchanges over a gloo group: every call's signature travels with it.

Gloo aborts the process (``gloo::EnforceNotMet``, not catchable) when a
message is larger than the buffer its receiver posted, and hangs or returns
garbage when ranks call different collectives. So no call of a CPU
communicator hands gloo anything whose size depends on its arguments before
every rank has seen every other rank's :mod:`~device_comms.call_signature`
header. An *envelope* is that header followed by up to :data:`INLINE_MAX`
bytes (the call's payload when it is small, or a rejection's reason):

* every rank posts a receive of ``HDR_BYTES + INLINE_MAX`` bytes from each
  peer (gloo accepts a shorter message into a larger buffer), then sends its
  envelope to each peer (point-to-point, tag :data:`COLLECTIVE_TAG` or
  :data:`P2P_TAG`, apart from user traffic on tag 0), and waits for all;
* each rank has now seen every header, so every rank reaches the same
  verdict (:func:`~device_comms.call_signature.settle`);
* small calls are then already done: each rank computes its result from the
  payloads it received (an all-reduce reduces them in rank order, so every
  rank gets bitwise identical values); larger calls run the gloo collective
  next, with sizes every rank agreed on.

Each call sends exactly one envelope to each peer whatever happens (valid,
rejected, mismatched), so the message streams between every pair of ranks
stay aligned and the next call pairs with the peers' next call: after a
rejection or a mismatch the group stays usable.

Sending (``ProcessGroup.send``) and receiving use the process group's own
point-to-point calls (group ranks, no ``torch.distributed`` wrapper): on a
1 KiB all-reduce of two ranks one exchange costs less than gloo's own
all-reduce (measured in docs/performance.md). A wait is bounded by the
process group's timeout (gloo raises, and the caller translates it).

Send/recv use the same envelope in both directions: the receiver sends its
expectation (dtype, shape, source) while the sender sends its header and a
small payload, so both sides see both headers and both raise on a mismatch
or a rejection; a payload over :data:`INLINE_MAX` follows only after both
agreed.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from device_comms.call_signature import FAILED, HDR_BYTES, REJECTED

__all__ = [
    "Envelopes", "INLINE_MAX", "COLLECTIVE_TAG", "P2P_TAG", "as_bytes", "failure_header",
    "reason_bytes",
]

#: Largest payload carried in an envelope. Above it a call exchanges headers
#: only, then runs the gloo collective. Receive buffers are this size per peer.
INLINE_MAX = 64 << 10
COLLECTIVE_TAG = 0x6765  # "ge": collective envelopes
P2P_TAG = 0x6766  # send/recv envelopes and their large payloads
_REASON_MAX = 4096


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as flat bytes (same memory)."""
    return t.reshape(-1).view(torch.uint8)


class Envelopes:
    """One rank's side of envelope exchanges with a fixed set of peers.

    Args:
        group: The gloo process group.
        peers: Group ranks this rank exchanges with (all others, or node leaders).
        tag: Message tag of these exchanges.

    Attributes:
        words: Per peer, the header words of its last envelope (numpy views).
    """

    def __init__(self, group: dist.ProcessGroup, peers: list[int], tag: int) -> None:
        self.group = group
        self.peers = list(peers)
        self.tag = tag
        self._recv = {p: torch.empty(HDR_BYTES + INLINE_MAX, dtype=torch.uint8) for p in peers}
        self.words: dict[int, np.ndarray] = {
            p: b[:HDR_BYTES].numpy().view(np.int64) for p, b in self._recv.items()
        }
        self._send = torch.empty(HDR_BYTES + INLINE_MAX, dtype=torch.uint8)
        self._each: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ exchanges
    def exchange(
        self,
        header: np.ndarray,
        payload: torch.Tensor | None = None,
        to: Mapping[int, torch.Tensor | None] | None = None,
        peers: list[int] | None = None,
    ) -> None:
        """Send ``header`` (and a payload) to every peer, receive each peer's envelope.

        Args:
            header: This rank's header words (its word 7 is set here).
            payload: Flat bytes sent to every peer after the header, or None.
            to: Instead of ``payload``: per peer, the bytes for that peer (None: header only).
            peers: The peers of this exchange (default: all).

        """
        ps = self.peers if peers is None else peers
        works = [self.group.recv([self._recv[p]], p, self.tag) for p in ps]
        if to is None:
            buf = self._fill(self._send, header, payload)
            works += [self.group.send([buf], p, self.tag) for p in ps]
        else:
            for p in ps:
                dst = self._each.get(p)
                if dst is None:
                    dst = self._each[p] = torch.empty(HDR_BYTES + INLINE_MAX, dtype=torch.uint8)
                works.append(self.group.send([self._fill(dst, header, to.get(p))], p, self.tag))
        for w in works:
            w.wait()

    def payload(self, peer: int) -> torch.Tensor:
        """The bytes after ``peer``'s last header (empty when it sent none)."""
        n = int(self.words[peer][7])
        return self._recv[peer][HDR_BYTES : HDR_BYTES + max(0, n)]

    def reason(self, peer: int) -> str:
        """The text of ``peer``'s last envelope (a REJECTED/FAILED one's reason)."""
        return bytes(self.payload(peer).numpy()).decode("utf-8", "replace")

    def send_raw(self, t: torch.Tensor, peer: int) -> dist.Work:
        """Send agreed bytes (a large payload) to ``peer`` on this tag."""
        return self.group.send([t], peer, self.tag)

    def recv_raw(self, t: torch.Tensor, peer: int) -> dist.Work:
        """Receive agreed bytes (a large payload) from ``peer`` on this tag."""
        return self.group.recv([t], peer, self.tag)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _fill(buf: torch.Tensor, header: np.ndarray, payload: torch.Tensor | None) -> torch.Tensor:
        """Header + payload in ``buf``; returns the part to send."""
        words = buf[:HDR_BYTES].numpy().view(np.int64)
        words[:] = header
        if payload is None:
            words[7] = -1
            return buf[:HDR_BYTES]
        n = payload.numel()
        if n > INLINE_MAX:
            raise RuntimeError(f"internal: an envelope payload of {n} bytes exceeds {INLINE_MAX}")
        words[7] = n
        if n:
            buf[HDR_BYTES : HDR_BYTES + n].copy_(payload)
        return buf[: HDR_BYTES + n]


def failure_header(header: np.ndarray, status: int, culprit: int) -> np.ndarray:
    """A copy of ``header`` with a REJECTED/FAILED status naming ``culprit``."""
    if status not in (REJECTED, FAILED):
        raise ValueError(f"status must be REJECTED or FAILED, got {status}")
    h = header.copy()
    h[5], h[6] = status, culprit
    return h


def reason_bytes(reason: str) -> torch.Tensor:
    """``reason`` as UTF-8 bytes, truncated to fit an envelope."""
    data = reason.encode("utf-8", "replace")[:_REASON_MAX]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

