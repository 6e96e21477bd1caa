"""QueueWriter: the writer side of a MessageQueue.

Per message (see :mod:`shm_broadcast.ring_buffer` for the flag protocol):

1. encode (msgspec + raw array copies, :mod:`shm_broadcast.codec`);
2. local readers: wait until chunk ``seq % max_chunks`` is FREE, write header,
   msgpack bytes and arrays straight into it (or, if the message does not fit,
   publish it on the ``o`` topic first and write only the header), publish the
   flags, then -- after a full fence -- ring the doorbell only if some reader
   declared itself parked. A spinning reader costs the writer no syscall;
3. remote readers: wait for flow-control credit, send on the ``m`` topic.

A writer blocked on a full ring uses the same spin/yield/park policy as the
readers, parks on its doorbell (readers ring it after freeing a chunk if it
declared itself parked) and checks the lagging readers' liveness.

Channel security (protocol, see :mod:`shm_broadcast.transport` and
``docs/security-channels.md``); what holds:

* Local sockets and doorbells live in a ``0700`` channel directory the writer
  creates; once every reader is attached the writer connects its doorbell
  lines and removes the directory (``close`` removes it too, and a
  ``weakref.finalize`` at interpreter exit), so only the queue's processes
  ever held a path into it.
* With remote readers the TCP listeners are CURVE servers (a keypair per
  queue) and a ZAP handler admits only the remote readers' client key(s)
  carried by the handle. Refused handshakes are counted
  (:meth:`QueueWriter.security_stats`).
* Control frames are validated before they change any state: a hello counts
  only if it decodes as ``[rank, pid, create_time, host]``, comes from a
  routing id the queue expects (``L<i>``: the local slot whose shared-memory
  registration has the same pid and start time; ``R<rank>``: a rank that is
  not local, over a ZAP-authenticated connection, at most ``n_remote`` of
  them), and is the first for that id. Acks must be 8 bytes from a known
  remote reader and never beyond the messages sent. Anything else is ignored
  and counted as ``bad_control``; nothing a peer sends raises a decoder's
  exception in the writer.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from typing import Any

import msgspec
import psutil
import zmq
from zmq.utils.monitor import parse_monitor_message

from shm_broadcast.codec import Codec, Encoded
from shm_broadcast.doorbell import BellRinger, Doorbell, bell_address
from shm_broadcast.errors import PeerDiedError, QueueClosedError, QueueTimeout
from shm_broadcast.handle import Handle
from shm_broadcast.ring_buffer import CHUNK_HEADER, READER_CLOSED, READER_EMPTY, ShmRingBuffer
from shm_broadcast.transport import (
    ACK, CTL_ACK, CTL_CLOSED, CTL_HELLO, HANDSHAKE_FAILED, KIND_DATA, KIND_OVERFLOW,
    KIND_READY, KIND_SHUTDOWN, TOPIC_OVERFLOW, TOPIC_REMOTE, WIRE, ReaderAuthenticator, bind,
    close_all, count_failed_handshakes, host_ip, local_bind_address, make_curve_server,
    new_channel_dir, new_keypair, new_socket, remove_channel_dir,
)
from shm_broadcast.waiting import PARK, Backoff, PeerWatch, WaitPolicy

__all__ = ["QueueWriter"]

_ZERO_COPY_MIN = 1 << 16

_Hello = tuple[int, int, float, str]
_HELLO_DECODER = msgspec.msgpack.Decoder(_Hello)


class QueueWriter:
    """Writer side; used through :class:`shm_broadcast.MessageQueue`.

    Args:
        name: Queue name for messages.
        n_reader: Total readers.
        local_reader_ranks: Ranks of the same-node readers, in slot order.
        max_chunk_bytes: Bytes per chunk.
        max_chunks: Chunks in the ring.
        connect_ip: IP to bind the TCP sockets on when there are remote readers.
        policy: Waiting policy.
        codec: Encoder.
        writer_rank: This process's rank (messages only).
    """

    def __init__(
        self,
        *,
        name: str,
        n_reader: int,
        local_reader_ranks: tuple[int, ...],
        max_chunk_bytes: int,
        max_chunks: int,
        connect_ip: str | None,
        policy: WaitPolicy,
        codec: Codec,
        writer_rank: int | None,
    ) -> None:
        self.name = name
        self.n_reader = n_reader
        self.local_ranks = local_reader_ranks
        self.n_local = len(local_reader_ranks)
        self.n_remote = n_reader - self.n_local
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.policy = policy
        self.codec = codec
        self.side = "writer" if writer_rank is None else f"writer (rank {writer_rank})"
        self.writer_rank = writer_rank
        self.remote_window = max(8, 2 * max_chunks)
        self._pid = os.getpid()
        self._ctime = psutil.Process(self._pid).create_time()
        self._owner_thread = threading.get_ident()
        self._init_protocol_state()
        self._init_resources()
        try:
            if self.n_local:
                self._open_channel_dir()
                self._create_ring()
            addrs = self._bind_sockets(connect_ip) if n_reader else {}
        except BaseException:
            self.close()
            raise
        self.handle = self._make_handle(addrs)

    def _init_protocol_state(self) -> None:
        """Sequence number, handshake bookkeeping and remote flow control."""
        self._seq = 0
        self._ready = self.n_reader == 0
        self._closing = False
        self._closed = False
        self._subs = {TOPIC_OVERFLOW: 0, TOPIC_REMOTE: 0}
        self._hello: dict[bytes, tuple[int, int, float, str]] = {}
        self._remote_fd: dict[int, int] = {}
        self._remote_acked: dict[int, int] = {}
        self._remote_min_acked = 0
        self._dead_remote: dict[int, str] = {}
        self._bad_control = 0
        self._failed_handshakes = 0
        self._said_goodbye: set[int] = set()
        self._local_watch: dict[int, PeerWatch] = {}
        self._wait_seq = 0
        #: Parks on the doorbell, and those that ended by timeout rather than a ring.
        self.park_stats = {"parks": 0, "timeouts": 0}
        self._wait_chunk: int | None = None
        self._wait_timeout: float | None = None
        self._backoff = Backoff(self.policy, self._check_wait)

    def _init_resources(self) -> None:
        """Every resource starts as None so that close() works at any point of setup."""
        self.ring: ShmRingBuffer | None = None
        self.ctx: zmq.Context | None = None
        self.pub: zmq.Socket | None = None
        self.ctl: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._pub_mon: zmq.Socket | None = None
        self._auth: ReaderAuthenticator | None = None
        self._server_keys: tuple[bytes, bytes] | None = None
        self._client_keys: tuple[bytes, bytes] | None = None
        self._ringer = BellRinger()
        self._doorbell: Doorbell | None = None
        self._channel_dir: str | None = None
        self._bell_prefix: str | None = None
        self._reader_rings: list[Any] = []
        self._dir_finalizer: weakref.finalize | None = None

    def _open_channel_dir(self) -> None:
        """The private directory of the local sockets, and a line to each reader's bell."""
        self._channel_dir = new_channel_dir()
        # Removed at exit even if close() never runs (not after SIGKILL: see close()).
        self._dir_finalizer = weakref.finalize(self, remove_channel_dir, self._channel_dir)
        self._bell_prefix = self._channel_dir + os.sep
        self._reader_rings = [self._ringer.line(bell_address(self._bell_prefix, f"r{i}"))
                              for i in range(self.n_local)]

    def _create_ring(self) -> None:
        """The shared-memory ring for local readers, and the writer's doorbell."""
        self.ring = ShmRingBuffer.create(self.n_local, self.max_chunk_bytes, self.max_chunks)
        self._parked_lo, self._parked_hi = self.ring.parked_span()
        self._no_parked = bytes(self.n_local)
        self.ring.set_writer(self._pid, self._ctime)
        self._doorbell = Doorbell(bell_address(self._bell_prefix, "w"))

    def _bind_sockets(self, connect_ip: str | None) -> dict[str, str]:
        """Bind the XPUB (data) and ROUTER (control) sockets; returns their addresses.

        Local readers connect over ``ipc://`` paths in the channel directory
        (NULL mechanism: the directory's permissions are the access control);
        remote readers over CURVE-authenticated TCP on ``connect_ip`` (default:
        this host's address). The ipc binds come first: zmq takes a listener's
        mechanism from the socket options at bind time.
        """
        self.ctx = zmq.Context(io_threads=1)
        remote = self.n_remote > 0
        self.pub = new_socket(self.ctx, zmq.XPUB, tcp=remote, reconnect=True)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.ctl = new_socket(self.ctx, zmq.ROUTER, tcp=remote, reconnect=True)
        addrs: dict[str, str] = {}
        if self.n_local:
            addrs["local_pub"] = bind(self.pub, local_bind_address(self._channel_dir, "p"))
            addrs["local_ctl"] = bind(self.ctl, local_bind_address(self._channel_dir, "c"))
        if remote:
            self._server_keys, self._client_keys = new_keypair(), new_keypair()
            self._auth = ReaderAuthenticator(self.ctx, {self._client_keys[0]: "reader"})
            ip = connect_ip or host_ip()
            for sock in (self.pub, self.ctl):
                make_curve_server(sock, self._server_keys[1])
                if ":" in ip:
                    sock.setsockopt(zmq.IPV6, 1)
            if ":" in ip:
                ip = f"[{ip}]"
            self._mon = self.ctl.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
            self._pub_mon = self.pub.get_monitor_socket(HANDSHAKE_FAILED)
            addrs["remote_pub"] = bind(self.pub, f"tcp://{ip}:*")
            addrs["remote_ctl"] = bind(self.ctl, f"tcp://{ip}:*")
        return addrs

    def _make_handle(self, addrs: dict[str, str]) -> Handle:
        """What readers need to attach: segment, bells, socket addresses, writer identity."""
        return Handle(
            name=self.name,
            n_reader=self.n_reader,
            local_reader_ranks=tuple(self.local_ranks),
            max_chunk_bytes=self.max_chunk_bytes,
            max_chunks=self.max_chunks,
            segment=self.ring.name if self.ring is not None else None,
            bell_prefix=self._bell_prefix,
            writer_pid=self._pid,
            writer_create_time=self._ctime,
            writer_host=socket.gethostname(),
            writer_rank=self.writer_rank,
            remote_window=self.remote_window,
            curve_server_key=self._server_keys[0] if self._server_keys else None,
            curve_client_key=self._client_keys[0] if self._client_keys else None,
            curve_client_secret=self._client_keys[1] if self._client_keys else None,
            local_pub=addrs.get("local_pub"),
            local_ctl=addrs.get("local_ctl"),
            remote_pub=addrs.get("remote_pub"),
            remote_ctl=addrs.get("remote_ctl"),
        )

    # ------------------------------------------------------------ handshake
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
            self.pub.send_multipart([TOPIC_REMOTE, WIRE.pack(0, KIND_READY, 0, 0)])

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
        n_remote_seen = sum(1 for k in self._hello if k[:1] == b"R")
        if n_remote_seen < self.n_remote:
            missing.append(f"{self.n_remote - n_remote_seen} remote reader(s)")
        if not missing and (self._subs[TOPIC_OVERFLOW] < self.n_local
                            or self._subs[TOPIC_REMOTE] < self.n_remote):
            missing.append("subscriptions still in flight")
        return missing

    def _drain_pub(self) -> None:
        pub = self.pub
        try:
            while True:
                msg = pub.recv(zmq.NOBLOCK)
                if msg[:1] == b"\x01" and msg[1:] in self._subs:
                    self._subs[msg[1:]] += 1
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
            rank, pid, ctime, host = _HELLO_DECODER.decode(body[1:])
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
        if (slot != rank or rank in self.local_ranks or n_remote_seen >= self.n_remote
                or not _authenticated(frame)):
            return False
        self._hello[ident] = (rank, pid, ctime, host)
        self._remote_fd[frame.get(zmq.SRCFD)] = rank
        self._remote_acked.setdefault(rank, 0)
        self._local_watch[-1 - rank] = PeerWatch(pid, ctime, host)
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

    # ------------------------------------------------------------- enqueue
    def enqueue(self, obj: Any, timeout: float | None) -> None:
        """Send ``obj`` to every reader (see the module docstring)."""
        ring = self.ring
        if (ring is not None and not self._closing
                and ring.buf[self._parked_lo : self._parked_hi] != self._no_parked and self._ready):
            # Early doorbell, first thing: a parked reader takes ~200 us to get
            # a CPU back; let that overlap with encoding and copying. It then
            # polls (see Backoff.rearm); the bell after publishing below still
            # guarantees the wake-up if it parked again meanwhile. The check is
            # inlined (ShmRingBuffer.take_parked_readers + BellRinger.ring):
            # after an idle spell caches are cold and each Python call before
            # the sendto adds microseconds to the wake-up.
            buf, lo = ring.buf, self._parked_lo
            for i, ring_reader in enumerate(self._reader_rings):
                if buf[lo + i]:
                    buf[lo + i] = 0  # take the flag, then ring (see ring_buffer)
                    ring_reader()
        if not self._ready or self._closing:
            self._before_first_or_after_shutdown(timeout)
        if not self.n_reader:
            return
        enc = self.codec.encode(obj)
        seq = self._seq
        deadline = None if timeout is None else time.monotonic() + timeout
        if ring is not None:
            chunk = seq % self.max_chunks
            if not ring.is_free(chunk):
                self._wait_free(chunk, seq, deadline, timeout)
        if self.n_remote and seq + 1 - self.remote_window > self._remote_min_acked:
            self._wait_credit(seq, deadline, timeout)
        frames = None
        if ring is not None:
            frames = self._write_local(ring, chunk, seq, enc)
        if self.n_remote:
            self._send_remote(seq, enc, frames, chunk if ring is not None else None)
        self._seq = seq + 1

    def _before_first_or_after_shutdown(self, timeout: float | None) -> None:
        """The rare enqueue states: readers not yet attached, or the queue shut down."""
        if not self._ready:
            self._check_open("enqueue")
            self.wait_until_ready(timeout if timeout is not None else 120.0)
        if self._closing:
            self._check_open("enqueue")
            self._raise_closed("enqueue")

    @staticmethod
    def _blob_offset(mlen: int) -> int:
        """Arrays start 64-byte aligned after the header and the msgpack bytes."""
        return CHUNK_HEADER + (mlen + 63) // 64 * 64

    def _write_local(self, ring: ShmRingBuffer, chunk: int, seq: int,
                     enc: Encoded) -> list[Any] | None:
        """Fill the (free) chunk, publish it and ring parked readers.

        A message that does not fit goes out on the overflow topic first and the
        chunk carries only its header; the frames are returned for reuse by
        remote readers. Returns None when the message went into the chunk.
        """
        msg, blen = enc.msg, enc.blob_len
        mlen = len(msg)
        boff = CHUNK_HEADER + (mlen + 63) // 64 * 64  # as _blob_offset, inlined
        # Without arrays the msgpack bytes need no padding: a message fits up to the last byte.
        overflow = (boff + blen if blen else CHUNK_HEADER + mlen) > self.max_chunk_bytes
        frames: list[Any] | None = None
        ring.acquire_fence()  # readers' R_i loads before our payload stores (no-op on x86)
        ring.begin_write(chunk)
        d = ring.data_offset(chunk)
        if overflow:
            frames = self._frames(seq, enc, None)
            self.pub.send_multipart([TOPIC_OVERFLOW, *frames], copy=blen < _ZERO_COPY_MIN)
            WIRE.pack_into(ring.buf, d, seq, KIND_OVERFLOW, mlen, blen)
        else:
            buf = ring.buf
            WIRE.pack_into(buf, d, seq, KIND_DATA, mlen, blen)
            buf[d + CHUNK_HEADER : d + CHUNK_HEADER + mlen] = msg
            if blen:
                enc.write_blob(ring.base_addr + d + boff)
        ring.publish(chunk)
        ring.full_fence()
        parked = ring.take_parked_readers()
        if parked:
            self._ring_readers(parked)
        return frames

    def _send_remote(self, seq: int, enc: Encoded, frames: list[Any] | None,
                     chunk: int | None) -> None:
        """Publish the message to remote readers, reusing the overflow frames if any."""
        if frames is None:
            src = None
            if chunk is not None:
                # Copy out of the chunk: it is reused once the local readers are done.
                d = self.ring.data_offset(chunk) + self._blob_offset(len(enc.msg))
                src = bytes(self.ring.buf[d : d + enc.blob_len])
            frames = self._frames(seq, enc, src)
        self.pub.send_multipart([TOPIC_REMOTE, *frames], copy=enc.blob_len < _ZERO_COPY_MIN)

    def _ring_readers(self, readers: Any) -> None:
        rings = self._reader_rings
        for i in readers:
            rings[i]()

    @staticmethod
    def _frames(seq: int, enc: Encoded, blob: Any) -> list[Any]:
        head = WIRE.pack(seq, KIND_DATA, len(enc.msg), enc.blob_len) + enc.msg
        if blob is None:
            blob = enc.blob_bytes()
        return [head, blob]

    def _wait_free(self, chunk: int, seq: int, deadline: float | None,
                   timeout: float | None) -> None:
        ring = self.ring
        self._wait_seq, self._wait_chunk, self._wait_timeout = seq, chunk, timeout
        b = self._backoff
        b.start(deadline)
        while not ring.is_free(chunk):
            if b.step() == PARK:
                if self._closing:
                    self._raise_closed("enqueue")
                self._doorbell.drain()  # rings from before this park are stale
                ring.set_writer_parked(True)
                ring.full_fence()
                if not ring.is_free(chunk):
                    stats = self.park_stats
                    stats["parks"] += 1
                    if not self._doorbell.wait(b.park_timeout()):
                        stats["timeouts"] += 1
                ring.set_writer_parked(False)

    def _wait_credit(self, seq: int, deadline: float | None, timeout: float | None) -> None:
        need = seq + 1 - self.remote_window
        self._wait_seq, self._wait_chunk, self._wait_timeout = seq, None, timeout
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        b = self._backoff
        b.start(deadline)
        self._drain_ctl()
        while self._remote_min_acked < need:
            b.step()
            poller.poll(max(1, int(b.park_timeout() * 1000)))
            self._drain_ctl()

    def _lagging(self) -> tuple[list[int], list[int]]:
        """Local reader slots and remote ranks holding up the current wait."""
        local: list[int] = []
        if self._wait_chunk is not None and self.ring is not None:
            local = self.ring.lagging_readers(self._wait_chunk)
        need = self._wait_seq + 1 - self.remote_window
        remote = [r for r, n in self._remote_acked.items() if n < need]
        return local, remote

    def _check_wait(self, expired: bool) -> None:
        if self._closing:
            self._raise_closed("enqueue")
        self._drain_ctl()
        local, remote = self._lagging()
        if not local and not remote:
            return
        self._raise_if_reader_dead(local, remote)
        if expired:
            ranks = [self.local_ranks[i] for i in local] + remote
            raise QueueTimeout(
                f"queue {self.name!r}: enqueue of message #{self._wait_seq} timed out after "
                f"{self._wait_timeout:g} s; the {self.side} is waiting for reader rank(s) "
                f"{ranks} to consume earlier messages (ring of {self.max_chunks} chunks full)",
                queue=self.name, side=self.side, peers=ranks)

    def _raise_if_reader_dead(self, local: list[int], remote: list[int]) -> None:
        ring = self.ring
        for i in local:
            rank = self.local_ranks[i]
            state = ring.reader_state(i)
            if state == READER_EMPTY:
                continue
            if state == READER_CLOSED:
                raise QueueClosedError(
                    f"queue {self.name!r}: reader rank {rank} closed the queue; the "
                    f"{self.side} cannot deliver message #{self._wait_seq}",
                    queue=self.name, side=self.side, peers=[rank])
            watch = self._local_watch.get(i)
            if watch is None:
                watch = self._local_watch[i] = PeerWatch(*ring.reader_identity(i))
            if not watch.alive():
                raise PeerDiedError(
                    f"queue {self.name!r}: reader rank {rank} ({watch.describe()}) died; "
                    f"the {self.side} cannot deliver message #{self._wait_seq}",
                    queue=self.name, side=self.side, peers=[rank])
        for rank in remote:
            if rank in self._said_goodbye:
                raise QueueClosedError(
                    f"queue {self.name!r}: remote reader rank {rank} closed the queue",
                    queue=self.name, side=self.side, peers=[rank])
            watch = self._local_watch.get(-1 - rank)
            why = self._dead_remote.get(rank)
            if why is None and watch is not None and not watch.alive():
                why = "its process exited"
            if why is not None:
                who = watch.describe() if watch is not None else "unknown pid"
                raise PeerDiedError(
                    f"queue {self.name!r}: remote reader rank {rank} ({who}) is gone: {why}",
                    queue=self.name, side=self.side, peers=[rank])

    # ------------------------------------------------------------ lifecycle
    def _check_open(self, op: str) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r}: {op}() on a closed queue",
                                   queue=self.name, side=self.side)

    def _raise_closed(self, op: str) -> None:
        raise QueueClosedError(
            f"queue {self.name!r}: {op}() interrupted: the {self.side} was shut down",
            queue=self.name, side=self.side)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def shutdown(self) -> None:
        """Stop: readers drain what was sent, then get QueueClosedError."""
        if self._closing:
            return
        self._closing = True
        ring = self.ring
        if ring is not None and not ring.closed:
            ring.set_shutdown()
            self._ring_readers(range(self.n_local))  # thread-safe: plain sendto
            if self._doorbell is not None:
                self._doorbell.ring_self()  # wake our own blocked call
        if threading.get_ident() == self._owner_thread and not self._closed and self.pub is not None:
            try:
                if self.n_remote:
                    self.pub.send_multipart(
                        [TOPIC_REMOTE, WIRE.pack(self._seq, KIND_SHUTDOWN, 0, 0)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Shut down, close sockets and unlink the segment. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # a forked child: zmq state is not ours to touch
            return
        self.shutdown()
        self._closed = True
        for sock, mon in ((self.ctl, self._mon), (self.pub, self._pub_mon)):
            if mon is not None:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
        if self.pub is not None and not self.pub.closed:
            self.pub.setsockopt(zmq.LINGER, 500)  # let SHUTDOWN / overflow frames out
            self.pub.close()
        close_all(self._mon, self._pub_mon, self.ctl)
        if self._auth is not None:
            self._auth.stop()  # its socket lives on ctx: stop it before term()
        if self.ctx is not None:
            self.ctx.term()
        if self._doorbell is not None:
            self._doorbell.close()
        self._ringer.close()
        if self._dir_finalizer is not None:
            self._dir_finalizer()  # removes the channel directory (if not sealed yet)
        if self.ring is not None:
            self.ring.close()


def _slot_of(ident: bytes) -> int | None:
    """The number in a routing id ``L<n>`` / ``R<n>``, or None if it is not one."""
    if len(ident) < 2 or ident[:1] not in (b"L", b"R") or not ident[1:].isdigit():
        return None
    return int(ident[1:])


def _authenticated(frame: zmq.Frame) -> bool:
    """Whether ``frame`` came over a connection ZAP admitted (ipc ones have no User-Id)."""
    try:
        return bool(frame.get("User-Id"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return False
