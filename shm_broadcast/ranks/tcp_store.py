"""TCPStore servers that listen on one address only.

``torch.distributed.TCPStore(host, port, is_master=True)`` listens on every
interface of the host whatever ``host`` says: a store meant for
``127.0.0.1`` is open to the network, and anyone who reaches it can read,
overwrite or delete the rendezvous keys of a group (and so block it). The
store server made here binds ``host:port`` itself and hands the listening
socket to the TCPStore (``master_listen_fd``), so it is reachable exactly
where the caller asked: loopback stays loopback.

Which address is bound:

* an IP address (``127.0.0.1``, ``::1``, ``10.0.0.5``): exactly that one;
* ``localhost``: the first of its loopback addresses this host can bind;
* an IPv4 address in a short form (``127.1``): the address it denotes;
* a name that resolves to loopback addresses only, for a store that serves
  this host only (``loopback_only``: a stateless group whose secret is a
  local key file): those addresses;
* any other host name: every interface, as torch does. A node's own name
  often resolves differently on the node itself (``/etc/hosts`` maps it to
  ``127.0.1.1`` on many distributions) than on the other nodes (DNS), so
  binding what it resolves to here could shut the other nodes out. Pass the
  node's IP address to restrict the store to one interface.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from shm_broadcast.errors import CommTimeout
from shm_broadcast.ranks.host_address import is_loopback_host
from shm_broadcast.ranks.native_calls import wait_at_exit

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["master_store", "client_store", "rank0_store_client", "unbracket_host",
           "CONNECT_GRACE_S"]

# How much longer than its timeout a client may take to connect: the
# constructor's own retries end by the timeout, and a live server answers the
# connection in milliseconds.
CONNECT_GRACE_S = 2.0


def master_store(host: str, port: int, world_size: int | None,
                 timeout: datetime.timedelta, *,
                 listen_socket: socket.socket | None = None,
                 loopback_only: bool = False) -> TCPStore:
    """A TCPStore server listening on ``host:port`` only (``port=0``: a free port,
    which ``store.port`` gives).

    Args:
        host: The address to listen on (a name resolves to its first address).
        port: The port, or 0.
        world_size: Processes that will use the store (None: not counted).
        timeout: The store's default timeout for waits.
        listen_socket: A TCP socket (IPv4 or IPv6) the caller bound to
            ``port`` (listening or not: the store listens); the store listens
            on a duplicate, at the socket's address (the caller's choice).
        loopback_only: The store serves this host only (a group whose secret
            is a local key file): a name that resolves to loopback here listens
            on loopback, not on every interface.

    Raises:
        TypeError: ``listen_socket`` is not a socket.
        ValueError: ``listen_socket`` is not a TCP socket bound to ``port``
            (clients connect to ``port``).
        OSError: ``host:port`` cannot be bound (taken, or not this host's address).
    """
    import torch.distributed as dist

    host = unbracket_host(host)  # torch and the clients take the bare address
    if listen_socket is not None:
        _check_listen_socket(listen_socket, port)
        sock: socket.socket | None = listen_socket.dup()
    else:
        sock = _listen(host, port, loopback_only)
    if sock is None:  # a host name: every interface (see the module docstring)
        return dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=True,
                             timeout=timeout, wait_for_workers=False)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns (and closes) the listening socket from here
    try:
        return dist.TCPStore(host_name=host, port=bound, world_size=world_size, is_master=True,
                             timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def unbracket_host(host: str) -> str:
    """``host`` without the brackets of the URL form of an IPv6 address (``[::1]``
    is ``::1``); any other ``host`` unchanged.

    torch's store takes bare addresses only: a bracketed one is bound (the
    socket is made here) but never reached (torch resolves the brackets as a
    name), so every store address goes through here once.

    Raises:
        ValueError: Brackets around something other than an IPv6 address, or
            only one of them.
    """
    if not host.startswith("[") and not host.endswith("]"):
        return host
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else None
    if inner is not None:
        try:
            if isinstance(ipaddress.ip_address(inner), ipaddress.IPv6Address):
                return inner
        except ValueError:
            pass
    raise ValueError(f"host may be bracketed only around an IPv6 address ([::1]), got {host!r}")


def _check_listen_socket(sock: Any, port: int) -> None:
    """Raise unless ``sock`` is a TCP (IPv4/IPv6) socket bound to ``port`` (any port
    for ``port=0``): the store listens on it while clients connect to ``port``."""
    if not isinstance(sock, socket.socket):
        raise TypeError(f"listen_socket must be a socket.socket, got {type(sock).__name__}")
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        raise ValueError(
            f"listen_socket must be a TCP socket (AF_INET/AF_INET6, SOCK_STREAM) bound to port "
            f"{port}, got a {sock.family.name}/{sock.type.name} socket")
    try:
        bound = sock.getsockname()[1]
    except OSError as e:  # closed
        raise ValueError(f"listen_socket must be an open TCP socket bound to port {port}, "
                         f"got one whose address cannot be read ({e})") from e
    if bound == 0 or (port != 0 and bound != port):
        raise ValueError(
            f"listen_socket must be bound to port {port}, where the clients connect, got one "
            f"{'not bound to any port' if bound == 0 else f'bound to port {bound}'}")


def _listen(host: str, port: int, loopback_only: bool = False) -> socket.socket | None:
    """A socket listening on ``host``'s address (None: ``host`` is a name other than
    localhost, which gets every interface, unless ``loopback_only``).

    An IPv4 address in a short form (``127.1``, ``2130706433``) is that address.
    ``loopback_only`` (a store whose group cannot have ranks on other hosts):
    a name that resolves to loopback addresses here listens on those.

    Raises:
        OSError: No address of ``host`` can be bound.
    """
    try:
        ipaddress.ip_address(host)
        candidates = [host]
    except ValueError:
        numeric = _short_ipv4(host)
        if numeric is not None:
            candidates = [numeric]
        elif host.lower() == "localhost" or (loopback_only and is_loopback_host(host)):
            candidates = list(dict.fromkeys(
                a for a in (str(info[4][0]).split("%", 1)[0] for info in socket.getaddrinfo(
                    host, port, type=socket.SOCK_STREAM))
                if ipaddress.ip_address(a).is_loopback))
        else:
            return None
    error: OSError | None = None
    for address in candidates:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            return socket.create_server((address, port), family=family, backlog=512)
        except OSError as e:
            error = error or e
    raise error or OSError(f"no address to listen on for {host!r}")


def _short_ipv4(host: str) -> str | None:
    """The dotted address a short IPv4 form (``127.1``, ``0x7f.1``, ``2130706433``)
    denotes, as the C resolver reads it; None for anything else."""
    if not host or not all(c.isalnum() or c == "." for c in host):
        return None
    if not all(part.isdigit() or part.lower().startswith("0x") for part in host.split(".")):
        return None
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


def _addresses(host: str, port: int) -> set[str]:
    """The IP addresses ``host`` resolves to (empty when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(info[4][0]) for info in infos}


