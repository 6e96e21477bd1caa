"""The writer's control channel: reader hellos, acks, goodbyes and subscriptions,
and the wait until every reader is attached.

What holds (see ``docs/security-channels.md``): control frames are validated
before they change any state. A hello counts only if it decodes as ``[rank,
pid, create_time, host, pid_space]``, comes from a routing id the queue expects
(``L<i>``: the local slot whose shared-memory registration has the same pid and
start time; ``R<rank>``: a rank that is not local, over a ZAP-authenticated
connection, at most ``n_remote`` of them), and is the first for that id. Acks
must be 8 bytes from a known remote reader and never beyond the messages sent.
Anything else is ignored and counted as ``bad_control``; nothing a peer sends
raises a decoder's exception in the writer.

The writer is ready when every reader has said hello and each one's data
subscription is in place: for a remote rank, its ``TOPIC_JOINED`` subscription
(sent after its data topic on the same connection) has arrived. A count of
data-topic subscriptions alone would also count an extra connection with an
admitted key, and READY would go out before a real reader could receive it.

A new connection under a routing id that is still attached takes the id over
(``ROUTER_HANDOVER``): a reader that reconnects before the writer saw its old
connection close can still say hello. The takeover gains nothing: an id whose
hello was accepted never counts a second one, only ZAP-admitted keys reach the
socket at all, and with per-reader keys every frame from ``R<rank>`` (hello,
ack, goodbye) must come over ``rank``'s own key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from shm_broadcast.errors import QueueClosedError, QueueTimeout
from shm_broadcast.queue.ring_buffer import READER_EMPTY
from shm_broadcast.queue.transport import (
    ACK,
    CTL_ACK,
    CTL_CLOSED,
    CTL_HELLO,
    KIND_READY,
    TOPIC_OVERFLOW,
    TOPIC_REMOTE,
    WIRE,
    ReaderAuthenticator,
    count_failed_handshakes,
    joined_rank,
    remove_channel_dir,
)
from shm_broadcast.waiting.policy import PeerWatch

if TYPE_CHECKING:
    from shm_broadcast.queue.ring_buffer import ShmRingBuffer

__all__ = ["WriterControl", "check_reader_keys"]

_Hello = tuple[int, int, float, str, str]  # rank, pid, start time, host, pid space
_MAX_JOINED = 4096  # joined-topic ranks tracked; more come only from a hostile client
_HELLO_DECODER = msgspec.msgpack.Decoder(_Hello)


class WriterControl:
    """The control-channel half of :class:`~shm_broadcast.queue.writer.QueueWriter`
    (a mixin: the writer owns the sockets and the bookkeeping it reads here)."""

    name: str
    side: str
    n_local: int
    n_remote: int
    local_ranks: tuple[int, ...]
    ring: ShmRingBuffer | None
    pub: zmq.Socket | None
    ctl: zmq.Socket | None
    _mon: zmq.Socket | None
    _pub_mon: zmq.Socket | None
    _auth: ReaderAuthenticator | None
    _closed: bool
    _closing: bool
    _ready: bool
    _channel_dir: str | None
    _reader_rings: list[Any]
    _seq: int
    _subs: dict[bytes, int]
    _joined: dict[int, int]
    _hello: dict[bytes, tuple[int, int, float, str]]
    _remote_fd: dict[int, int]
    _remote_acked: dict[int, int]
    _remote_min_acked: int
    _dead_remote: dict[int, str]
    _bad_control: int
    _failed_handshakes: int
    _said_goodbye: set[int]
    _local_watch: dict[int, PeerWatch]
    _reader_keys: dict[int, bytes] | None

    def wait_until_ready(self, timeout: float | None) -> None:
        """Block until every reader is attached and subscribed."""
        self._check_open("wait_until_ready")  # also once ready: a closed queue is unusable
        if self._ready:
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        poller.register(self.ctl, zmq.POLLIN)
        while True:
            self._drain_pub()
            self._drain_ctl()
            missing = self._missing_readers()
            if not missing:
                break
            if self._closing:
                raise QueueClosedError(
                    f"queue {self.name!r}: shut down while the writer waited for readers",
                    queue=self.name, side=self.side)
            self._raise_if_reader_dead(list(range(self.n_local)), list(self._remote_acked))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(
                    f"queue {self.name!r}: {self.side} waited {timeout:g} s for its readers "
                    f"to connect; still missing: {', '.join(missing)}",
                    queue=self.name, side=self.side, peers=missing)
            wait = 0.1 if deadline is None else min(0.1, deadline - now)
            poller.poll(max(1, int(wait * 1000)))
        self._ready = True
        if self.ring is not None:
            self._seal_channel_dir()
            self.ring.set_ready()
            self._ring_readers(range(self.n_local))
        if self.n_remote:
            self.pub.send(TOPIC_REMOTE + WIRE.pack(0, KIND_READY, 0, 0))

    def _seal_channel_dir(self) -> None:
        """Every local reader is connected: drop the paths nobody needs any more.

        Each reader bound its doorbell before its hello, so every line
        connects now; zmq's ipc connections are established (hellos and
        subscriptions came through them) and never reconnect. After this no
        path into the queue exists, and a crash cannot leak the directory.
        """
        for ring in self._reader_rings:
            ring.connect()
        remove_channel_dir(self._channel_dir)

    def _missing_readers(self) -> list[str]:
        missing = [f"local reader rank {r}" for i, r in enumerate(self.local_ranks)
                   if b"L%d" % i not in self._hello]
        remote = [info[0] for k, info in self._hello.items() if k[:1] == b"R"]
        if len(remote) < self.n_remote:
            missing.append(f"{self.n_remote - len(remote)} remote reader(s)")
        if not missing and (self._subs[TOPIC_OVERFLOW] < self.n_local
                            or self._subs[TOPIC_REMOTE] < self.n_remote
                            or any(self._joined.get(r, 0) < 1 for r in remote)):
            missing.append("subscriptions still in flight")
        return missing

    def _drain_pub(self) -> None:
        pub = self.pub
        try:
            while True:
                msg = pub.recv(zmq.NOBLOCK)
                # VERBOSER: every (un)subscription, also one of a peer that left
                step = {b"\x01": 1, b"\x00": -1}.get(msg[:1], 0)
                if msg[1:] in self._subs:
                    self._subs[msg[1:]] += step
                    continue
                rank = joined_rank(msg[1:])
                if rank is not None and (rank in self._joined or len(self._joined) < _MAX_JOINED):
                    self._joined[rank] = self._joined.get(rank, 0) + step
        except zmq.Again:
            pass

    def _drain_ctl(self) -> None:
        ctl = self.ctl
        if ctl is None:
            return
        try:
            while True:
                frames = ctl.recv_multipart(zmq.NOBLOCK, copy=False)
                if len(frames) == 2:
                    self._on_ctl(frames[0].bytes, frames[1])
                else:
                    self._bad_control += 1
        except zmq.Again:
            pass
        if self._mon is not None:
            failed, gone = count_failed_handshakes(self._mon)
            self._failed_handshakes += failed
            for fd in gone:
                rank = self._remote_fd.pop(fd, None)
                if rank is not None and rank not in self._said_goodbye:
                    self._dead_remote[rank] = "its connection to the writer dropped"

    def _on_ctl(self, ident: bytes, frame: zmq.Frame) -> None:
        """Apply one control frame if it is valid (module docstring); else count it."""
        body = frame.bytes
        kind = body[:1]
        info = self._hello.get(ident)
        if (self._reader_keys is not None and ident[:1] == b"R"
                and _user_id(frame) != ident.decode("ascii", "replace")):
            self._bad_control += 1  # per-reader keys: R<rank> speaks only with rank's key
            return
        if kind == CTL_HELLO:
            ok = info is None and self._accept_hello(ident, frame, body)
        elif kind == CTL_ACK:
            ok = info is not None and ident[:1] == b"R" and len(body) == 1 + ACK.size
            if ok:
                n = ACK.unpack_from(body, 1)[0]
                ok = n <= self._seq  # an ack for messages never sent is forged
                if ok:
                    self._remote_acked[info[0]] = max(n, self._remote_acked[info[0]])
                    self._remote_min_acked = min(self._remote_acked.values())
        elif kind == CTL_CLOSED:
            ok = info is not None and len(body) == 1
            if ok:
                self._said_goodbye.add(info[0])
        else:
            ok = False
        if not ok:
            self._bad_control += 1

    def _accept_hello(self, ident: bytes, frame: zmq.Frame, body: bytes) -> bool:
        """Record a reader's first hello if it is consistent; returns whether it was."""
        try:
            rank, pid, ctime, host, pid_space = _HELLO_DECODER.decode(body[1:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        slot = _slot_of(ident)
        if slot is None or rank < 0 or pid <= 0:
            return False
        if ident[:1] == b"L":
            if not (slot < self.n_local and self.local_ranks[slot] == rank
                    and self.ring is not None and self.ring.reader_state(slot) != READER_EMPTY):
                return False
            rpid, rctime = self.ring.reader_identity(slot)
            if rpid != pid or abs(rctime - ctime) > 1e-3:
                return False  # not the process registered in the ring for this slot
            self._hello[ident] = (rank, pid, ctime, host)
            return True
        n_remote_seen = sum(1 for k in self._hello if k[:1] == b"R")
        user = _user_id(frame)
        if (slot != rank or rank in self.local_ranks or n_remote_seen >= self.n_remote
                or not user or (self._reader_keys is not None and user != f"R{rank}")):
            return False  # per-reader keys: R<rank> must speak with rank's own key
        self._hello[ident] = (rank, pid, ctime, host)
        self._remote_fd[frame.get(zmq.SRCFD)] = rank
        self._remote_acked.setdefault(rank, 0)
        # checked by pid only from the reader's own pid space, whatever its hostname
        self._local_watch[-1 - rank] = PeerWatch(pid, ctime, host, pid_space=pid_space)
        return True

    def security_stats(self) -> dict[str, int]:
        """Counters of what the writer refused (diagnostics; cheap).

        Returns:
            ``{"auth_denied": ZAP refusals of an unknown client key,
            "handshake_failed": TCP handshakes that did not complete (no or
            wrong keys, another mechanism, ZAP refusal), "bad_control":
            control frames ignored as malformed, forged or out of place}``.
        """
        if not self._closed:
            self._drain_ctl()
            failed, _ = count_failed_handshakes(self._pub_mon)
            self._failed_handshakes += failed
        return {"auth_denied": self._auth.denied if self._auth is not None else 0,
                "handshake_failed": self._failed_handshakes,
                "bad_control": self._bad_control}


def _slot_of(ident: bytes) -> int | None:
    """The number in a routing id ``L<n>`` / ``R<n>``, or None if it is not one."""
    if len(ident) < 2 or ident[:1] not in (b"L", b"R") or not ident[1:].isdigit():
        return None
    return int(ident[1:])


def _user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of ``frame``'s connection; ``""`` if ZAP did not admit it
    (ipc connections have none)."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


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
    return keys
