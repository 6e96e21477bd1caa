"""QueueWriter: the writer side of a MessageQueue.

Per message (see :mod:`shm_broadcast.queue.ring_buffer` for the flag protocol):

1. encode (msgspec + raw array copies, :mod:`shm_broadcast.codec.message_codec`);
2. local readers: wait until chunk ``seq % max_chunks`` is FREE, write header,
   msgpack bytes and arrays straight into it (or, if the message does not fit,
   publish it on the ``o`` topic first and write only the header), stamp the
   chunk with the publish time (:data:`shm_broadcast.waiting.predictive.STAMP`, which
   predictive readers learn from), publish the flags, then -- after a full
   fence -- ring the doorbell only if some reader declared itself parked. A
   spinning reader costs the writer no syscall;
3. remote readers: wait for flow-control credit, send on the ``m`` topic.

A writer blocked on a full ring uses the same spin/yield/park policy as the
readers, parks on its doorbell (readers ring it after freeing a chunk if it
declared itself parked) and checks the lagging readers' liveness; a wait that
lasts is logged with the readers behind and their outstanding messages
(:mod:`shm_broadcast.queue.laggards`; :meth:`QueueWriter.lag_stats` gives
the same figures on demand).

Channel security (protocol, see :mod:`shm_broadcast.queue.transport` and
``docs/security-channels.md``); what holds:

* Local sockets and doorbells live in a ``0700`` channel directory the writer
  creates; once every reader is attached the writer connects its doorbell
  lines and removes the directory (``close`` removes it too, and a
  ``weakref.finalize`` at interpreter exit), so only the queue's processes
  ever held a path into it.
* With remote readers the TCP listeners are CURVE servers (a keypair per
  queue) and a ZAP handler admits only the remote readers' client keys, each
  at most ``transport.CONNECTIONS_PER_KEY`` times per socket. Every remote
  reader has a key of its own: one it made itself and whose public half the
  writer was given (``remote_reader_keys``), or one the writer made for it
  and hands out only in that rank's handle (:meth:`QueueWriter.handle_for`).
  The handle every reader gets carries no secret, except with a single
  remote reader: then it carries that reader's key (every other reader is
  local, hence the writer's own user). One key shared by several remote
  readers is an explicit opt-in (``shared_reader_key``). Refused handshakes
  are counted (:meth:`QueueWriter.security_stats`).
* Control frames are validated before they change any state
  (:mod:`shm_broadcast.queue.writer_control`). Both receiving sockets take
  frames of at most ``transport.CONTROL_MAX_BYTES`` and hold at most
  ``transport.CONTROL_QUEUE_FRAMES`` per connection; each drain takes a
  bounded number of frames (:mod:`shm_broadcast.queue.inbound_limits`).
* The data socket queues at most
  :func:`~shm_broadcast.queue.transport.outbound_queue_messages` messages per
  TCP connection (flow control keeps every reader that acks what it read
  below it; a connection that does not read loses the rest).
* Per message, the enqueue path reads no inbound traffic. A writer with
  remote readers drains both sockets whenever it checks its credit (at least once
  per ``remote_window`` messages, since the credit it knows of only moves
  when it drains) and in every step of a wait; a key that sent more
  subscriptions than a reader does ends the queue there (it is shut down and
  the call raises ``PeerDiedError`` naming the key's rank), since libzmq
  keeps a connected peer's subscriptions and cannot drop one peer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from typing import Any

import msgspec
import psutil
import zmq

from shm_broadcast.codec.message_codec import Codec, Encoded
from shm_broadcast.errors import (
    PeerDiedError,
    QueueClosedError,
    QueueRoleError,
    QueueTimeout,
)
from shm_broadcast.lifecycle.channel_dirs import new_channel_dir, remove_channel_dir
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.laggards import Laggard, WaitWarnings, logger, writer_warning
from shm_broadcast.queue.monitor_drain import MonitorDrain
from shm_broadcast.queue.options import DEFAULT_WARN_INTERVAL
from shm_broadcast.queue.ring_buffer import CHUNK_HEADER, READER_CLOSED, READER_EMPTY, ShmRingBuffer
from shm_broadcast.queue.transport import (
    CONNECTIONS_PER_KEY,
    CONTROL_MAX_BYTES,
    CONTROL_QUEUE_FRAMES,
    HANDSHAKE_FAILED,
    KIND_DATA,
    KIND_OVERFLOW,
    KIND_READY,
    KIND_SHUTDOWN,
    MAX_RANK,
    SHARED_KEY_LABEL,
    TOPIC_OVERFLOW,
    TOPIC_REMOTE,
    WIRE,
    ZAP_DOMAIN_DATA,
    ReaderAuthenticator,
    bind,
    close_all,
    guard_zmq,
    local_bind_address,
    make_curve_server,
    new_keypair,
    new_socket,
    open_monitor,
    outbound_queue_messages,
    stop_monitor,
)
from shm_broadcast.queue.writer_control import WriterControl, check_reader_keys
from shm_broadcast.ranks.host_address import host_ip
from shm_broadcast.waiting.doorbell import BellLine, BellRinger, Doorbell, bell_address
from shm_broadcast.waiting.peer_watch import PeerWatch, own_pid_space, state_text
from shm_broadcast.waiting.policy import PARK, Backoff, WaitPolicy
from shm_broadcast.waiting.predictive import STAMP, STAMP_OFFSET

__all__ = ["QueueWriter"]

_ZERO_COPY_MIN = 1 << 16
_monotonic = time.monotonic
_pack_stamp = STAMP.pack_into


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
        remote_reader_keys: Optional ``{rank: Z85 public key}`` of every remote
            reader, each generated by that reader
            (:func:`~shm_broadcast.queue.transport.new_keypair`) and sent to the
            writer over the group's channel. Then ZAP admits exactly those
            keys and the handle carries no secret. Default: with one remote
            reader, one client keypair that the handle carries; with more, a
            keypair for each remote rank, made when that rank's handle is
            first asked for (:meth:`handle_for`). With a key per reader every
            frame from ``R<rank>`` must come over ``rank``'s own key.
        shared_reader_key: Opt in to one client keypair for several remote
            readers, carried by the handle every reader gets (then the handle
            is a credential of every remote reader, and the writer can tell
            its remote readers' frames apart only by connection).
        warn_interval: Seconds a wait for room lasts before it is logged with
            the readers behind, and between such warnings (> 0).
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
        remote_reader_keys: dict[int, bytes] | None = None,
        shared_reader_key: bool = False,
        warn_interval: float = DEFAULT_WARN_INTERVAL,
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
        self._warnings = WaitWarnings(warn_interval)
        self._pid = os.getpid()
        self._ctime = psutil.Process(self._pid).create_time()
        self._owner_thread = threading.get_ident()
        self._reader_keys = check_reader_keys(remote_reader_keys, self.n_remote,
                                               local_reader_ranks)
        if shared_reader_key and self._reader_keys is not None:
            raise ValueError("shared_reader_key=True and remote_reader_keys exclude each "
                             "other: readers either share one key or bring their own")
        # One remote reader and no keys of its own: the one key the handle carries
        # is that reader's (whoever else gets the handle is a local reader, which
        # only the writer's own user can be).
        self._shared_key = self.n_remote > 0 and (
            bool(shared_reader_key) or (self.n_remote == 1 and self._reader_keys is None))
        #: Keypairs the writer made for remote ranks, handed out by handle_for
        #: (None: the readers brought their own, or share one, or none is remote).
        self._issued: dict[int, tuple[bytes, bytes]] | None = (
            {} if self.n_remote and self._reader_keys is None and not self._shared_key
            else None)
        self._init_protocol_state()
        #: The ring, the writer's doorbell and the lines to the readers' bells
        #: (none without local readers).
        self.ring: ShmRingBuffer | None = None
        self._doorbell: Doorbell | None = None
        self._channel_dir: str | None = None
        self._reader_rings: list[BellLine] = []
        #: The zmq side (none without readers), and the same object when some
        #: readers are remote (what the publish path asks).
        self._control: WriterControl | None = None
        self._remote: WriterControl | None = None
        self._server_keys: tuple[bytes, bytes] | None = None
        #: The client keypair the handle carries (one remote reader, or opted in).
        self._client_keys: tuple[bytes, bytes] | None = None
        self._auth: ReaderAuthenticator | None = None
        #: Everything this writer holds, released in reverse order of creation
        #: by :meth:`close` or by a failed construction.
        self._resources = contextlib.ExitStack()
        try:
            addrs: dict[str, str] = {}
            if self.n_local:
                prefix = self._open_channel_dir()
                self._create_ring(prefix)
            if n_reader:
                addrs = self._bind_sockets(connect_ip, self._channel_dir)
        except BaseException:
            self._closed = True
            self._resources.close()
            raise
        self.handle = self._make_handle(addrs)

    def _init_protocol_state(self) -> None:
        """Sequence number, readiness and the current wait."""
        self._seq = 0
        self._ready = self.n_reader == 0
        self._closing = False
        self._closed = False
        #: Watches on the local readers' processes, by slot (made when first needed).
        self._local_watch: dict[int, PeerWatch] = {}
        self._wait_seq = 0
        #: Parks on the doorbell, and those that ended by timeout rather than a ring.
        self.park_stats = {"parks": 0, "timeouts": 0}
        self._wait_chunk: int | None = None
        #: The message whose wait for a free chunk ended last (-1: none, or
        #: consumed by the wait for credit that followed it).
        self._chunk_waited = -1
        self._confirming = False  # the wait is for a confirmed message's verdicts
        self._wait_timeout: float | None = None
        self._backoff = Backoff(self.policy, self._check_wait)

    def _open_channel_dir(self) -> str:
        """The private directory of the local sockets, and a line to each reader's
        bell; returns the bells' prefix (the directory and a separator)."""
        res = self._resources
        ringer = BellRinger()
        res.callback(ringer.close)
        self._channel_dir = channel_dir = new_channel_dir()
        # Removed at exit even if close() never runs (not after SIGKILL: see close()).
        res.callback(weakref.finalize(self, remove_channel_dir, channel_dir))
        prefix = channel_dir + os.sep
        self._reader_rings = [ringer.line(bell_address(prefix, f"r{i}"))
                              for i in range(self.n_local)]
        return prefix

    def _create_ring(self, bell_prefix: str) -> None:
        """The shared-memory ring for local readers, and the writer's doorbell."""
        res = self._resources
        self.ring = ring = ShmRingBuffer.create(self.n_local, self.max_chunk_bytes,
                                                self.max_chunks)
        res.callback(ring.close)
        self._parked_lo, self._parked_hi = ring.parked_span()
        self._no_parked = bytes(self.n_local)
        ring.set_writer(self._pid, self._ctime)
        self._doorbell = Doorbell(bell_address(bell_prefix, "w"))
        res.callback(self._doorbell.close)

    def _bind_sockets(self, connect_ip: str | None, channel_dir: str | None) -> dict[str, str]:
        """Bind the XPUB (data) and ROUTER (control) sockets; returns their addresses.

        Local readers connect over ``ipc://`` paths in the channel directory
        (NULL mechanism: the directory's permissions are the access control);
        remote readers over CURVE-authenticated TCP on ``connect_ip`` (default:
        this host's address). The ipc binds come first: zmq takes a listener's
        mechanism from the socket options at bind time.
        """
        res = self._resources
        ctx = zmq.Context(io_threads=1)
        res.callback(ctx.term)
        parts: list[Any] = []  # released by a finalizer if this writer is dropped unclosed
        res.callback(guard_zmq(self, ctx, parts).detach)
        remote = self.n_remote > 0
        pub = new_socket(ctx, zmq.XPUB, tcp=remote, reconnect=True, max_in=CONTROL_MAX_BYTES,
                         queued_in=CONTROL_QUEUE_FRAMES, serve=True)
        res.callback(_close_publisher, pub)
        pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        ctl = new_socket(ctx, zmq.ROUTER, tcp=remote, reconnect=True, max_in=CONTROL_MAX_BYTES,
                         queued_in=CONTROL_QUEUE_FRAMES, serve=True)
        res.callback(close_all, ctl)
        # A reader's new connection takes over its routing id even before the
        # writer saw the old one close (writer_control says why that is safe).
        ctl.setsockopt(zmq.ROUTER_HANDOVER, 1)
        parts += [pub, ctl]
        addrs: dict[str, str] = {}
        if channel_dir is not None:
            addrs["local_pub"] = bind(pub, local_bind_address(channel_dir, "p"))
            addrs["local_ctl"] = bind(ctl, local_bind_address(channel_dir, "c"))
        mon = pub_mon = drain = auth = None
        if remote:
            self._server_keys = new_keypair()
            connections = CONNECTIONS_PER_KEY
            if self._shared_key:
                self._client_keys = new_keypair()
                allowed = {self._client_keys[0]: SHARED_KEY_LABEL}
                connections *= self.n_remote
            else:  # keys made by handle_for() are admitted as they are made
                allowed = {key: f"R{rank}" for rank, key in (self._reader_keys or {}).items()}
            self._auth = auth = ReaderAuthenticator(ctx, allowed, connections)
            res.callback(auth.stop)  # its socket lives on ctx: stopped before term()
            ip = connect_ip or host_ip()
            make_curve_server(pub, self._server_keys[1], ZAP_DOMAIN_DATA)
            # Like the mechanism, taken per listener at bind: TCP connections only.
            pub.setsockopt(zmq.SNDHWM, outbound_queue_messages(self.remote_window))
            make_curve_server(ctl, self._server_keys[1])
            for sock in (pub, ctl):
                if ":" in ip:
                    sock.setsockopt(zmq.IPV6, 1)
            if ":" in ip:
                ip = f"[{ip}]"
            mon = open_monitor(ctl, zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
            res.callback(stop_monitor, ctl, mon)
            pub_mon = open_monitor(pub, HANDSHAKE_FAILED)
            res.callback(stop_monitor, pub, pub_mon)
            drain = MonitorDrain(mon, pub_mon)
            res.callback(drain.stop)  # before the monitors close
            parts[:0] = [auth, drain, mon, pub_mon]
            addrs["remote_pub"] = bind(pub, f"tcp://{ip}:*")
            addrs["remote_ctl"] = bind(ctl, f"tcp://{ip}:*")
        self._control = WriterControl(
            local_ranks=self.local_ranks, n_remote=self.n_remote,
            per_reader_keys=not self._shared_key, ring=self.ring, pub=pub, ctl=ctl, mon=mon,
            monitors=drain, auth=auth)
        self._remote = self._control if remote else None
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
            bell_prefix=None if self._channel_dir is None else self._channel_dir + os.sep,
            writer_pid=self._pid,
            writer_create_time=self._ctime,
            writer_host=socket.gethostname(),
            writer_pid_space=own_pid_space(),
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

    def handle_for(self, rank: int | None) -> Handle:
        """The handle reader ``rank`` connects with.

        For a remote rank of a queue with several remote readers that did not
        bring their own keys (``remote_reader_keys``) nor opted in to share
        one, it is the handle with that rank's own client keypair, made on the
        first call for the rank: it admits that rank alone, so send it to that
        reader only. In every other case (a local rank, None, one remote
        reader, no remote readers) it is :attr:`handle`, which carries a
        client keypair only for a single remote reader or a shared key.

        Raises:
            ValueError: ``rank`` is the writer's own rank or beyond
                :data:`~shm_broadcast.queue.transport.MAX_RANK` (no reader can
                have it), or keys were already made for as many ranks as the
                queue has remote readers, none of them ``rank``.
            QueueClosedError: The queue was closed (its segment is gone).
        """
        self._check_open("export_handle")
        if rank is None or rank in self.local_ranks:
            return self.handle
        if rank == self.writer_rank or not 0 <= rank <= MAX_RANK:
            raise ValueError(
                f"rank must be a reader's rank: an int in [0, {MAX_RANK}] other than the "
                f"writer's own rank {self.writer_rank}, got {rank}")
        issued = self._issued
        if issued is None:
            return self.handle
        keys = issued.get(rank)
        if keys is None:
            if len(issued) >= self.n_remote:
                raise ValueError(
                    f"queue {self.name!r} has {self.n_remote} remote reader(s) and already "
                    f"made keys for ranks {sorted(issued)}; rank {rank} cannot be another")
            if self._auth is None:  # made with the TCP sockets, which every remote queue has
                raise QueueRoleError(f"queue {self.name!r} has no TCP endpoint")
            keys = issued[rank] = new_keypair()
            self._auth.admit(keys[0], f"R{rank}")
        return msgspec.structs.replace(self.handle, curve_client_key=keys[0],
                                       curve_client_secret=keys[1], curve_client_rank=rank)

    # ------------------------------------------------------------ handshake
    def wait_until_ready(self, timeout: float | None) -> None:
        """Block until every reader is attached and subscribed."""
        self._check_open("wait_until_ready")  # also once ready: a closed queue is unusable
        if self._ready:
            return
        control = self._sockets()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        poller = zmq.Poller()
        poller.register(control.pub, zmq.POLLIN)
        poller.register(control.ctl, zmq.POLLIN)
        while True:
            control.drain_subscriptions()
            control.drain(self._seq)
            self._raise_if_cut_off(control)
            remote_ranks = self._remote_ranks()
            missing = control.missing_readers(remote_ranks)
            if not missing:
                break
            if self._closing:
                raise QueueClosedError(
                    f"queue {self.name!r}: shut down while the writer waited for readers",
                    queue=self.name, side=self.side)
            self._raise_if_reader_dead(list(range(self.n_local)), list(control.acked))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise QueueTimeout(
                    f"queue {self.name!r}: {self.side} waited {timeout:g} s for its readers "
                    f"to connect; still missing: {', '.join(missing)}",
                    queue=self.name, side=self.side,
                    peers=control.missing_local() + control.missing_remote(remote_ranks))
            wait = 0.1 if deadline is None else min(0.1, deadline - now)
            poller.poll(max(1, int(wait * 1000)))
        self._ready = True
        if self.ring is not None:
            self._seal_channel_dir()
            self.ring.set_ready()
            self._ring_readers(range(self.n_local))
        if self.n_remote:
            control.pub.send(TOPIC_REMOTE + WIRE.pack(0, KIND_READY, 0, 0))

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

    # ------------------------------------------------------------- enqueue
    def enqueue(self, obj: Any, timeout: float | None) -> None:
        """Send ``obj`` to every reader (see the module docstring)."""
        ring = self.ring
        if (ring is not None and not self._closing
                and ring.buf[self._parked_lo : self._parked_hi] != self._no_parked and self._ready):
            # Early doorbell, first thing: a parked reader needs a kernel
            # wake-up and a CPU before it runs again; let that overlap with
            # encoding and copying. It then polls (see Backoff.rearm); the bell
            # after publishing below still guarantees the wake-up if it parked
            # again meanwhile. The check is inlined (ShmRingBuffer.
            # take_parked_readers + BellRinger.ring): after an idle spell the
            # caches are cold and every Python call before the sendto delays
            # the wake-up.
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
        deadline = None  # set when a wait starts: no clock read when there is room
        if ring is not None:
            chunk = seq % self.max_chunks
            if not ring.is_free(chunk):
                deadline = _deadline(timeout)
                self._wait_free(ring, chunk, seq, deadline, timeout)
        if self._remote and seq + 1 - self.remote_window > self._remote.min_acked:
            self._wait_credit(self._remote, seq, deadline or _deadline(timeout), timeout)
        if ring is not None:
            frames = self._write_local(ring, chunk, seq, enc)
            if self._remote:
                self._send_remote(self._remote.pub, seq, enc, frames, ring, chunk)
        elif self._remote:
            self._send_remote(self._remote.pub, seq, enc, None, None, 0)
        self._seq = seq + 1

    def enqueue_confirmed(self, obj: Any, timeout: float | None) -> list[str | None]:
        """:meth:`enqueue`, then wait until every reader took or refused the message
        (``timeout`` bounds both waits together); each reader's verdict, in slot
        order (see :meth:`ShmRingBuffer.verdicts`)."""
        if self.n_remote:
            raise QueueRoleError(
                f"queue {self.name!r}: a confirmed enqueue needs every reader on the "
                f"writer's host; {self.n_remote} reader(s) are remote")
        seq = self._seq
        deadline = _deadline(timeout)
        self.enqueue(obj, timeout)
        ring = self.ring
        if ring is None:  # no local reader, so (none being remote) no reader at all
            return []
        chunk = seq % self.max_chunks
        if not ring.is_free(chunk):
            self._confirming = True
            try:
                self._wait_free(ring, chunk, seq, deadline, timeout)
            finally:
                self._confirming = False
        return ring.verdicts(chunk)

    def _before_first_or_after_shutdown(self, timeout: float | None) -> None:
        """The rare enqueue states: readers not yet attached, or the queue shut down."""
        if not self._ready:
            self._check_open("enqueue")
            self.wait_until_ready(timeout if timeout is not None else 120.0)
        if self._closing:
            self._check_open("enqueue")
            self._raise_closed("enqueue")

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
            frames = self._frames(seq, enc)
            self._sockets().pub.send_multipart([TOPIC_OVERFLOW + frames[0], frames[1]],
                                               copy=blen < _ZERO_COPY_MIN)
            WIRE.pack_into(ring.buf, d, seq, KIND_OVERFLOW, mlen, blen)
        else:
            buf = ring.buf
            WIRE.pack_into(buf, d, seq, KIND_DATA, mlen, blen)
            buf[d + CHUNK_HEADER : d + CHUNK_HEADER + mlen] = msg
            if blen:
                enc.write_blob(ring.base_addr + d + boff)
        _pack_stamp(ring.buf, d + STAMP_OFFSET, _monotonic())  # read only after W == 1
        ring.publish(chunk)
        ring.full_fence()
        parked = ring.take_parked_readers()
        if parked:
            self._ring_readers(parked)
        return frames

    def _send_remote(self, pub: zmq.SyncSocket, seq: int, enc: Encoded, frames: list[Any] | None,
                     ring: ShmRingBuffer | None, chunk: int) -> None:
        """Publish the message to remote readers, reusing the overflow frames if any.

        A message whose arrays total less than ``_ZERO_COPY_MIN`` bytes goes
        as one frame (topic, header, msgpack, arrays): CURVE seals every frame
        in its own box, so the copy is cheaper than the second box.

        Args:
            pub: The data socket.
            seq: The message's number.
            enc: The encoded message.
            frames: Its overflow frames, when it went out on the overflow topic.
            ring: The ring whose ``chunk`` holds the message's arrays (None:
                no local readers).
            chunk: That chunk.
        """
        if frames is not None:
            pub.send_multipart([TOPIC_REMOTE + frames[0], frames[1]],
                               copy=enc.blob_len < _ZERO_COPY_MIN)
            return
        blob: Any = None
        if ring is not None and enc.blob_len:
            # The chunk already holds the arrays; it is reused once the local
            # readers are done, so whatever is sent is a copy.
            d = ring.data_offset(chunk) + _blob_offset(len(enc.msg))
            blob = ring.buf[d : d + enc.blob_len]
        head = TOPIC_REMOTE + WIRE.pack(seq, KIND_DATA, len(enc.msg), enc.blob_len)
        if enc.blob_len < _ZERO_COPY_MIN:
            if blob is None:
                blob = enc.blob_bytes() if enc.blob_len else b""
            pub.send(b"".join((head, enc.msg, blob)))
        else:
            pub.send_multipart([head + enc.msg, enc.blob_bytes() if blob is None
                                else bytes(blob)], copy=False)

    def _ring_readers(self, readers: Any) -> None:
        rings = self._reader_rings
        for i in readers:
            rings[i]()

    @staticmethod
    def _frames(seq: int, enc: Encoded) -> list[Any]:
        """The message as two frames, header + msgpack and the arrays (overflow path)."""
        return [WIRE.pack(seq, KIND_DATA, len(enc.msg), enc.blob_len) + enc.msg,
                enc.blob_bytes()]

    def _wait_free(self, ring: ShmRingBuffer, chunk: int, seq: int, deadline: float | None,
                   timeout: float | None) -> None:
        doorbell = self._own_doorbell()
        self._wait_seq, self._wait_chunk, self._wait_timeout = seq, chunk, timeout
        self._warnings.start(_monotonic())
        b = self._backoff
        b.start(deadline)
        while not ring.is_free(chunk):
            if b.step() == PARK:
                if self._closing:
                    self._raise_closed("enqueue")
                doorbell.drain()  # rings from before this park are stale
                ring.set_writer_parked(True)
                ring.full_fence()
                if not ring.is_free(chunk):
                    stats = self.park_stats
                    stats["parks"] += 1
                    if not doorbell.wait(b.park_timeout()):
                        stats["timeouts"] += 1
                ring.set_writer_parked(False)
        self._chunk_waited = seq

    def _wait_credit(self, remote: WriterControl, seq: int, deadline: float | None,
                     timeout: float | None) -> None:
        need = seq + 1 - self.remote_window
        # A wait for credit right after this message's wait for a chunk goes on with it.
        fresh, self._chunk_waited = self._chunk_waited != seq, -1
        self._wait_seq, self._wait_chunk, self._wait_timeout = seq, None, timeout
        poller = zmq.Poller()
        poller.register(remote.ctl, zmq.POLLIN)
        if remote.mon is not None:
            poller.register(remote.mon, zmq.POLLIN)
        polling = (remote.monitors.holding if remote.monitors is not None
                   else contextlib.nullcontext)
        b = self._backoff
        b.start(deadline)
        remote.drain(self._seq)
        remote.drain_subscriptions()
        self._raise_if_cut_off(remote)
        if fresh and remote.min_acked < need:
            self._warnings.start(_monotonic())
        while remote.min_acked < need:
            b.step()
            with polling():
                poller.poll(max(1, int(b.park_timeout() * 1000)))
            remote.drain(self._seq)

    def _lagging(self) -> tuple[list[int], list[int]]:
        """Local reader slots and remote ranks holding up the current wait."""
        local: list[int] = []
        if self._wait_chunk is not None and self.ring is not None:
            local = self.ring.lagging_readers(self._wait_chunk)
        need = self._wait_seq + 1 - self.remote_window
        remote = self._remote.lagging(need) if self._remote else []
        return local, remote

    def _check_wait(self, expired: bool) -> None:
        if self._closing:
            self._raise_closed("enqueue")
        if self._control:
            self._control.drain(self._seq)
            self._control.drain_subscriptions()
            self._raise_if_cut_off(self._control)
        local, remote = self._lagging()
        if not local and not remote:
            return
        self._raise_if_reader_dead(local, remote)
        if expired:
            ranks = [self.local_ranks[i] for i in local] + remote
            watches = self._remote.remote_watch if self._remote else {}
            states = [self._local_watch.get(i) for i in local] + [
                watches.get(r) for r in remote]
            who = ", ".join(f"rank {r}: {state_text(w)}"
                            for r, w in zip(ranks, states, strict=True))
            full = (f"ring of {self.max_chunks} chunks full" if local else
                    f"{self.remote_window} messages unacknowledged")
            what = (f"to take message #{self._wait_seq} (a confirmed enqueue; {who})"
                    if self._confirming else f"to consume earlier messages ({full}; {who})")
            raise QueueTimeout(
                f"queue {self.name!r}: enqueue of message #{self._wait_seq} timed out after "
                f"{self._wait_timeout:g} s; the {self.side} is waiting for reader rank(s) "
                f"{ranks} {what}",
                queue=self.name, side=self.side, peers=ranks)
        now = _monotonic()
        if self._warnings.due(now):
            self._warn_laggards(now - self._warnings.began, local, remote)

    def _warn_laggards(self, waited: float, local: list[int], remote: list[int]) -> None:
        """Log the current wait with the readers holding it up (local slots
        ``local``, remote ranks ``remote``), each with its outstanding messages."""
        behind: list[Laggard] = []
        if local:
            unread = self._own_ring().unread_counts()
            behind += [Laggard(f"local reader {i} (rank {self.local_ranks[i]})", unread[i],
                               False, state_text(self._local_watch.get(i))) for i in local]
        if remote and self._remote:
            acked, watches = self._remote.acked, self._remote.remote_watch
            behind += [Laggard(f"remote reader rank {r}", self._seq - acked.get(r, 0), True,
                               state_text(watches.get(r))) for r in remote]
        seq = self._wait_seq
        if self._confirming:
            what = f"its readers to take message #{seq} (a confirmed enqueue)"
        elif local:
            what = f"room for message #{seq} (ring of {self.max_chunks} chunks full)"
        else:
            what = (f"room for message #{seq} ({self.remote_window} messages "
                    f"unacknowledged)")
        logger.warning(writer_warning(self.name, self.side, waited, what, behind))

    def _raise_if_reader_dead(self, local: list[int], remote: list[int]) -> None:
        if local:
            self._raise_if_local_reader_dead(self._own_ring(), local)
        if remote and self._remote:
            self._raise_if_remote_reader_dead(self._remote, remote)

    def _remote_ranks(self) -> list[int] | None:
        """The remote readers' ranks, when their keys tell them (given, or made for
        each through ``export_handle(rank=...)``); None otherwise."""
        if self._reader_keys is not None:
            return list(self._reader_keys)
        if self._issued is not None and len(self._issued) == self.n_remote:
            return list(self._issued)
        return None

    def _raise_if_cut_off(self, control: WriterControl) -> None:
        """End the queue if a reader key sent more subscriptions than a reader does,
        or a message of more parts (see :mod:`shm_broadcast.queue.inbound_limits`):
        shut it down (readers get what was sent, then QueueClosedError; later
        calls here raise it too) and raise PeerDiedError naming the key's rank(s)."""
        cut = control.budgets.cut_off
        if not cut:
            return
        self.shutdown()
        if SHARED_KEY_LABEL in cut:
            ranks = sorted(control.acked)
            who = f"a holder of the client key in the queue's handle (remote ranks {ranks})"
        else:
            ranks = sorted(int(label[1:]) for label in cut)
            who = f"the key of remote reader rank(s) {ranks}"
        raise PeerDiedError(
            f"queue {self.name!r}: {who} {next(iter(cut.values()))}; the {self.side} cut it "
            f"off and stops here (libzmq keeps what a connected peer sent, such as its "
            f"subscriptions, until the queue is closed)", queue=self.name, side=self.side,
            peers=ranks)

    def _raise_if_local_reader_dead(self, ring: ShmRingBuffer, local: list[int]) -> None:
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

    def _raise_if_remote_reader_dead(self, control: WriterControl, remote: list[int]) -> None:
        for rank in remote:
            if rank in control.said_goodbye:
                raise QueueClosedError(
                    f"queue {self.name!r}: remote reader rank {rank} closed the queue",
                    queue=self.name, side=self.side, peers=[rank])
            watch = control.remote_watch.get(rank)
            why = control.dead_remote.get(rank)
            if why is None and watch is not None and not watch.alive():
                why = "its process exited"
            if why is not None:
                who = watch.describe() if watch is not None else "unknown pid"
                raise PeerDiedError(
                    f"queue {self.name!r}: remote reader rank {rank} ({who}) is gone: {why}",
                    queue=self.name, side=self.side, peers=[rank])

    # ------------------------------------------------- what only some writers have
    def _own_ring(self) -> ShmRingBuffer:
        """The ring (only a writer without local readers has none, and never asks)."""
        if self.ring is None:
            raise QueueRoleError(f"queue {self.name!r} has no local readers, hence no ring")
        return self.ring

    def _own_doorbell(self) -> Doorbell:
        """The writer's doorbell (made with the ring)."""
        if self._doorbell is None:
            raise QueueRoleError(f"queue {self.name!r} has no local readers, hence no doorbell")
        return self._doorbell

    def _sockets(self) -> WriterControl:
        """The zmq side (only a writer without readers has none, and never sends)."""
        if self._control is None:
            raise QueueRoleError(f"queue {self.name!r} has no readers, hence no sockets")
        return self._control

    def lag_stats(self) -> dict[str, Any]:
        """How far behind each reader is, computed now (see
        :meth:`~shm_broadcast.queue.message_queue.MessageQueue.lag_stats`).

        Local readers' counts come from the ring's flags
        (:meth:`ShmRingBuffer.unread_counts`), remote readers' from their
        acknowledgements, taken in first.
        """
        self._check_open("lag_stats")
        seq = self._seq
        readers: list[dict[str, Any]] = []
        if self.ring is not None:
            unread = self.ring.unread_counts()
            readers += [{"reader": i, "rank": rank, "remote": False, "outstanding": unread[i]}
                        for i, rank in enumerate(self.local_ranks)]
        if self._remote is not None:
            self._remote.drain(seq)
            acked = self._remote.acked
            readers += [{"reader": None, "rank": rank, "remote": True,
                         "outstanding": seq - acked[rank]} for rank in sorted(acked)]
        return {"written": seq, "readers": readers}

    def security_stats(self) -> dict[str, int]:
        """Counters of what the writer refused (see :meth:`WriterControl.security_stats`)."""
        if self._control is None:
            return dict.fromkeys(("auth_denied", "auth_over_limit", "handshake_failed",
                                  "bad_control", "control_dropped", "subscriptions_dropped"), 0)
        return self._control.security_stats(not self._closed, self._seq)

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
        if (self._remote and not self._closed
                and threading.get_ident() == self._owner_thread):
            with contextlib.suppress(zmq.ZMQError):
                self._remote.pub.send(
                    TOPIC_REMOTE + WIRE.pack(self._seq, KIND_SHUTDOWN, 0, 0), zmq.NOBLOCK)

    def close(self) -> None:
        """Shut down, close sockets and unlink the segment. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # a forked child: zmq state is not ours to touch
            return
        self.shutdown()
        self._closed = True
        self._resources.close()


def _blob_offset(mlen: int) -> int:
    """Arrays start 64-byte aligned after the header and the msgpack bytes."""
    return CHUNK_HEADER + (mlen + 63) // 64 * 64


def _close_publisher(pub: zmq.SyncSocket) -> None:
    """Close the data socket, letting the SHUTDOWN marker and overflow frames out first."""
    if not pub.closed:
        pub.setsockopt(zmq.LINGER, 500)
        pub.close()


def _deadline(timeout: float | None) -> float | None:
    """The monotonic time a wait starting now ends at (None: no end)."""
    return None if timeout is None else time.monotonic() + timeout
