"""Which address of this host a queue's remote readers can connect to.

A writer with readers on other nodes binds its TCP endpoints on one address
and sends it to them in the handle, so the address must be one that the other
nodes reach. :func:`host_ip` tries, in order:

1. ``$GROUPCOORD_HOST_IP``: the operator knows best (it must be an IP address
   assigned to this host, since the writer binds it: anything else raises
   ``ValueError`` naming the variable, instead of a socket error later);
2. the source address of the route to ``$MASTER_ADDR`` (set by ``torchrun``
   and most launchers to the address every node already used to reach rank
   0's store), unless that is a loopback address: the interface that reaches
   the master is the cluster network's, also on hosts whose default route
   leaves through another interface, or that have no default route at all;
3. the source address of the default route;
4. an address that this host's name resolves to and that is assigned here;
5. loopback, which only peers on this very machine reach (then a warning is
   logged, because remote readers on another host will time out).

Route look-ups use a UDP ``connect``, which selects the source address
without sending a packet.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

__all__ = ["HOST_IP_ENV", "MASTER_ADDR_ENV", "host_ip", "is_loopback_host"]

HOST_IP_ENV = "GROUPCOORD_HOST_IP"
MASTER_ADDR_ENV = "MASTER_ADDR"

#: Targets whose route stands for "the default route" (no packet is sent).
_DEFAULT_ROUTE_TARGETS = ("10.255.255.255", "8.8.8.8")

logger = logging.getLogger(__name__)


def host_ip() -> str:
    """Best guess of this host's IP address that other nodes can reach.

    Returns:
        An IPv4 or IPv6 address string (see the module docstring for the
        order of the sources); ``"127.0.0.1"`` when nothing better is found.

    Raises:
        ValueError: ``$GROUPCOORD_HOST_IP`` is set but is not an IP address
            assigned to this host.
    """
    env = os.environ.get(HOST_IP_ENV)
    if env:
        return _operator_address(env)
    master = os.environ.get(MASTER_ADDR_ENV, "").strip().strip("[]")
    candidates = [_route_source(master)] if master else []
    candidates += [_route_source(t) for t in _DEFAULT_ROUTE_TARGETS]
    candidates.append(_own_name_address())
    for ip in candidates:
        if ip is not None:
            return ip
    logger.warning(
        "no non-loopback address found for this host (no route to $%s, no default route, "
        "the hostname does not resolve to a local address): queue endpoints bind on "
        "127.0.0.1, which readers on other hosts cannot reach; set $%s",
        MASTER_ADDR_ENV, HOST_IP_ENV)
    return "127.0.0.1"


def _operator_address(text: str) -> str:
    """``$GROUPCOORD_HOST_IP``'s address (brackets around IPv6 dropped), checked.

    Raises:
        ValueError: Not an IP address, the wildcard or a multicast address, or
            not assigned to this host (it cannot be bound here).
    """
    ip = text.strip().removeprefix("[").removesuffix("]")
    why = ""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        why = "it is not an IPv4 or IPv6 address"
    else:
        if addr.is_unspecified or addr.is_multicast:
            why = "readers cannot connect to a wildcard or multicast address"
        else:
            try:  # assigned here iff it can be bound
                with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET,
                                   socket.SOCK_DGRAM) as s:
                    s.bind((ip, 0))
            except OSError as e:
                why = f"it is not an address of this host ({e.strerror or e})"
    if why:
        raise ValueError(f"${HOST_IP_ENV} must be an IP address of this host that readers on "
                         f"other hosts reach, got {text!r}: {why}")
    return ip


def _usable(ip: str) -> bool:
    """A concrete, non-loopback unicast address."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    return not (addr.is_loopback or addr.is_unspecified or addr.is_multicast)


def _route_source(target: str) -> str | None:
    """The local address the kernel would send from to reach ``target``.

    ``target`` may be a name or an address; None when it does not resolve,
    is not routable from here, or the route's source is loopback.
    """
    try:
        infos = socket.getaddrinfo(target, 1, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                ip = s.getsockname()[0]
        except OSError:
            continue
        if _usable(ip):
            return str(ip)
    return None


def _own_name_address() -> str | None:
    """An address this host's name resolves to that is assigned to this host."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        if not _usable(ip):
            continue
        try:  # assigned here iff we can bind it
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((ip, 0))
        except OSError:
            continue
        return str(ip)
    return None


def is_loopback_host(host: str) -> bool:
    """``host`` is a loopback address (``[::1]`` brackets and a ``%scope`` allowed), or
    a name that resolves, here, to loopback addresses only."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addrs = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)
