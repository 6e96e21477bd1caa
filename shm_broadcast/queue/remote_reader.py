"""RemoteReader: a reader on another node, served over zmq PUB/SUB on TCP.

Every message arrives on the writer's ``m`` topic as one frame ``topic +
header + msgpack + arrays`` when its arrays total under 64 KiB, else as two
frames ``[topic + header + msgpack, arrays]`` (sent without copying). Flow
control keeps the writer from running away from a slow remote reader: the
reader acks its cumulative count every ``remote_window // 4`` messages on
its DEALER, and the writer waits once it is ``remote_window`` messages ahead
of the slowest remote reader.

A wait for a message that lasts is logged with the writer and how long ago
the last message arrived (:mod:`shm_broadcast.queue.laggards`): known exactly
when that message ended a wait (the common case of an idle reader), else the
wait's own length is given as a lower bound; messages that were there when
asked for are not timed.

Liveness: a socket monitor reports the TCP connection to the writer dropping
(a dead process's sockets are closed by its kernel; a vanished host is caught
by kernel TCP keepalive); on the same host the writer's pid is also checked.
A writer that is paused (``SIGSTOP``, a debugger) keeps its connection and is
waited for: a timeout case, never ``PeerDiedError`` (see
:mod:`shm_broadcast.queue.transport`).

Authentication and no reconnection (protocol; what holds):

* Both sockets are CURVE clients of the writer's key from the handle, with
  this reader's own client keypair (``curve_keypair``) or the one its handle
  carries (made for this rank, or the queue's one key: a single remote
  reader's, or shared by opt-in); a handle without CURVE keys, or with
  another rank's, is refused (``ValueError``): this reader never talks plain
  TCP. A frame can therefore only come from a peer holding the writer's
  secret key.
* No reconnection (``ZMQ_RECONNECT_IVL`` of 12.4 days; see
  :mod:`shm_broadcast.queue.transport` for why not ``-1``): the SUB makes one
  connection. When it drops, the reader delivers the frames that had already
  arrived -- they came through the authenticated connection, from the writer
  -- and then raises ``PeerDiedError``, as the queue's contract says.
* Before using any frame the reader drains its monitor: a second successful
  handshake (impossible by the above, checked anyway), or a failed handshake
  before the first success (the peer at the address is not the writer), makes
  it raise ``PeerDiedError`` and decode nothing. A failed handshake after the
  first success means the writer is gone. A process that binds the writer's
  old port after the writer died is never connected to, and could not
  authenticate if it were.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from typing import Any

import msgspec
import psutil
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from shm_broadcast.codec.message_codec import Codec
from shm_broadcast.errors import (
    DecodeError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    ShmBroadcastError,
)
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.laggards import LastMessage, WaitWarnings, logger, reader_warning
from shm_broadcast.queue.options import DEFAULT_WARN_INTERVAL
from shm_broadcast.queue.transport import (
    ACK,
    CTL_ACK,
    CTL_HELLO,
    HANDSHAKE_FAILED,
    KIND_READY,
    KIND_SHUTDOWN,
    TOPIC_REMOTE,
    WIRE,
    close_all,
    close_dealer,
    guard_zmq,
    joined_topic,
    make_curve_client,
    new_socket,
    open_monitor,
    reader_routing_id,
    say_goodbye,
    stop_monitor,
)
from shm_broadcast.waiting.peer_watch import PeerWatch, own_pid_space
from shm_broadcast.waiting.policy import Backoff, WaitPolicy

__all__ = ["RemoteReader"]

#: Where the msgpack bytes start in a frame: topic byte + header.
_HEAD = 1 + WIRE.size


class RemoteReader:
    """Reader side over TCP; used through :class:`MessageQueue`.

    Args:
        handle: The writer's handle (must have ``remote_pub``).
        rank: This reader's rank; must not be in ``handle.local_reader_ranks``.
        policy: Waiting policy (liveness interval and park poll bound).
        codec: Decoder.
        client_keypair: This reader's own Z85 ``(public, secret)`` CURVE keys,
            whose public half the writer was given (``remote_reader_keys``);
            default: the keypair the handle carries (``export_handle(rank)``'s).
        warn_interval: Seconds a wait for a message lasts before it is logged
            (with the writer and the last message's age), and between such
            warnings (> 0).
    """

    def __init__(self, handle: Handle, rank: int, policy: WaitPolicy, codec: Codec,
                 client_keypair: tuple[bytes, bytes] | None = None,
                 warn_interval: float = DEFAULT_WARN_INTERVAL) -> None:
        self.name = handle.name
        self.rank = rank
        self.side = f"remote reader rank {rank}"
        self.codec = codec
        self._pid = os.getpid()
        self._owner_thread = threading.get_ident()
        # checked by pid only from the writer's own pid space, whatever its hostname
        self._writer = PeerWatch(handle.writer_pid, handle.writer_create_time,
                                 handle.writer_host, pid_space=handle.writer_pid_space)
        wr = "" if handle.writer_rank is None else f" rank {handle.writer_rank}"
        self._writer_desc = f"writer{wr} ({self._writer.describe()})"
        #: What errors put in ``peers`` for the writer: its rank where the handle
        #: has one (a group's queue), else the role.
        self._writer_peer: int | str = ("writer" if handle.writer_rank is None
                                        else handle.writer_rank)
        self._ack_every = max(1, handle.remote_window // 4)
        self._seq = 0
        #: Same keys as a local reader's; a remote reader never parks on a doorbell.
        self.park_stats = {"parks": 0, "timeouts": 0}
        self._ready = False
        self._closing = False
        self._closed = False
        self._shutdown_seen = False
        self._writer_lost = False
        #: Why frames from the SUB connection can no longer be trusted, if so.
        self._untrusted: str | None = None
        self._handshakes = 0
        self._peek: list[zmq.Frame] | None = None
        self._wait_what = ""
        self._wait_timeout: float | None = None
        self._backoff = Backoff(policy, self._check_wait)
        self._warnings = WaitWarnings(warn_interval)
        #: When this reader connected (its warnings count from it before any message).
        self._connected_at = time.monotonic()
        #: ``(n, when)``: message ``n`` ended a wait at ``when`` (monotonic), the
        #: last such message (-1: none yet).
        self._arrived: tuple[int, float] = (-1, 0.0)
        #: The context and sockets, released in reverse order of creation by
        #: :meth:`close` or by a failed construction.
        self._resources = contextlib.ExitStack()
        try:
            if handle.remote_pub is None or handle.remote_ctl is None:
                raise ValueError(
                    f"rank {rank} is not a local reader of queue {handle.name!r} "
                    f"(local ranks {list(handle.local_reader_ranks)}) and the queue has no "
                    "remote endpoint; pass the right rank or create the queue with "
                    "n_reader > n_local_reader")
            self._connect(handle, handle.remote_pub, handle.remote_ctl, rank, client_keypair)
        except BaseException:
            self._closed = True
            self._resources.close()
            raise

    def _connect(self, handle: Handle, remote_pub: str, remote_ctl: str, rank: int,
                 client_keypair: tuple[bytes, bytes] | None) -> None:
        """Open the CURVE SUB (data) and DEALER (control) connections; say hello."""
        keys = _client_keys(handle, rank, client_keypair)
        res = self._resources
        ctx = zmq.Context(io_threads=1)
        res.callback(ctx.term)
        self.sub = sub = new_socket(ctx, zmq.SUB, tcp=True)
        res.callback(close_all, sub)
        self.dealer = dealer = new_socket(ctx, zmq.DEALER, tcp=True)
        res.callback(close_dealer, dealer)
        for sock, addr in ((sub, remote_pub), (dealer, remote_ctl)):
            make_curve_client(sock, *keys)
            if "[" in addr:
                sock.setsockopt(zmq.IPV6, 1)
        self._mon = mon = open_monitor(
            sub, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        res.callback(stop_monitor, sub, mon)
        res.callback(guard_zmq(self, ctx, [mon, sub, dealer]).detach)
        _connect_to(sub, remote_pub, "remote_pub", handle.name)
        sub.subscribe(TOPIC_REMOTE)
        sub.subscribe(joined_topic(rank))  # after TOPIC_REMOTE: see transport.TOPIC_JOINED
        dealer.setsockopt(zmq.ROUTING_ID, reader_routing_id(b"R", rank))
        _connect_to(dealer, remote_ctl, "remote_ctl", handle.name)
        ctime = psutil.Process(self._pid).create_time()
        dealer.send(CTL_HELLO + msgspec.msgpack.encode(
            [rank, self._pid, ctime, socket.gethostname(), own_pid_space()]))
        self._poller = zmq.Poller()
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    # ------------------------------------------------------------- receive
    def _next(self, what: str, timeout: float | None) -> list[zmq.Frame]:
        """Return the next frames on the subscription, waiting as needed."""
        if self._peek is not None:
            frames, self._peek = self._peek, None
            return frames
        try:
            return self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        self._wait_what, self._wait_timeout = what, timeout
        b = self._backoff
        now = time.monotonic()
        b.start(None if timeout is None else now + timeout)
        if self._ready:  # a wait for a message
            self._warnings.start(now)
        else:
            self._warnings.stop()
        while True:
            b.step()
            if self._peek is not None:  # taken by the liveness check: the writer is gone
                frames, self._peek = self._peek, None
                return frames
            events = dict(self._poller.poll(max(1, int(b.park_timeout() * 1000))))
            if self._mon in events:
                self._drain_monitor()
            if self.sub in events:
                frames = self.sub.recv_multipart(copy=False)
                if self._ready:
                    self._arrived = (self._seq, time.monotonic())
                return frames

    def _drain_monitor(self) -> None:
        try:
            while True:
                ev = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))
                event = ev["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self._writer_lost = True
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshakes += 1
                    if self._handshakes > 1:
                        self._untrusted = "the connection to the writer was re-established"
                elif event & HANDSHAKE_FAILED:
                    self._writer_lost = True
                    if not self._handshakes:
                        self._untrusted = (
                            "the TCP handshake failed: the peer did not prove the writer's "
                            "CURVE key, or the writer refused this reader's key")
        except zmq.Again:
            pass

    def _vet(self) -> None:
        """Called before any received frame is used: raise if it may not be the writer's."""
        if self._mon.get(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]  # EVENTS is an int
            self._drain_monitor()
        if self._untrusted is not None:
            self._peek = None
            raise PeerDiedError(
                f"queue {self.name!r}: {self.side} lost the {self._writer_desc}: "
                f"{self._untrusted}", queue=self.name, side=self.side, peers=[self._writer_peer])

    def _check_wait(self, expired: bool) -> None:
        if self._closing:
            raise QueueClosedError(
                f"queue {self.name!r}: {self.side} was shut down while waiting for "
                f"{self._wait_what}", queue=self.name, side=self.side)
        self._vet()
        if self._writer_lost or not self._writer.alive():
            if self._peek is not None:  # a message still to deliver
                return
            try:  # deliver what arrived before the connection dropped
                self._peek = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            raise PeerDiedError(
                f"queue {self.name!r}: lost the {self._writer_desc} while {self.side} waited "
                f"for {self._wait_what}", queue=self.name, side=self.side,
                peers=[self._writer_peer])
        if expired:
            state = self._writer.state()
            how = {"stopped": " (alive but stopped: SIGSTOP, job control or a debugger)",
                   "running": " (alive)"}.get(state, "")
            link = ("its connection is up" if self._handshakes else
                    "no connection to it was ever made (nothing completed a handshake at "
                    f"{self.sub.getsockopt_string(zmq.LAST_ENDPOINT) or 'its address'}: the "
                    "writer may be gone, or the network drops the connections)")
            raise QueueTimeout(
                f"queue {self.name!r}: {self.side} timed out after {self._wait_timeout:g} s "
                f"waiting for {self._wait_what} from the {self._writer_desc}{how}; {link}",
                queue=self.name, side=self.side, peers=[self._writer_peer])
        now = time.monotonic()
        if self._warnings.due(now):
            logger.warning(reader_warning(
                self.name, self.side, now - self._warnings.began, self._seq, self._writer_desc,
                self._writer.state(), self._last_message(now)))

    def _last_message(self, now: float) -> LastMessage:
        """How long ago message ``seq - 1`` arrived (for a warning of the wait for ``seq``):
        exact if it ended a wait, else at least as long as the current wait."""
        seq = self._seq
        if seq == 0:
            return LastMessage("none", now - self._connected_at)
        n, when = self._arrived
        if n == seq - 1:
            return LastMessage("arrived", now - when)
        return LastMessage("before", now - self._warnings.began)

    def wait_until_ready(self, timeout: float | None) -> None:
        """Block until the writer's READY marker arrives."""
        self._check_open("wait_until_ready")  # also once ready: a closed queue is unusable
        if self._ready:
            return
        while True:
            frames = self._next("the writer to see all readers connected", timeout)
            self._vet()
            seq, kind, _m, _b = self._header(frames)
            if kind == KIND_READY:
                self._ready = True
                return
            if kind == KIND_SHUTDOWN:
                self._shutdown_seen = True
                self._raise_shutdown()

    def poll(self) -> bool:
        """Whether a message (or the writer's shutdown marker) is waiting."""
        if self._closed:
            return False
        return self._peek is not None or bool(self.sub.poll(0))

    def dequeue(self, timeout: float | None) -> Any:
        """Receive the next message."""
        if self._closing or not self._ready:
            self._check_open("dequeue")
            if self._closing:
                raise QueueClosedError(f"queue {self.name!r}: {self.side} was shut down",
                                       queue=self.name, side=self.side)
            self.wait_until_ready(timeout if timeout is not None else 120.0)
        if self._shutdown_seen:
            self._raise_shutdown()
        frames = self._next(f"message #{self._seq}", timeout)
        self._vet()
        head = frames[0].buffer  # topic byte, header, msgpack
        seq, kind, mlen, blen = self._header(frames)
        if kind == KIND_SHUTDOWN:
            self._shutdown_seen = True
            self._raise_shutdown()
        if seq != self._seq:
            raise ShmBroadcastError(
                f"queue {self.name!r}: {self.side} expected message #{self._seq}, got #{seq}")
        self._seq = seq + 1
        if self._seq % self._ack_every == 0:
            try:  # noqa: SIM105 - the receive path: no context manager per ack
                self.dealer.send(CTL_ACK + ACK.pack(self._seq), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        try:
            if len(frames) == 1:  # small message: arrays follow the msgpack bytes
                return self.codec.decode(head[_HEAD : _HEAD + mlen], head, _HEAD + mlen, blen)
            return self.codec.decode(head[_HEAD : _HEAD + mlen], frames[1].buffer, 0, blen,
                                     True)  # the frame is this process's own
        except DecodeError as e:
            raise DecodeError(
                f"queue {self.name!r}: {self.side} refused message #{seq} from the "
                f"{self._writer_desc}: {e}", queue=self.name, side=self.side,
                peers=[self._writer_peer]) from None

    def _header(self, frames: list[zmq.Frame]) -> tuple[int, int, int, int]:
        """``(seq, kind, mlen, blen)`` of a message's frames, once they are known to hold
        exactly what the header says (the writer's layout: one frame of topic,
        header, msgpack and arrays, or the arrays in a second frame).

        Raises:
            DecodeError: Any other number of frames or bytes (naming the writer).
        """
        head = frames[0].buffer
        if len(frames) in (1, 2) and len(head) >= _HEAD:
            seq, kind, mlen, blen = WIRE.unpack_from(head, 1)
            if len(frames) == 1:
                if len(head) == _HEAD + mlen + blen:
                    return seq, kind, mlen, blen
            elif len(head) == _HEAD + mlen and len(frames[1].buffer) == blen:
                return seq, kind, mlen, blen
        raise DecodeError(
            f"queue {self.name!r}: {self.side} got a malformed message from the "
            f"{self._writer_desc}: {len(frames)} frame(s) of "
            f"{[len(f.buffer) for f in frames[:3]]} bytes, which is not the header's layout",
            queue=self.name, side=self.side, peers=[self._writer_peer])

    def _raise_shutdown(self) -> None:
        raise QueueClosedError(
            f"queue {self.name!r}: the {self._writer_desc} shut the queue down; no message "
            f"#{self._seq} will come", queue=self.name, side=self.side, peers=[self._writer_peer])

    # ----------------------------------------------------------- lifecycle
    def _check_open(self, op: str) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r}: {op}() on a closed queue",
                                   queue=self.name, side=self.side)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def shutdown(self) -> None:
        """Stop reading: blocked calls raise QueueClosedError; the writer is told."""
        if self._closing:
            return
        self._closing = True
        say_goodbye(self.dealer, self._owner_thread)

    def close(self) -> None:
        """Disconnect. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        self.shutdown()
        self._closed = True
        self._peek = None
        self._resources.close()


def _connect_to(sock: zmq.SyncSocket, endpoint: str, field: str, queue: str) -> None:
    """``sock.connect(endpoint)``; an endpoint zmq refuses (not ``tcp://host:port``) is
    a ``ValueError`` naming the handle's ``field``."""
    bad = ValueError(f"the handle of queue {queue!r}: {field} must be a tcp://host:port "
                     f"endpoint zmq accepts, got {endpoint!r:.80}")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise bad
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        if e.errno != zmq.EINVAL:
            raise
        raise bad from None


def _client_keys(handle: Handle, rank: int, own: tuple[bytes, bytes] | None
                 ) -> tuple[bytes, bytes, bytes]:
    """``(server public, client public, client secret)``: the reader's own pair or
    the handle's (which must be this rank's, or shared).

    Raises:
        ValueError: A key is missing or malformed, or the handle's keypair is
            another rank's (this reader refuses plain TCP).
    """
    server = handle.curve_server_key
    if own is None and handle.curve_client_rank not in (None, rank):
        raise ValueError(
            f"the handle of queue {handle.name!r} carries the CURVE keys of remote reader "
            f"rank {handle.curve_client_rank}, not of rank {rank}; ask the writer for rank "
            f"{rank}'s handle (export_handle(rank={rank}))")
    public, secret = own if own is not None else (handle.curve_client_key,
                                                  handle.curve_client_secret)
    if not isinstance(server, bytes) or len(server) != 40:
        raise ValueError(
            f"the handle of queue {handle.name!r} carries no valid CURVE server key for "
            "remote readers; a remote reader never connects without authentication")
    if not (isinstance(public, bytes) and isinstance(secret, bytes)
            and len(public) == len(secret) == 40):
        raise ValueError(
            f"the handle of queue {handle.name!r} carries no CURVE client keys for remote "
            f"reader rank {rank}: pass the handle the writer made for this rank "
            f"(export_handle(rank={rank})), or this reader's own curve_keypair whose public "
            "key the writer was given (remote_reader_keys)")
    for what, key in (("curve_server_key", server), ("curve_client_key", public),
                      ("curve_client_secret", secret)):
        try:  # 40 bytes of Z85 are 32 key bytes; zmq refuses anything else without a reason
            z85.decode(key)
        except (ValueError, KeyError, IndexError, TypeError, struct.error):
            raise ValueError(
                f"the handle of queue {handle.name!r}: {what} is not a Z85-encoded CURVE key "
                f"(40 characters of the Z85 alphabet), got {key!r:.60}") from None
    return server, public, secret
