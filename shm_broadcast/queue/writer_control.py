"""The writer's control channel: reader hellos, acks, goodbyes and subscriptions,
and who is still missing before the queue is ready.

What holds (see ``docs/security-channels.md``): control frames are validated
before they change any state. A hello counts only if it decodes as ``[rank,
pid, create_time, host, pid_space]``, comes from a routing id the queue expects
(``L<i>``: over ipc, the local slot whose shared-memory registration has the
same pid and start time; ``R<rank>``: a rank that is not local, over a
ZAP-authenticated connection, at most ``n_remote`` of them), and is the first
for that slot or rank. Acks must be 8 bytes from a known remote reader over
the key it said hello with, strictly increase (a reader acks each count once)
and never go beyond the messages sent. Anything else is ignored and counted
as ``bad_control``; nothing a peer sends raises a decoder's exception in the
writer.

Subscriptions count only from the peer they belong to: the overflow topic
from a local (ipc) reader, the data topic and ``TOPIC_JOINED + rank`` from a
ZAP-admitted TCP connection, and with per-reader keys the joined topic of
``rank`` only over ``rank``'s own key. Any other subscription is dropped and
counted (``subscriptions_dropped``), never stored by this object. An
unsubscription undoes only a subscription the writer accepted from the same
key. Unsubscriptions libzmq makes itself when a connection ends carry no key
and name every topic that connection had, also the ones the writer dropped
(libzmq's XPUB records every subscription it receives, even with
``XPUB_MANUAL``): they cannot be told apart from a departed reader's, so they
change no count and are charged to nobody. No reader unsubscribes or
reconnects, and a reader whose connection ended is noticed by its control
connection and its liveness watch, not by its subscriptions.

Messages come in whole (libzmq delivers every part of a message or none) and
are read frame by frame: a control message is a routing id and one frame, a
subscription one frame. The first message with more parts cuts its key off
(over ipc: counts as invalid) and its remaining parts are read and dropped
within each drain's frame budget, never built into one list.

A remote reader's control connection ending (the monitor's ``DISCONNECTED``
event for its file descriptor) means the reader is gone. The descriptor is
noted at the hello, after the monitor's events so far were taken in: every
event of a connection that used the same descriptor before the reader's was
reported before the reader's connection was accepted, hence before its
hello arrived, and is taken in (and ignored) first; a disconnect counts only
when it is read after the hello.

How much each peer may send, and how much one call takes in, is
:mod:`shm_broadcast.queue.inbound_limits`'s: a connection's frames beyond its
invalid-frame budget are dropped unparsed, and a key's subscriptions beyond
its budget cut that key off (``budgets.cut_off``; the writer then ends the
queue).

The writer is ready when every reader has said hello and each one's data
subscription is in place: for a remote rank, its ``TOPIC_JOINED`` subscription
(sent after its data topic on the same connection) has arrived. A count of
data-topic subscriptions alone would also count an extra connection with an
admitted key, and READY would go out before a real reader could receive it.

A reader's routing id is ``L<slot>`` or ``R<rank>`` followed by a random part
(:func:`~shm_broadcast.queue.transport.reader_routing_id`); the writer reads
the slot or rank from it and accepts one hello per slot or rank. A new
connection under an attached id takes the id over (``ROUTER_HANDOVER``) and
closes the earlier connection, so ids must not be guessable: a peer that
claims a slot or rank first, under an id of its own, gains nothing either
(the real reader's id differs, and its hello is judged on its own). Only
ZAP-admitted keys reach the TCP socket at all, and with per-reader keys every
frame of a remote reader (hello, ack, goodbye) must come over its rank's own
key.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec
import zmq

from shm_broadcast.queue.inbound_limits import DRAIN_FRAMES, SUBSCRIPTIONS_PER_KEY, PeerBudgets
from shm_broadcast.queue.monitor_drain import MonitorDrain
from shm_broadcast.queue.ring_buffer import READER_EMPTY, ShmRingBuffer
from shm_broadcast.queue.transport import (
    ACK,
    CTL_ACK,
    CTL_CLOSED,
    CTL_HELLO,
    TOPIC_OVERFLOW,
    TOPIC_REMOTE,
    ReaderAuthenticator,
    joined_rank,
    parse_routing_id,
)
from shm_broadcast.waiting.peer_watch import PeerWatch

__all__ = ["WriterControl", "check_reader_keys"]

_Hello = tuple[int, int, float, str, str]  # rank, pid, start time, host, pid space
_HELLO_DECODER = msgspec.msgpack.Decoder(_Hello)
_STEP = {1: 1, 0: -1}  # first byte of an XPUB notification: subscribe, unsubscribe


class WriterControl:
    """What the writer learns from its readers over zmq: hellos, subscriptions,
    acks, goodbyes, dropped connections, and what it refused.

    Owned by :class:`~shm_broadcast.queue.writer.QueueWriter` (one per writer
    with readers), which made the sockets; this object reads them and keeps
    the bookkeeping, and the writer decides from it.

    Args:
        local_ranks: Ranks of the local readers, in slot order.
        n_remote: How many readers are remote.
        per_reader_keys: Whether every remote reader has a key of its own
            (labelled ``R<rank>``); False: the one client keypair the handle
            carries (a single remote reader's, or shared by opt-in).
        ring: The shared ring (None without local readers): a local hello
            must come from the process registered in its slot.
        pub: The writer's XPUB data socket (subscriptions arrive on it).
        ctl: The writer's ROUTER control socket.
        mon: Monitor of ``ctl``'s TCP connections (None without remote readers):
            the writer polls it to learn of a dropped reader at once.
        monitors: What empties ``mon`` and the data socket's monitor
            (likewise None), in the background too.
        auth: The ZAP handler (likewise).

    Attributes:
        acked: Remote rank -> messages it acknowledged (every rank that said hello).
        min_acked: The least of ``acked`` (0 before any ack).
        said_goodbye: Ranks whose goodbye (``CTL_CLOSED``) arrived.
        dead_remote: Remote rank -> why its connection is known gone.
        remote_watch: Remote rank -> a watch on the process its hello named.
        budgets: What each peer may still send, and what was dropped
            (:class:`~shm_broadcast.queue.inbound_limits.PeerBudgets`); its
            ``cut_off`` names the keys that sent more subscriptions than a
            reader does.
    """

    def __init__(self, *, local_ranks: tuple[int, ...], n_remote: int, per_reader_keys: bool,
                 ring: ShmRingBuffer | None, pub: zmq.SyncSocket, ctl: zmq.SyncSocket,
                 mon: zmq.SyncSocket | None, monitors: MonitorDrain | None,
                 auth: ReaderAuthenticator | None) -> None:
        self.local_ranks = local_ranks
        self.n_local = len(local_ranks)
        self.n_remote = n_remote
        self.pub, self.ctl, self.mon = pub, ctl, mon
        self._per_reader_keys = per_reader_keys
        self._ring = ring
        self.monitors = monitors
        self._auth = auth
        self._subs = {TOPIC_OVERFLOW: 0, TOPIC_REMOTE: 0}
        self._joined: dict[int, int] = {}  # remote rank -> its joined-topic subscriptions
        #: Routing id -> (rank, ZAP label; "" over ipc) of each accepted hello.
        self._hello: dict[bytes, tuple[int, str]] = {}
        self._local_seen: set[int] = set()  # slots whose hello was accepted
        self._remote_seen: set[int] = set()  # remote ranks whose hello was accepted
        self._remote_fd: dict[int, int] = {}  # control connection's fd -> remote rank
        #: (key label, topic) -> subscriptions accepted from that key and not undone.
        self._accepted: dict[tuple[str, bytes], int] = {}
        #: Whether a message with too many parts is still being dropped, per socket.
        self._skipping = {"ctl": False, "pub": False}
        self.acked: dict[int, int] = {}
        self.min_acked = 0
        self.dead_remote: dict[int, str] = {}
        self.said_goodbye: set[int] = set()
        self.remote_watch: dict[int, PeerWatch] = {}
        self.budgets = PeerBudgets(SUBSCRIPTIONS_PER_KEY if per_reader_keys
                                   else SUBSCRIPTIONS_PER_KEY * max(1, n_remote))
        self._failed_handshakes = 0

    def missing_readers(self, remote_ranks: Collection[int] | None = None) -> list[str]:
        """Who the writer still waits for before it is ready (module docstring).

        Args:
            remote_ranks: The remote readers' ranks, when the writer knows them
                (their keys): the missing ones are named, else counted.
        """
        missing = [f"local reader rank {r}" for i, r in enumerate(self.local_ranks)
                   if i not in self._local_seen]
        remote = self._remote_seen
        if len(remote) < self.n_remote:
            unseen = self.missing_remote(remote_ranks)
            missing.append(f"remote reader rank(s) {unseen}" if unseen
                           else f"{self.n_remote - len(remote)} remote reader(s)")
        if not missing and (self._subs[TOPIC_OVERFLOW] < self.n_local
                            or self._subs[TOPIC_REMOTE] < self.n_remote
                            or any(self._joined.get(r, 0) < 1 for r in remote)):
            missing.append("subscriptions still in flight")
        return missing

    def missing_local(self) -> list[int]:
        """The local readers' ranks whose hello has not arrived."""
        return [r for i, r in enumerate(self.local_ranks) if i not in self._local_seen]

    def missing_remote(self, remote_ranks: Collection[int] | None) -> list[int]:
        """Of ``remote_ranks`` (None: not known), those whose hello was not accepted."""
        if remote_ranks is None:
            return []
        return sorted(set(remote_ranks) - self._remote_seen)

    def lagging(self, need: int) -> list[int]:
        """Remote ranks that acknowledged fewer than ``need`` messages."""
        return [r for r, n in self.acked.items() if n < need]

    def drain_subscriptions(self) -> None:
        """Apply the (un)subscriptions that arrived on the XPUB socket (at most
        :data:`~shm_broadcast.queue.inbound_limits.DRAIN_FRAMES` frames per call)."""
        pub = self.pub
        if not pub.get(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]  # EVENTS is an int
            return
        budgets = self.budgets
        left = DRAIN_FRAMES
        if self._skipping["pub"]:
            left = self._skip_parts("pub", pub, left)
        while left > 0:
            try:
                frame = pub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            left -= 1
            # VERBOSER: every (un)subscription, also one of a peer that left
            label = _user_id(frame)
            if frame.more:  # a subscription is one frame
                self._refuse_long_message(label, b"")
                self._skipping["pub"] = True
                left = self._skip_parts("pub", pub, left)
                continue
            msg = frame.bytes
            step = _STEP.get(msg[0], 0) if msg else 0
            if label and not budgets.take_subscription(label):
                continue
            if not (step and self._apply_subscription(msg[1:], step, label)):
                budgets.drop_subscription()

    def _apply_subscription(self, topic: bytes, step: int, label: str) -> bool:
        """Count one (un)subscription from key ``label`` (``""``: an ipc peer, or
        libzmq's own unsubscription of a peer that left) if it is the queue's
        and that peer's (module docstring); returns whether it was."""
        if step < 0:
            if not label:
                return True  # libzmq's, or a local peer's: changes nothing (module docstring)
            return self._undo_subscription(topic, label)
        if topic == TOPIC_OVERFLOW:
            ok = not label  # the local readers' topic
        elif topic == TOPIC_REMOTE:
            ok = bool(label)
        else:
            rank = joined_rank(topic)
            ok = (rank is not None and bool(label) and rank not in self.local_ranks
                  and (not self._per_reader_keys or label == f"R{rank}"))
            if ok and rank is not None:
                self._joined[rank] = self._joined.get(rank, 0) + 1
        if not ok:
            return False
        if topic in self._subs:
            self._subs[topic] += 1
        if label:
            key = (label, topic)
            self._accepted[key] = self._accepted.get(key, 0) + 1
        return True

    def _undo_subscription(self, topic: bytes, label: str) -> bool:
        """Undo one subscription key ``label`` had made to ``topic``, if it had."""
        key = (label, topic)
        n = self._accepted.get(key, 0)
        if n <= 0:
            return False
        self._accepted[key] = n - 1
        if topic in self._subs:
            self._subs[topic] -= 1
        else:
            rank = joined_rank(topic)
            if rank is not None:
                self._joined[rank] -= 1
        return True

    def _refuse_long_message(self, label: str, ident: bytes) -> None:
        """A message with more parts than the protocol's: cut its key off (over
        ipc, where no key exists, count it as an invalid frame of ``ident``)."""
        if label:
            self.budgets.cut(label, "sent a message of more parts than a reader's")
        else:
            self.budgets.refuse(ident)

    def _skip_parts(self, which: str, sock: zmq.SyncSocket, left: int) -> int:
        """Drop the rest of a message with too many parts, at most ``left``
        frames of it; returns the frames left of this drain's budget."""
        while left > 0:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # cannot happen: messages come in whole
                self._skipping[which] = False
                return left
            left -= 1
            if not frame.more:
                self._skipping[which] = False
                return left
        return 0

    def drain(self, sent: int) -> None:
        """Apply the control frames that arrived (at most
        :data:`~shm_broadcast.queue.inbound_limits.DRAIN_FRAMES` messages or
        dropped parts per call) and note dropped TCP connections.

        Args:
            sent: Messages the writer has sent (an ack beyond it is forged).
        """
        ctl = self.ctl
        budgets = self.budgets
        acked = self.min_acked
        left = DRAIN_FRAMES
        if self._skipping["ctl"]:
            left = self._skip_parts("ctl", ctl, left)
        while left > 0:
            try:
                head = ctl.recv(zmq.NOBLOCK, copy=False)  # the routing id
            except zmq.Again:
                break
            left -= 1
            ident = head.bytes
            if not head.more:  # cannot happen: a ROUTER adds the id to every message
                budgets.refuse(ident)
                continue
            body = ctl.recv(zmq.NOBLOCK, copy=False)  # there: messages come in whole
            if body.more:
                self._refuse_long_message(_user_id(body), ident)
                self._skipping["ctl"] = True
                left = self._skip_parts("ctl", ctl, left)
                continue
            if budgets.muted(ident):
                continue
            if not self._on_ctl(ident, body, sent):
                budgets.refuse(ident)
        if self.min_acked != acked:
            # The credit grew: have the data socket take in libzmq's reports of
            # what left its queues before anything is sent against that credit
            # (transport.outbound_queue_messages).
            self.pub.get(zmq.EVENTS)
        self._take_monitor()

    def _take_monitor(self) -> None:
        """Count failed handshakes (of both sockets: their monitors' pipes are
        unbounded, so each drain empties them); a disconnect of a remote reader's
        control connection marks it dead (unless it said goodbye)."""
        if self.monitors is None:
            return
        failed, gone = self.monitors.take()
        self._failed_handshakes += failed
        for fd in gone:
            rank = self._remote_fd.pop(fd, None)
            if rank is not None and rank not in self.said_goodbye:
                self.dead_remote[rank] = "its connection to the writer dropped"

    def _on_ctl(self, ident: bytes, frame: zmq.Frame, sent: int) -> bool:
        """Apply one control frame if it is valid (module docstring); returns whether it was."""
        body = frame.bytes
        kind = body[:1]
        info = self._hello.get(ident)
        if kind == CTL_HELLO:
            return info is None and self._accept_hello(ident, frame, body)
        if info is None:
            return False
        rank, label = info
        if label and _user_id(frame) != label:
            return False  # a remote reader speaks only with the key it said hello with
        if kind == CTL_ACK:
            if not label or len(body) != 1 + ACK.size:
                return False  # acks are for remote readers
            n = ACK.unpack_from(body, 1)[0]
            if not self.acked[rank] < n <= sent:
                return False  # acks strictly increase; one for messages never sent is forged
            self.acked[rank] = n
            self.min_acked = min(self.acked.values())
            return True
        if kind == CTL_CLOSED and len(body) == 1:
            self.said_goodbye.add(rank)
            return True
        return False

    def _accept_hello(self, ident: bytes, frame: zmq.Frame, body: bytes) -> bool:
        """Record a reader's first hello if it is consistent; returns whether it was."""
        try:
            rank, pid, ctime, host, pid_space = _HELLO_DECODER.decode(body[1:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        named = parse_routing_id(ident)
        if named is None or rank < 0 or pid <= 0:
            return False
        side, slot = named
        user = _user_id(frame)
        if side == b"L":
            ring = self._ring
            if not (not user and slot < self.n_local and self.local_ranks[slot] == rank
                    and slot not in self._local_seen
                    and ring is not None and ring.reader_state(slot) != READER_EMPTY):
                return False
            rpid, rctime = ring.reader_identity(slot)
            if rpid != pid or abs(rctime - ctime) > 1e-3:
                return False  # not the process registered in the ring for this slot
            self._hello[ident] = (rank, "")
            self._local_seen.add(slot)
            return True
        if (slot != rank or rank in self.local_ranks or rank in self._remote_seen
                or len(self._remote_seen) >= self.n_remote
                or not user or (self._per_reader_keys and user != f"R{rank}")):
            return False  # per-reader keys: R<rank> must speak with rank's own key
        self._hello[ident] = (rank, user)
        self._remote_seen.add(rank)
        # Take in the monitor's events first: those of earlier connections on
        # the same descriptor (module docstring).
        self._take_monitor()
        self._remote_fd[frame.get(zmq.SRCFD)] = rank
        self.acked.setdefault(rank, 0)
        # checked by pid only from the reader's own pid space, whatever its hostname
        self.remote_watch[rank] = PeerWatch(pid, ctime, host, pid_space=pid_space)
        return True

    def security_stats(self, drain: bool, sent: int) -> dict[str, int]:
        """Counters of what the writer refused (diagnostics; cheap).

        Args:
            drain: Take in what arrived first (False once the sockets are closed).
            sent: As for :meth:`drain`.

        Returns:
            ``{"auth_denied": ZAP refusals of an unknown client key,
            "auth_over_limit": ZAP refusals of a known key that used up its
            connections, "handshake_failed": TCP handshakes that did not
            complete (no or wrong keys, another mechanism, ZAP refusal),
            "bad_control": control frames ignored as malformed, forged or out
            of place, "control_dropped": frames of a connection that used up
            its invalid frames, dropped unparsed, "subscriptions_dropped":
            subscriptions not applied (not the queue's topics, the wrong key,
            or beyond the key's budget)}``.
        """
        if drain:
            self.drain(sent)
            self.drain_subscriptions()
        auth, budgets = self._auth, self.budgets
        return {"auth_denied": auth.denied if auth is not None else 0,
                "auth_over_limit": auth.over_limit if auth is not None else 0,
                "handshake_failed": self._failed_handshakes,
                "bad_control": budgets.bad_control,
                "control_dropped": budgets.control_dropped,
                "subscriptions_dropped": budgets.subscriptions_dropped}


def _user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of ``frame``'s connection; ``""`` if ZAP did not admit it
    (ipc connections have none)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""
    return user if isinstance(user, str) else ""


def check_reader_keys(keys: Any, n_remote: int,
                       local_ranks: tuple[int, ...]) -> dict[int, bytes] | None:
    """Validate ``remote_reader_keys``: one Z85 public key per remote rank.

    Raises:
        TypeError: Not a dict of int ranks to bytes keys.
        ValueError: Wrong count, a local rank, or a key that is not 40 bytes.
    """
    if keys is None:
        return None
    if not isinstance(keys, Mapping):
        raise TypeError(f"remote_reader_keys must be a dict of reader rank -> public key, "
                        f"got {type(keys).__name__}")
    keys = dict(keys)
    for r, k in keys.items():
        if not isinstance(r, int) or isinstance(r, bool) or not isinstance(k, bytes):
            raise TypeError(f"remote_reader_keys must map int ranks to bytes keys, got "
                            f"{type(r).__name__} -> {type(k).__name__} (rank {r!r:.30})")
    bad = [r for r, k in keys.items() if r < 0 or r in local_ranks or len(k) != 40]
    if len(keys) != n_remote or bad or len(set(keys.values())) != len(keys):
        raise ValueError(
            f"remote_reader_keys must map each of the {n_remote} remote reader ranks to its "
            f"own 40-byte Z85 CURVE public key; got ranks {sorted(keys)} (invalid: {bad})")
    checked: dict[int, bytes] = keys  # every item's types were checked above
    return checked
