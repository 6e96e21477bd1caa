"""Point-to-point envelopes by direction: signed send/recv over gloo, one lock per direction.

A transfer from rank ``S`` to rank ``R`` belongs to one *direction*: ``S``'s
"send to ``R``" side and ``R``'s "receive from ``S``" side (a
:class:`P2PSide` each). The call's envelopes (:mod:`device_comms.signatures.envelopes`)
travel on two tags:

* :data:`DATA_TAG` (``S -> R``): the sender's header, with the payload when it
  is small (at most :data:`~device_comms.signatures.envelopes.INLINE_MAX` bytes), and a
  larger payload after both sides agreed;
* :data:`REPLY_TAG` (``R -> S``): the receiver's expectation (dtype, shape,
  source) or its rejection.

Gloo matches a receive to the messages of one (source, tag) in the order they
were sent, so the four message streams between two ranks (``S -> R`` data,
``R -> S`` replies, ``R -> S`` data, ``S -> R`` replies) never mix. A rank may
therefore send to and receive from the same peer at the same time, from two
threads: each rank of a pair posting a send and a receive to the other (the
exchange that asynchronous point-to-point calls make) cannot deadlock, which a
single tag carrying both sides' headers could.

Each side owns its buffers, its call counter (the sender's ``n``-th send to
``R`` pairs with ``R``'s ``n``-th receive from ``S``; both headers carry
``n``, so a skipped call is a mismatch) and a lock. A call holds its side's
lock from the envelope exchange to the end of the payload, so calls in one
direction are serialised whatever thread makes them, and calls in different
directions (or with different peers) run concurrently.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from device_comms.signatures.call_signature import HDR_BYTES
from device_comms.signatures.envelopes import INLINE_MAX, P2P_TAG, fill_envelope

__all__ = ["P2PSide", "P2PSides", "DATA_TAG", "REPLY_TAG", "SEND", "RECV"]

DATA_TAG = P2P_TAG  # sender -> receiver: header (+ small payload), then a large payload
REPLY_TAG = P2P_TAG + 1  # receiver -> sender: expectation or rejection
SEND, RECV = "send", "recv"
_REPLY_MAX = 4096  # a reply carries at most a rejection's reason


class P2PSide:
    """This rank's end of one direction with one peer.

    Args:
        group: The gloo process group.
        peer: The other rank (group rank).
        role: :data:`SEND` (this rank sends to ``peer``) or :data:`RECV`.

    Attributes:
        peer: The other rank.
        role: ``"send"`` or ``"recv"``.
        seq: Calls made in this direction so far (the next is ``seq + 1``).
        words: ``{peer: header words}`` of the peer's last envelope (numpy view).
        lock: Held for a whole call (see the module docstring).
    """

    def __init__(self, group: dist.ProcessGroup, peer: int, role: str) -> None:
        if role not in (SEND, RECV):
            raise ValueError(f"role must be {SEND!r} or {RECV!r}, got {role!r}")
        self.group, self.peer, self.role = group, peer, role
        self.seq = 0
        self.lock = threading.Lock()
        sending = role == SEND
        self._out_tag, self._in_tag = (DATA_TAG, REPLY_TAG) if sending else (REPLY_TAG, DATA_TAG)
        self._out_max = INLINE_MAX if sending else _REPLY_MAX
        self._in_max = _REPLY_MAX if sending else INLINE_MAX
        self._out = torch.empty(HDR_BYTES + self._out_max, dtype=torch.uint8)
        self._in = torch.empty(HDR_BYTES + self._in_max, dtype=torch.uint8)
        self.words = {peer: self._in[:HDR_BYTES].numpy().view(np.int64)}

    def exchange(self, header: np.ndarray, payload: torch.Tensor | None = None) -> None:
        """Send this side's envelope and receive the peer's (both wait for the other).

        Args:
            header: This rank's header words (call number included).
            payload: Flat bytes after the header (a small send's data, or a
                rejection's reason), or None.
        """
        work_in = self.group.recv([self._in], self.peer, self._in_tag)
        out = fill_envelope(self._out, header, payload, self._out_max)
        work_out = self.group.send([out], self.peer, self._out_tag)
        work_out.wait()
        work_in.wait()

    def payload(self) -> torch.Tensor:
        """The bytes after the peer's last header (empty when it sent none)."""
        n = int(self.words[self.peer][7])
        return self._in[HDR_BYTES : HDR_BYTES + max(0, min(n, self._in_max))]

    def reason(self, peer: int) -> str:
        """The text of the peer's last envelope (a REJECTED/FAILED one's reason)."""
        return bytes(self.payload().numpy()).decode("utf-8", "replace")

    def send_raw(self, t: torch.Tensor) -> dist.Work:
        """Send agreed bytes (a large payload) to the peer (sender side only)."""
        return self.group.send([t], self.peer, DATA_TAG)

    def recv_raw(self, t: torch.Tensor) -> dist.Work:
        """Receive agreed bytes (a large payload) from the peer (receiver side only)."""
        return self.group.recv([t], self.peer, DATA_TAG)


class P2PSides:
    """Every :class:`P2PSide` of one rank in one group, built at first use.

    Args:
        group: The gloo process group.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._sides: dict[tuple[int, str], P2PSide] = {}
        self._build = threading.Lock()

    @contextlib.contextmanager
    def hold(self, peer: int, role: str) -> Iterator[P2PSide]:
        """The side ``(peer, role)`` with its lock held for the ``with`` block."""
        side = self._sides.get((peer, role))
        if side is None:
            with self._build:
                side = self._sides.get((peer, role))
                if side is None:
                    side = self._sides[(peer, role)] = P2PSide(self.group, peer, role)
        with side.lock:
            yield side

