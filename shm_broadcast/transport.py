"""zmq plumbing of the message queue: sockets, endpoints and the wire header.

Two sockets on the writer carry everything that does not go through the ring:

``pub`` (XPUB, writer -> readers), bound on a local endpoint and, when some
readers live on other nodes, on ``tcp://connect_ip:<free port>``. Frames start
with a one-byte topic:

* ``b"o"`` overflow: a message too large for a chunk, for local readers;
* ``b"m"`` every message, for remote readers (and READY / SHUTDOWN markers).

Readers subscribe to the topics they need; XPUB in verbose mode hands every
subscription back to the writer, which is how ``wait_until_ready`` knows that
no message can be lost to the PUB/SUB "slow joiner" effect.

``ctl`` (ROUTER, readers -> writer): each reader connects a DEALER whose
routing id names it (``L<index>`` local, ``R<rank>`` remote) and sends a hello
(pid, process start time, host), remote readers' cumulative acks (flow
control), and a goodbye on close.

Wake-ups of parked sides do not use zmq; see :mod:`shm_broadcast.doorbell`.

Local endpoints are Linux abstract ``ipc://@...`` sockets: no file is created,
so nothing can leak on a crash. Elsewhere they fall back to TCP loopback.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import sys
import threading

import zmq

__all__ = [
    "WIRE",
    "KIND_DATA",
    "KIND_OVERFLOW",
    "KIND_READY",
    "KIND_SHUTDOWN",
    "TOPIC_OVERFLOW",
    "TOPIC_REMOTE",
    "CTL_HELLO",
    "CTL_ACK",
    "CTL_CLOSED",
    "ACK",
    "new_socket",
    "bind",
    "local_bind_address",
    "host_ip",
    "close_all",
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

CTL_HELLO = b"h"
CTL_ACK = b"a"
CTL_CLOSED = b"c"

HOST_IP_ENV = "GROUPCOORD_HOST_IP"


def new_socket(ctx: zmq.Context, kind: int, *, tcp: bool = False) -> zmq.Socket:
    """Create a socket with our defaults: no linger, unbounded queues.

    Queues are unbounded because flow control is ours (the ring for local
    readers, acks for remote ones): zmq's high-water mark would silently drop
    PUB messages instead.

    Args:
        ctx: The queue side's context.
        kind: ``zmq.XPUB``, ``zmq.SUB``, ``zmq.ROUTER`` or ``zmq.DEALER``.
        tcp: Enable ZMTP heartbeats so a silently vanished peer host is
            noticed (a dead process on a live host closes its TCP connection
            right away anyway).
    """
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if tcp:
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        s.setsockopt(zmq.HEARTBEAT_TTL, 3000)
    return s


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind ``sock`` to ``address`` (``tcp://ip:*`` picks a free port).

    Returns:
        The endpoint actually bound, to hand to peers.
    """
    sock.bind(address)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def local_bind_address(tag: str) -> str:
    """Return a fresh same-node endpoint for a socket of this process."""
    if sys.platform.startswith("linux") and zmq.has("ipc"):
        return f"ipc://@gc_mq_{os.getpid()}_{secrets.token_hex(6)}_{tag}"
    return "tcp://127.0.0.1:*"


def host_ip() -> str:
    """Best guess of this host's IP address that other nodes can reach.

    ``$GROUPCOORD_HOST_IP`` wins; otherwise the source address of the default
    route (a UDP ``connect`` sends no packet); otherwise loopback.
    """
    env = os.environ.get(HOST_IP_ENV)
    if env:
        return env
    for target in ("10.255.255.255", "8.8.8.8"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 1))
                ip = s.getsockname()[0]
                if ip and not ip.startswith("0."):
                    return ip
        except OSError:
            continue
    return "127.0.0.1"


def say_goodbye(dealer: zmq.Socket | None, owner_thread: int) -> None:
    """Tell the writer this reader leaves (best effort; zmq sockets are not
    thread-safe, so only the thread that owns ``dealer`` may send)."""
    if dealer is None or threading.get_ident() != owner_thread:
        return
    try:
        dealer.send(CTL_CLOSED, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def close_dealer(dealer: zmq.Socket | None) -> None:
    """Close a reader's control socket, giving its goodbye 200 ms to leave."""
    if dealer is not None and not dealer.closed:
        dealer.setsockopt(zmq.LINGER, 200)
        dealer.close()


def close_all(*socks: zmq.Socket | None) -> None:
    """Close sockets with linger 0, ignoring ones already closed."""
    for s in socks:
        if s is not None and not s.closed:
            s.close(linger=0)
