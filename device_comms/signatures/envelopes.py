"""Header-first exchanges over a gloo group: every call's signature travels with it.

Gloo aborts the process (``gloo::EnforceNotMet``, not catchable) when a
message is larger than the buffer its receiver posted, and hangs or returns
garbage when ranks call different collectives. So no call of a CPU
communicator hands gloo anything whose size depends on its arguments before
every rank has seen every other rank's :mod:`~device_comms.signatures.call_signature`
header. An *envelope* is that header followed by a few bytes: the call's
payload when it is small, or a rejection's reason.

Collectives (:class:`Blocks`): every rank contributes one block of exactly
:data:`BLOCK_BYTES` (its header, then up to :data:`BLOCK_INLINE` bytes of
payload) to one gloo all-gather, the same size whatever the call, so the
all-gather itself can never mismatch. Afterwards every rank holds every
rank's header and reaches the same verdict
(:func:`~device_comms.signatures.call_signature.settle`); small calls are then already
done (each rank computes its result from the payloads: an all-reduce reduces
them in rank order, so every rank gets bitwise identical values), larger ones
run the gloo collective next, with sizes every rank agreed on. A collective
rather than point-to-point messages, because gloo's point-to-point path is a
rendezvous of several thread hand-offs, so an exchange of two messages costs
more than one all-gather of small blocks, which costs about what a small
all-reduce does (figures in docs/performance.md).

Each call contributes exactly one block whatever happens (valid, rejected,
mismatched), so the next call pairs with the peers' next call: after a
rejection or a mismatch the group stays usable.

Point-to-point (:class:`Envelopes`): the hierarchical all-reduce's node
leaders (a subset of the group, which has no collective of its own) exchange
envelopes as tagged messages (:data:`~device_comms.cpu.hierarchical.LEADER_TAG`),
apart from user traffic on tag 0. Each side posts a receive of
``HDR_BYTES + INLINE_MAX`` bytes from each peer (gloo accepts a shorter
message into a larger buffer), sends its own envelope and waits for both.
Send/recv exchange the same envelopes by direction
(:mod:`device_comms.signatures.p2p_envelopes`, tags :data:`P2P_TAG` and the one after
it): the receiver sends its expectation (dtype, shape, source) while the
sender sends its header and a small payload, so both sides see both headers
and both raise on a mismatch or a rejection; a larger payload follows only
after both agreed.

Every wait is bounded by the process group's timeout (gloo raises, the
caller translates it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from device_comms.signatures.call_signature import FAILED, HDR_BYTES, REJECTED, SPLIT

__all__ = [
    "Blocks", "Envelopes", "BLOCK_INLINE", "BLOCK_BYTES", "INLINE_MAX", "P2P_TAG", "as_bytes",
    "failure_header", "reason_bytes", "fill_envelope",
]

#: Payload bytes a collective's block carries; a call whose payload per rank
#: is larger exchanges headers first, then runs the gloo collective.
BLOCK_INLINE = 4096
BLOCK_BYTES = HDR_BYTES + BLOCK_INLINE
#: Largest payload of a point-to-point envelope (receive buffers are this size per peer).
INLINE_MAX = 64 << 10
P2P_TAG = 0x6766  # send/recv envelopes and their large payloads
_REASON_MAX = 4000  # fits a block after the header
_VIEW_CACHE_MAX = 256


def _all_gather_call(group: dist.ProcessGroup) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A blocking all-gather of one tensor per rank into one output, on ``group``.

    The process group's own ``all_gather_single`` (what
    ``torch.distributed.all_gather_single`` calls, minus its per-call checks),
    with ``asyncOp`` off as that wrapper sets it; older torch: the wrapper.
    """
    single = getattr(group, "all_gather_single", None)
    if single is None:  # pragma: no cover - torch < 2.12
        def gather(out: torch.Tensor, inp: torch.Tensor) -> None:
            dist.all_gather_into_tensor(out, inp, group=group)

        return gather
    opts = AllgatherOptions()
    opts.asyncOp = False

    def gather_single(out: torch.Tensor, inp: torch.Tensor) -> None:
        work = single(out, inp, opts)
        if work is not None:
            work.wait()

    return gather_single


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as flat bytes (same memory)."""
    return t.reshape(-1).view(torch.uint8)


class Blocks:
    """One rank's side of collective envelope exchanges: an all-gather of fixed blocks.

    Args:
        group: The gloo process group.
        world_size: Its size.
        me: This rank's group rank.

    Attributes:
        words: Per group rank, the header words of its block in the last exchange.
        peers: Every other group rank.
    """

    def __init__(self, group: dist.ProcessGroup, world_size: int, me: int) -> None:
        self.group = group
        self.peers = [r for r in range(world_size) if r != me]
        self._send = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        self._send_words = self._send[:HDR_BYTES].numpy().view(np.int64)
        self._send_data = self._send[HDR_BYTES:]
        self._out = torch.empty(world_size * BLOCK_BYTES, dtype=torch.uint8)
        self._rows = self._out.view(world_size, BLOCK_BYTES)
        self.words = {
            r: self._rows[r, :HDR_BYTES].numpy().view(np.int64) for r in range(world_size)
        }
        self._views: dict[tuple[torch.dtype, torch.Size, int], list[torch.Tensor]] = {}
        self._send_views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}
        self._gather = _all_gather_call(group)

    def exchange(self, header: np.ndarray, payload: torch.Tensor | None = None) -> None:
        """Contribute ``header`` and ``payload`` (a contiguous tensor of at most
        :data:`BLOCK_INLINE` bytes, any dtype; its bytes follow the header)."""
        w = self._send_words
        w[:] = header
        if payload is None:
            w[7] = -1
        else:
            key = (payload.dtype, payload.shape)
            dst = self._send_views.get(key)
            if dst is None:
                n = payload.nbytes
                if n > BLOCK_INLINE:
                    raise RuntimeError(
                        f"internal: a block payload of {n} bytes exceeds {BLOCK_INLINE}")
                if len(self._send_views) >= _VIEW_CACHE_MAX:
                    self._send_views.clear()
                dst = self._send_views[key] = self._send_data[:n].view(payload.dtype).view(
                    payload.shape)
            w[7] = dst.nbytes
            dst.copy_(payload)
        self._gather(self._out, self._send)

    def payload(self, rank: int) -> torch.Tensor:
        """The bytes after ``rank``'s header (empty when it sent none)."""
        n = int(self.words[rank][7])
        return self._rows[rank, HDR_BYTES : HDR_BYTES + max(0, min(n, BLOCK_INLINE))]

    def views(self, dtype: torch.dtype, shape: torch.Size, at: int = 0) -> list[torch.Tensor]:
        """Every rank's payload as a ``shape`` tensor of ``dtype`` from element ``at`` (cached).

        Valid after an exchange whose payloads hold that much; the views
        alias the receive buffer, so copy what must outlive the next exchange.
        """
        key = (dtype, shape, at)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _VIEW_CACHE_MAX:
                self._views.clear()
            n = math.prod(shape)
            v = self._views[key] = [
                self._rows[r, HDR_BYTES:].view(dtype)[at : at + n].view(shape)
                for r in range(self._rows.shape[0])
            ]
        return v

    def reason(self, rank: int) -> str:
        """The text of ``rank``'s block (a REJECTED/FAILED one's reason)."""
        return bytes(self.payload(rank).numpy()).decode("utf-8", "replace")


