"""How much the writer takes in from each peer on its two receiving sockets.

The writer receives only small, protocol-bounded traffic (see
``docs/security-channels.md``, "Inbound limits"): on its data socket (XPUB)
each reader's subscriptions, on its control socket (ROUTER) each reader's
hello, acks and goodbye. What holds, per peer:

* **Subscriptions, per client key.** Every (un)subscription a TCP peer sends
  carries its key's ZAP label (``R<rank>``, or ``reader`` for a shared key).
  A key may send :data:`SUBSCRIPTIONS_PER_KEY` of them over the queue's life
  (a shared key that many per remote reader); the first one beyond is the
  key's *cut-off*: nothing more from it is applied, and the writer ends the
  queue (libzmq's XPUB keeps every subscription of a connected peer until
  the connection closes and cannot close one peer, so only closing the
  queue bounds what a key holder that goes on makes it keep).
* **Invalid control frames, per connection** (its routing id): a reader
  never sends one. After :data:`BAD_FRAMES_PER_PEER` of them every later
  frame of that connection is read and dropped unparsed.
* **Messages of more parts than the protocol's, per client key.** A
  subscription is one frame, a control message one frame after the routing
  id; the first message with more parts cuts its key off as above (over ipc
  it counts as an invalid frame), and its parts are dropped unread.
* **Work per call**: a drain takes at most :data:`DRAIN_FRAMES` messages, or
  dropped parts of a too-long one, off a socket; the rest wait in zmq's
  bounded queue (``transport.CONTROL_QUEUE_FRAMES`` messages per connection)
  and the peer's kernel buffers.

Valid control frames need no budget of their own: a reader sends one hello,
one goodbye, and acks whose counts strictly increase up to the messages sent,
so valid frames are at most one per message the writer sent.
"""

from __future__ import annotations

__all__ = ["SUBSCRIPTIONS_PER_KEY", "BAD_FRAMES_PER_PEER", "DRAIN_FRAMES", "PeerBudgets"]

#: (Un)subscriptions one reader key may send over the queue's life. A reader
#: subscribes twice (its data topic and its joined topic) on the one connection
#: it opens; ZAP admits a key twice per socket
#: (``transport.CONNECTIONS_PER_KEY``), which makes four; twice that is allowed.
SUBSCRIPTIONS_PER_KEY = 8
#: Invalid control frames one connection may send before all of its frames are
#: dropped unread. A reader sends none; the allowance keeps every rejected
#: frame of a confused peer counted as ``bad_control`` before it is muted.
BAD_FRAMES_PER_PEER = 16
#: Most frames one drain takes off one socket (a bound on the work an enqueue,
#: a wait step or ``security_stats`` does for inbound traffic).
DRAIN_FRAMES = 256


class PeerBudgets:
    """Per-key subscription counts and per-connection invalid-frame counts.

    Args:
        subscriptions_per_key: What one key label may send
            (:data:`SUBSCRIPTIONS_PER_KEY`, times the remote readers for a
            shared key).

    Attributes:
        cut_off: Key label -> why it was cut off (it sent more than its budget).
        subscriptions_dropped: Subscriptions not applied: beyond a key's
            budget, not one of the queue's topics, or from the wrong key.
        bad_control: Invalid control frames that were parsed and refused.
        control_dropped: Frames of muted connections, dropped unparsed.
    """

    def __init__(self, subscriptions_per_key: int) -> None:
        self.subscriptions_per_key = subscriptions_per_key
        self._subscriptions: dict[str, int] = {}
        self._bad: dict[bytes, int] = {}
        self.cut_off: dict[str, str] = {}
        self.subscriptions_dropped = 0
        self.bad_control = 0
        self.control_dropped = 0

    def take_subscription(self, label: str) -> bool:
        """Charge one (un)subscription to key ``label``; whether it may be applied.

        The first one beyond the budget cuts the key off; it and every later
        one are counted as dropped.
        """
        n = self._subscriptions.get(label, 0) + 1
        self._subscriptions[label] = n
        if n > self.subscriptions_per_key:
            self.cut(label, f"sent more than {self.subscriptions_per_key} subscriptions")
            self.subscriptions_dropped += 1
            return False
        return True

    def cut(self, label: str, why: str) -> None:
        """Cut key ``label`` off (the first reason given stays)."""
        self.cut_off.setdefault(label, why)

    def drop_subscription(self) -> None:
        """Count a subscription that is not applied (not the queue's, or wrong key)."""
        self.subscriptions_dropped += 1

    def muted(self, ident: bytes) -> bool:
        """Whether connection ``ident`` used up its invalid frames (then count this one)."""
        if self._bad.get(ident, 0) < BAD_FRAMES_PER_PEER:
            return False
        self.control_dropped += 1
        return True

    def refuse(self, ident: bytes) -> None:
        """Count an invalid frame from connection ``ident``."""
        self.bad_control += 1
        self._bad[ident] = self._bad.get(ident, 0) + 1