def _sockets_to(host: str, port: int) -> set[int]:
    """The descriptors of this process's TCP sockets connected to ``host:port`` (any
    address it resolves to; a socket to another host on the same port is not one)."""
    import psutil

    ips = _addresses(host, port)
    me = psutil.Process()
    try:
        conns = (me.net_connections if hasattr(me, "net_connections") else me.connections)(
            kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {c.fd for c in conns if c.fd >= 0 and c.raddr and c.raddr.port == port
            and _unmapped(c.raddr.ip) in ips}


def _unmapped(ip: str) -> str:
    """``ip`` without an IPv4-mapped IPv6 prefix (``::ffff:10.0.0.1`` -> ``10.0.0.1``)."""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def _give_up(done: threading.Event, fds: set[int]) -> None:
    """End a connect thread's wait in torch's constructor, which has no limit once the
    server accepted the connection: shut its socket (``fds``: the sockets to the
    port that the thread opened) so that the constructor fails. Its retries are
    over by then (they stop at the timeout). A thread that still runs is waited
    for at interpreter exit (:func:`~shm_broadcast.ranks.native_calls.wait_at_exit`)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()  # the duplicate only; the thread's own descriptor stays
    if not done.wait(CONNECT_GRACE_S):
        wait_at_exit(done)


def client_store(host: str, port: int, world_size: int | None,
                 timeout: datetime.timedelta) -> TCPStore:
    """A client of the TCPStore at ``host:port`` (it retries until ``timeout``).

    The client's constructor waits without limit for the server to answer a
    connection it accepted (a server process that is stopped still has its
    connections accepted by the kernel), so it runs on a daemon thread that
    is given up on after ``timeout`` plus :data:`CONNECT_GRACE_S`; its socket
    is then shut so that the constructor returns (:func:`_give_up`).

    Raises:
        CommTimeout: No answer within ``timeout`` plus the grace: nothing
            listened, or the server accepted the connection and stayed silent.
        torch.distributed.DistNetworkError: No server accepted the connection
            within ``timeout`` (torch's error).
    """
    import torch.distributed as dist

    host = unbracket_host(host)  # torch connects to the bare address only
    box: dict[str, Any] = {}
    done = threading.Event()
    before = _sockets_to(host, port)

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host_name=host, port=port, world_size=world_size,
                                         is_master=False, timeout=timeout,
                                         wait_for_workers=False)
        except BaseException as e:  # re-raised by the caller
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=connect, name=f"store-connect {host}:{port}", daemon=True)
    thread.start()
    limit = timeout.total_seconds() + CONNECT_GRACE_S
    if not done.wait(limit):
        _give_up(done, _sockets_to(host, port) - before)
        raise CommTimeout(f"could not connect to the TCPStore at {host}:{port} and get its "
                          f"answer within {limit:.1f}s: nothing listens there (yet), or the "
                          f"process serving it is stopped (SIGSTOP, a debugger) or overloaded",
                          queue=f"{host}:{port}")
    if "error" in box:
        raise box["error"]
    store: TCPStore = box["store"]
    return store


def rank0_store_client(host: str, port: int, world_size: int | None,
                       timeout: datetime.timedelta, *, who: str, op: str, queue: str,
                       side: str | None = None) -> TCPStore:
    """:func:`client_store` for a rank other than 0 of a group whose rank 0 serves the
    store: any failure to reach it is a ``CommTimeout`` naming the group (``who``),
    the op and rank 0 (torch's own ``DistNetworkError`` when nothing listens).

    Raises:
        CommTimeout: Rank 0's store did not answer within ``timeout`` (plus the
            connect grace).
    """
    import torch.distributed as dist

    try:
        return client_store(host, port, world_size, timeout)
    except (CommTimeout, dist.DistNetworkError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CommTimeout(
            f"{who}, op {op}: rank 0's store at {host}:{port} did not answer within "
            f"{timeout.total_seconds():g}s (rank 0 not started yet, exited, stopped, or another "
            f"address). Detail: {first}", queue=queue, side=side, peers=[0]) from e