class Envelopes:
    """One rank's side of point-to-point envelope exchanges with a fixed set of peers.

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

    def exchange(
        self, header: np.ndarray, payload: torch.Tensor | None = None,
        peers: list[int] | None = None,
    ) -> None:
        """Send ``header`` (and a payload) to every peer, receive each peer's envelope.

        Args:
            header: This rank's header words.
            payload: Flat bytes sent to every peer after the header, or None.
            peers: The peers of this exchange (default: all).
        """
        ps = self.peers if peers is None else peers
        works = [self.group.recv([self._recv[p]], p, self.tag) for p in ps]
        buf = fill_envelope(self._send, header, payload, INLINE_MAX)
        works += [self.group.send([buf], p, self.tag) for p in ps]
        for w in works:
            w.wait()

    def payload(self, peer: int) -> torch.Tensor:
        """The bytes after ``peer``'s last header (empty when it sent none)."""
        n = int(self.words[peer][7])
        return self._recv[peer][HDR_BYTES : HDR_BYTES + max(0, min(n, INLINE_MAX))]

    def reason(self, peer: int) -> str:
        """The text of ``peer``'s last envelope (a REJECTED/FAILED one's reason)."""
        return bytes(self.payload(peer).numpy()).decode("utf-8", "replace")

    def send_raw(self, t: torch.Tensor, peer: int) -> dist.Work:
        """Send agreed bytes (a large payload) to ``peer`` on this tag."""
        return self.group.send([t], peer, self.tag)

    def recv_raw(self, t: torch.Tensor, peer: int) -> dist.Work:
        """Receive agreed bytes (a large payload) from ``peer`` on this tag."""
        return self.group.recv([t], peer, self.tag)



def fill_envelope(buf: torch.Tensor, header: np.ndarray, payload: torch.Tensor | None,
          limit: int) -> torch.Tensor:
    """Header + payload in ``buf``; returns the part to send (word 7: payload bytes or -1)."""
    words = buf[:HDR_BYTES].numpy().view(np.int64)
    words[:] = header
    if payload is None:
        words[7] = -1
        return buf[:HDR_BYTES]
    n = payload.numel()
    if n > limit:
        raise RuntimeError(f"internal: an envelope payload of {n} bytes exceeds {limit}")
    words[7] = n
    if n:
        buf[HDR_BYTES : HDR_BYTES + n].copy_(payload)
    return buf[: HDR_BYTES + n]


def failure_header(header: np.ndarray, status: int, culprit: int) -> np.ndarray:
    """A copy of ``header`` with a REJECTED/FAILED/SPLIT status naming ``culprit``."""
    if status not in (REJECTED, FAILED, SPLIT):
        raise ValueError(f"status must be REJECTED, FAILED or SPLIT, got {status}")
    h: np.ndarray = header.copy()
    h[5], h[6] = status, culprit
    return h


def reason_bytes(reason: str) -> torch.Tensor:
    """``reason`` as UTF-8 bytes, truncated to fit an envelope."""
    data = reason.encode("utf-8", "replace")[:_REASON_MAX]
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

