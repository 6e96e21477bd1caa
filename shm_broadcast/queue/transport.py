"""zmq plumbing of the message queue: sockets, endpoints, keys and the wire header.

Two sockets on the writer carry everything that does not go through the ring:

``pub`` (XPUB, writer -> readers), bound on a local endpoint and, when some
readers live on other nodes, on ``tcp://connect_ip:<free port>``. A message
is two frames, ``[topic byte + WIRE header + msgpack, blob]``, or, for remote
readers when the blob is under 64 KiB, one frame with the blob appended
(READY and SHUTDOWN markers: the first frame only); the topic is a prefix of
the first frame rather than a frame of its own, because CURVE seals every
frame separately (one box fewer per frame saved). Topics:

* ``b"o"`` overflow: a message too large for a chunk, for local readers;
* ``b"m"`` every message, for remote readers (and READY / SHUTDOWN markers).

Readers subscribe to the topics they need; XPUB in "verboser" mode hands every
subscription and unsubscription (also of a peer that left) back to the
writer, which is how ``wait_until_ready`` knows that no message can be lost
to the PUB/SUB "slow joiner" effect.

``ctl`` (ROUTER, readers -> writer): each reader connects a DEALER whose
routing id names it (``L<index>`` local, ``R<rank>`` remote, each followed by a
random part: :func:`reader_routing_id`) and sends a hello
(pid, process start time, host, pid space), remote readers' cumulative acks (flow
control), and a goodbye on close.

Wake-ups of parked sides do not use zmq; see :mod:`shm_broadcast.waiting.doorbell`.

Liveness over TCP (what ends a connection, and what does not):

* A peer process that exits has its sockets closed by its kernel: the
  connection ends at once (FIN or RST), the socket monitor reports it, and the
  other side raises ``PeerDiedError``. That is evidence of death.
* A peer that is merely *paused* (``SIGSTOP``, a debugger, swapping, a long
  GC pause) must not look dead. ZMTP heartbeats cannot tell the two apart:
  the heartbeat is answered by the peer's zmq I/O thread, which a stopped
  process does not run, so any heartbeat timeout would turn a longer pause
  into a disconnect on both sides and lose the messages in flight. TCP
  sockets here therefore use no ZMTP heartbeat; they use kernel TCP
  keepalive (:data:`KEEPALIVE_IDLE_S`, :data:`KEEPALIVE_INTERVAL_S`,
  :data:`KEEPALIVE_PROBES`), which the peer's *kernel* answers whether or not
  the process runs. Only a host that vanished (powered off, unplugged,
  partitioned) stops answering, and then the kernel resets the connection
  after about ``KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S``
  seconds of silence: also evidence, from the OS.
* A pause of any length is therefore a timeout case: the waiting side raises
  ``QueueTimeout`` when its caller's timeout runs out, and otherwise keeps
  waiting (a same-host peer's pid and start time are checked as well; a
  stopped process counts as alive).

Who can reach these sockets (see ``docs/security-channels.md``):

* **Local endpoints** are filesystem ``ipc://`` sockets inside the queue's
  *channel directory* (:func:`new_channel_dir`): created ``0700`` by the
  writer with a random name, so no other user can connect to, bind in, or even
  look up a path in it. The doorbells live there too. The writer removes the
  directory once every reader is connected (connected sockets do not need the
  path any more) and on close; it is registered for removal at exit, on a
  fatal signal and by the writer's reaper after any death
  (:mod:`shm_broadcast.lifecycle.exit_cleanup`), it holds an owner record for
  ``groupcoord cleanup`` (:mod:`shm_broadcast.lifecycle.channel_dirs`), and a reader
  that finds the writer dead removes it on its own close.
* **TCP endpoints** use CURVE (Curve25519 + XSalsa20-Poly1305, from libsodium
  through libzmq): the writer is the CURVE server with a fresh keypair per
  queue, and a ZAP handler (:class:`ReaderAuthenticator`) admits only the
  client public keys of the queue's own readers, each at most
  :data:`CONNECTIONS_PER_KEY` times per socket. Each remote reader has a key
  of its own (see :mod:`shm_broadcast.queue.handle` for how it gets it; one
  shared key is an opt-in). A peer without a key completes no handshake: it
  can neither read a frame nor send one, and every refused handshake is
  counted. The local ``ipc://`` listeners are bound before the CURVE options
  are set, so they stay on the NULL mechanism (zmq snapshots mechanism
  options per bind).
* **Inbound limits**: the writer's two sockets take frames of at most
  :data:`CONTROL_MAX_BYTES` and hold at most :data:`CONTROL_QUEUE_FRAMES` per
  connection; what each peer may send beyond that is
  :mod:`shm_broadcast.queue.inbound_limits`'s.
* **No reconnection**: a reader's sockets connect once. Their
  ``ZMQ_RECONNECT_IVL`` is :data:`NO_RECONNECT_MS` (12.4 days) rather than
  ``-1``: with ``-1`` libzmq ends the connection's pipe the moment it drops
  and discards the messages that had arrived but were not read yet (the
  writer's last messages before it exited, an overflow payload in flight);
  with a huge interval the session and those messages survive, and no
  reconnection is attempted within any realistic lifetime of the reader,
  which raises ``PeerDiedError`` within ``WaitPolicy.liveness_s +
  park_poll_s`` of the drop. Over TCP a
  reconnection could not succeed anyway: nobody else holds the writer's
  per-queue secret key. The remote reader also checks, before using any
  frame, that its monitor saw exactly one successful handshake.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import secrets
import struct
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils import z85

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator


__all__ = [
    "WIRE",
    "KIND_DATA",
    "KIND_OVERFLOW",
    "KIND_READY",
    "KIND_SHUTDOWN",
    "TOPIC_OVERFLOW",
    "TOPIC_REMOTE",
    "CONTROL_MAX_BYTES",
    "joined_topic",
    "joined_rank",
    "reader_routing_id",
    "parse_routing_id",
    "CTL_HELLO",
    "CTL_ACK",
    "CTL_CLOSED",
    "ACK",
    "new_socket",
    "bind",
    "local_bind_address",
    "close_all",
    "close_dealer",
    "open_monitor",
    "stop_monitor",
    "say_goodbye",
    "guard_zmq",
    "new_keypair",
    "make_curve_server",
    "make_curve_client",
    "ReaderAuthenticator",
    "HANDSHAKE_FAILED",
    "ZAP_DOMAIN",
    "ZAP_DOMAIN_DATA",
    "SHARED_KEY_LABEL",
    "CONTROL_QUEUE_FRAMES",
    "CONNECTIONS_PER_KEY",
    "MAX_RANK",
    "outbound_queue_messages",
    "count_failed_handshakes",
    "NO_RECONNECT_MS",
    "KEEPALIVE_IDLE_S",
    "KEEPALIVE_INTERVAL_S",
    "KEEPALIVE_PROBES",
]

#: Message header: sequence number, kind, msgpack length, blob length.
WIRE = struct.Struct("<QIIQ")
ACK = struct.Struct("<Q")

KIND_DATA = 0
KIND_OVERFLOW = 1
KIND_READY = 2
KIND_SHUTDOWN = 3

TOPIC_OVERFLOW = b"o"
TOPIC_REMOTE = b"m"
#: The most bytes a frame to the writer may have (``ZMQ_MAXMSGSIZE`` of its
#: two sockets, counted on the wire, where CURVE adds 33 bytes around each
#: frame). The writer receives only the handshake's commands (CURVE HELLO
#: 200 bytes, INITIATE about 300 with a reader's metadata), subscriptions (a
#: flag, a topic byte and at most 9 digits), hellos (about 150 bytes: four
#: numbers, a host name of at most 64 bytes and a pid space of about 50),
#: acks (9 bytes) and goodbyes (1 byte). A peer that sends a longer frame is
#: disconnected before its bytes are buffered.
CONTROL_MAX_BYTES = 1 << 10
#: Frames each of the writer's sockets holds per connection before zmq stops
#: reading that connection (``ZMQ_RCVHWM``; the peer then waits, nothing is
#: dropped). Between two drains a reader has at most a hello, two
#: subscriptions, a few acks (one per ``remote_window // 4`` messages, and the
#: writer drains at least once per ``remote_window`` messages) and a goodbye
#: in flight. It does not bound what libzmq takes in during one call on the
#: data socket while a peer keeps sending: see ``docs/security-channels.md``,
#: "Limits that remain".
CONTROL_QUEUE_FRAMES = 16
#: TCP connections ZAP admits per reader key and socket, over the queue's
#: life (a shared key: that many per remote reader). A reader opens one per
#: socket and never reconnects.
CONNECTIONS_PER_KEY = 2


def outbound_queue_messages(remote_window: int) -> int:
    """Messages the writer's data socket queues per TCP connection
    (``ZMQ_SNDHWM`` of its TCP listener); beyond it XPUB drops that
    connection's messages.

    An honest reader never reaches it. The writer sends message ``n`` only once
    every remote reader acknowledged ``n + 1 - remote_window`` messages, and a
    reader acknowledges only messages it took off its socket, which libzmq's
    I/O thread took off the writer's queue before. libzmq counts what left the
    queue in steps of ``(limit + 1) // 2`` messages, reported to the socket as
    commands; the writer has the data socket take its commands in
    (``ZMQ_EVENTS``) each time it applied acks, so when it sends, the queue
    looks at most ``remote_window`` messages (with a READY or SHUTDOWN marker)
    plus one step short of that fuller than the acks allow: under
    ``2 * remote_window + 8``. A peer that acks without reading, or a second
    connection that never reads, therefore makes the writer hold at most this
    many messages for it and loses the rest; a reader that lost one sees a gap
    in the sequence numbers and raises. The ipc listener stays unbounded:
    local readers are paced by the ring, not by acks.
    """
    return 2 * remote_window + 8


#: A remote reader subscribes to ``TOPIC_JOINED + b"<rank>"`` right after
#: ``TOPIC_REMOTE``: nothing is ever published under it, but the writer's XPUB
#: reports it, and since one connection's subscriptions arrive in order, seeing
#: a rank's joined topic proves that rank's ``TOPIC_REMOTE`` subscription is in
#: place. Counting ``TOPIC_REMOTE`` subscriptions alone would also count an
#: extra connection (a reader's stale one, a second client with an admitted
#: key) and let the writer publish READY before a real reader subscribed.
TOPIC_JOINED = b"j"
_RANK_DIGITS = 9  # ranks below 10**9; longer subscriptions and routing ids are not ours
#: The largest rank a remote reader can have: its routing id and joined topic
#: carry at most nine digits.
MAX_RANK = 10**_RANK_DIGITS - 1


def joined_topic(rank: int) -> bytes:
    """The subscription with which remote reader ``rank`` says its data topic is set."""
    return TOPIC_JOINED + b"%d" % rank


def joined_rank(topic: bytes) -> int | None:
    """The rank a :func:`joined_topic` subscription names, or None if it is not one."""
    digits = topic[1:]
    if (topic[:1] != TOPIC_JOINED or not digits or len(digits) > _RANK_DIGITS
            or not digits.isdigit()):
        return None
    return int(digits)

CTL_HELLO = b"h"
CTL_ACK = b"a"
CTL_CLOSED = b"c"


def reader_routing_id(kind: bytes, n: int) -> bytes:
    """A reader's control routing id: ``L<slot>`` or ``R<rank>``, ``-`` and 16
    random hex digits. The writer's ROUTER lets a new connection take over an
    attached id (``ROUTER_HANDOVER``) and refuses nothing else by id, so an id
    another peer can guess could be taken from the reader; nobody can guess
    this one."""
    return b"%s%d-%s" % (kind, n, secrets.token_hex(8).encode())


def parse_routing_id(ident: bytes) -> tuple[bytes, int] | None:
    """``(b"L" or b"R", number)`` of a reader routing id (with or without its
    random part), or None if ``ident`` is not one."""
    head = ident.partition(b"-")[0]
    if (not 2 <= len(head) <= 1 + _RANK_DIGITS or head[:1] not in (b"L", b"R")
            or not head[1:].isdigit()):
        return None
    return head[:1], int(head[1:])


#: ZAP domains of the writer's TCP listeners, control and data (the
#: authenticator serves only these; a domain per socket lets it count each
#: key's connections per socket).
ZAP_DOMAIN = "groupcoord"
ZAP_DOMAIN_DATA = "groupcoord-data"
#: ZAP label (``User-Id``) of the one client key a queue's handle carries (a
#: single remote reader's, or one shared by opt-in); per-reader keys are
#: labelled ``R<rank>``.
SHARED_KEY_LABEL = "reader"

#: Monitor events of a handshake that did not complete (wrong or missing keys,
#: a peer speaking another mechanism, a ZAP denial).
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

#: A reader socket's reconnect interval: 2**30 ms (12.4 days; zmq adds up to
#: as much again of jitter, which must still fit a C int). Not -1: see the
#: module docstring.
NO_RECONNECT_MS = 1 << 30

#: Milliseconds a connection to a writer's socket has to complete its
#: handshake before the writer drops it (zmq's default is 30 s). A reader
#: completes it in milliseconds; a client that connects and stays silent
#: holds one of the writer's file descriptors only this long.
SERVE_HANDSHAKE_MS = 5000

#: Seconds a TCP connection may be silent before the kernel starts probing it.
KEEPALIVE_IDLE_S = 10
#: Seconds between two unanswered keepalive probes.
KEEPALIVE_INTERVAL_S = 2
#: Unanswered probes after which the kernel resets the connection (the peer's
#: host is gone: a paused process's kernel answers every probe).
KEEPALIVE_PROBES = 5


def new_socket(ctx: zmq.SyncContext, kind: int, *, tcp: bool = False,
               reconnect: bool = False, max_in: int | None = None,
               queued_in: int = 0, serve: bool = False) -> zmq.SyncSocket:
    """Create a socket with our defaults: no linger, unbounded outbound queues.

    Outbound queues are unbounded because flow control is ours (the ring for
    local readers, acks for remote ones): zmq's high-water mark would silently
    drop PUB messages instead. The writer's TCP data listener is the exception
    (:func:`outbound_queue_messages`).

    Args:
        ctx: The queue side's context.
        kind: ``zmq.XPUB``, ``zmq.SUB``, ``zmq.ROUTER`` or ``zmq.DEALER``.
        tcp: Enable kernel TCP keepalive, so a peer host that vanished is
            noticed (a dead process on a live host closes its TCP connection
            right away anyway). No ZMTP heartbeat: it would declare a paused
            peer dead (see the module docstring).
        max_in: Largest frame this socket accepts (``zmq.MAXMSGSIZE``); a
            peer that declares a larger one is disconnected before it is
            buffered, also during the CURVE handshake, so a client without keys
            cannot make the process hold memory. None: unbounded (for sockets
            that receive message payloads).
        queued_in: Frames held per connection before zmq stops reading it
            (``zmq.RCVHWM``; the peer waits, nothing is dropped); 0: unbounded
            (for sockets that receive message payloads).
        serve: A socket that binds for clients (the writer's): a connection
            that has not completed its handshake within
            :data:`SERVE_HANDSHAKE_MS` is dropped, so silent clients cannot
            hold its file descriptors for zmq's default 30 s.
    """
    s = ctx.socket(kind)
    if max_in is not None:
        s.setsockopt(zmq.MAXMSGSIZE, max_in)
    s.setsockopt(zmq.LINGER, 0)
    if not reconnect:
        s.setsockopt(zmq.RECONNECT_IVL, NO_RECONNECT_MS)  # see the module docstring
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, queued_in)
    if serve:
        s.setsockopt(zmq.HANDSHAKE_IVL, SERVE_HANDSHAKE_MS)
    if tcp:
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    return s


def bind(sock: zmq.SyncSocket, address: str) -> str:
    """Bind ``sock`` to ``address`` (``tcp://ip:*`` picks a free port).

    Returns:
        The endpoint actually bound, to hand to peers.
    """
    sock.bind(address)
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    if not isinstance(endpoint, bytes):
        raise TypeError(f"zmq gave a bound endpoint of type {type(endpoint).__name__}")
    return endpoint.decode()


def local_bind_address(channel_dir: str, tag: str) -> str:
    """Return the same-node endpoint ``tag`` (``"p"``, ``"c"``) inside a channel directory.

    Raises:
        OSError: zmq was built without ``ipc://`` (no private local endpoint).
    """
    if not zmq.has("ipc"):
        raise OSError("libzmq lacks ipc:// transport: the queue has no private local channel")
    return f"ipc://{os.path.join(channel_dir, tag)}"


def new_keypair() -> tuple[bytes, bytes]:
    """Return a fresh CURVE ``(public, secret)`` keypair, Z85-encoded (40 bytes each).

    Raises:
        OSError: libzmq was built without CURVE (no libsodium).
    """
    if not zmq.has("curve"):
        raise OSError("libzmq lacks CURVE: the queue cannot authenticate TCP readers; "
                      "install a pyzmq wheel (they bundle libsodium)")
    return zmq.curve_keypair()


def make_curve_server(sock: zmq.SyncSocket, secret: bytes, domain: str = ZAP_DOMAIN) -> None:
    """Make every *later* bind of ``sock`` a CURVE server checked by ZAP in ``domain``.

    ``ZAP_ENFORCE_DOMAIN`` fails closed: without a running ZAP handler no
    client is admitted (libzmq would otherwise accept any client key).
    """
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def make_curve_client(sock: zmq.SyncSocket, server_public: bytes, public: bytes,
                      secret: bytes) -> None:
    """Make ``sock``'s connections CURVE clients of the server ``server_public``."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class ReaderAuthenticator:
    """The writer's ZAP handler: admits only the queue's own readers' keys.

    It runs pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator` (a thread
    answering libzmq's ZAP requests on the context) with a callback that looks
    the client's public key up in ``allowed``, admits each key at most
    ``connections`` times per ZAP domain (one domain per socket), and counts
    refusals. Each admitted connection gets the key's label as its ZAP
    ``User-Id``, which the writer reads on every frame to know which key sent
    it.

    Args:
        ctx: The writer's context (the handler serves every socket on it).
        allowed: Z85 client public key -> label (``"reader"``, ``"R3"``...).
        connections: Connections one key may open per domain, over the
            handler's life.
    """

    def __init__(self, ctx: zmq.SyncContext, allowed: dict[bytes, str],
                 connections: int = CONNECTIONS_PER_KEY) -> None:
        self.allowed = dict(allowed)
        self.connections = connections
        #: ZAP requests refused: an unknown client key.
        self.denied = 0
        #: ZAP requests refused: a known key that used up its connections.
        self.over_limit = 0
        self._admitted: dict[tuple[str, bytes], int] = {}  # only the handler thread writes
        auth = _labelling_authenticator()(ctx, self.allowed)
        self._auth: ThreadAuthenticator | None = auth  # None once stopped
        auth.start()
        for domain in (ZAP_DOMAIN, ZAP_DOMAIN_DATA):
            auth.configure_curve_callback(domain, self)

    def admit(self, key: bytes, label: str) -> None:
        """Allow one more client key (a single dict store: safe while the handler runs)."""
        self.allowed[key] = label

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP decision for a Z85 client key (called on the handler thread)."""
        if key not in self.allowed:
            self.denied += 1  # one writer thread of the GIL-protected int: no lock needed
            return False
        n = self._admitted.get((domain, key), 0)
        if n >= self.connections:
            self.over_limit += 1
            return False
        self._admitted[(domain, key)] = n + 1
        return True

    def stop(self) -> None:
        """Stop the handler thread (before the context is terminated). Idempotent."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


@functools.cache
def _labelling_authenticator(
) -> Callable[[zmq.SyncContext, dict[bytes, str]], ThreadAuthenticator]:
    """pyzmq's ZAP thread, whose ``User-Id`` for an admitted key is the key's label.

    Built at the first use: ``zmq.auth.thread`` imports asyncio, which a
    process without remote readers never needs.
    """
    from zmq.auth.thread import ThreadAuthenticator

    class LabellingAuthenticator(ThreadAuthenticator):
        """Reports each admitted key's label (``labels``) as its ``User-Id``."""

        def __init__(self, ctx: zmq.SyncContext, labels: dict[bytes, str]) -> None:
            super().__init__(ctx)
            self.labels = labels

        def curve_user_id(self, client_public_key: bytes) -> str:
            return self.labels.get(z85.encode(client_public_key), "")

    return LabellingAuthenticator


def count_failed_handshakes(mon: zmq.SyncSocket | None) -> tuple[int, list[int]]:
    """Drain a monitor socket: count failed handshakes, collect disconnected fds.

    Returns:
        ``(failed, disconnected_fds)``, the fds in the order libzmq reported them.
    """
    from zmq.utils.monitor import parse_monitor_message

    failed = 0
    gone: list[int] = []
    if mon is None:
        return failed, gone
    try:
        while True:
            ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            if ev["event"] & HANDSHAKE_FAILED:
                failed += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                gone.append(int(ev["value"]))
    except zmq.Again:
        pass
    return failed, gone


def say_goodbye(dealer: zmq.SyncSocket | None, owner_thread: int) -> None:
    """Tell the writer this reader leaves (best effort; zmq sockets are not
    thread-safe, so only the thread that owns ``dealer`` may send)."""
    if dealer is None or threading.get_ident() != owner_thread:
        return
    with contextlib.suppress(zmq.ZMQError):
        dealer.send(CTL_CLOSED, zmq.NOBLOCK)


def close_dealer(dealer: zmq.SyncSocket | None) -> None:
    """Close a reader's control socket, giving its goodbye 200 ms to leave."""
    if dealer is not None and not dealer.closed:
        dealer.setsockopt(zmq.LINGER, 200)
        dealer.close()


_MONITORS = itertools.count()


def open_monitor(sock: zmq.SyncSocket, events: int) -> zmq.SyncSocket:
    """Monitor ``events`` of ``sock``: the PAIR socket its events arrive on.

    As ``get_monitor_socket``, but the pipe from libzmq's side is unbounded
    (``RCVHWM`` 0 on this end: an inproc pipe with either mark 0 has none).
    libzmq sends monitor events blocking, from the I/O thread the context's
    sockets share; with the default mark of 1,000, events nobody took in yet
    (a failed handshake for every TCP connection to a public port: a scan, a
    health probe, an attacker) filled the pipe, and the I/O thread stopped with
    them: no connection accepted, nothing sent or received, and
    ``disable_monitor`` (at close) waited for it forever. Owners drain their
    monitors whenever they take in their control traffic, and a writer's also
    in the background (:mod:`shm_broadcast.queue.monitor_drain`).
    """
    addr = f"inproc://groupcoord-monitor-{os.getpid()}-{next(_MONITORS)}"
    mon: zmq.SyncSocket = sock.context.socket(zmq.PAIR)
    try:
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.setsockopt(zmq.LINGER, 0)
        sock.monitor(addr, events)
        mon.connect(addr)
    except BaseException:
        mon.close(0)
        raise
    return mon


def stop_monitor(sock: zmq.SyncSocket, mon: zmq.SyncSocket) -> None:
    """Stop ``sock``'s monitor and close its monitor socket ``mon``."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    close_all(mon)


def close_all(*socks: zmq.SyncSocket | None) -> None:
    """Close sockets with linger 0, ignoring ones already closed."""
    for s in socks:
        if s is not None and not s.closed:
            s.close(linger=0)


def guard_zmq(owner: object, ctx: zmq.SyncContext, parts: list[Any],
              ) -> weakref.finalize[[zmq.SyncContext, list[Any], int], object]:
    """Release ``ctx`` and ``parts`` (its sockets, and objects with ``stop()`` such
    as :class:`ReaderAuthenticator`) if ``owner`` is dropped without being closed.

    Why it is needed: a context collected while its sockets are open blocks in
    ``zmq_ctx_term`` forever. When an unclosed queue is part of a reference
    cycle, the garbage collector clears pyzmq's weak references to the sockets
    before the context's own finalizer runs, so that finalizer cannot close
    them and the process hangs at the next collection. The finalizer returned
    here holds the context and ``parts`` strongly, so it runs first (with the
    owner's weak references) and finds them all open: it stops and closes
    them with linger 0, then terminates the context. ``owner.close()`` should
    call its ``detach()`` before releasing them itself. The list is read when
    the finalizer runs, so parts appended later count too.

    Not at interpreter exit (``atexit = False``), as pyzmq's own context
    finalizer does not run then: a daemon thread may still be using, or
    closing, the very sockets, and two threads in ``zmq_ctx_term`` on one
    context wait for each other forever; the process's end releases them.
    """
    finalizer = weakref.finalize(owner, _release_zmq, ctx, parts, os.getpid())
    finalizer.atexit = False
    return finalizer


def _release_zmq(ctx: zmq.SyncContext, parts: list[Any], pid: int) -> None:
    if os.getpid() != pid:  # a forked child: the zmq state is the parent's
        return
    for part in parts:
        try:
            if isinstance(part, zmq.Socket):
                close_all(part)
            elif part is not None:
                part.stop()
        except (zmq.ZMQError, RuntimeError, OSError):
            pass
    with contextlib.suppress(zmq.ZMQError):
        ctx.term()
