"""gloo's listening interface for a world whose rendezvous is on loopback.

torch's gloo backend listens for its peers on the address this host's *name*
resolves to, unless ``GLOO_SOCKET_IFNAME`` names interfaces. On a server whose
name resolves to a network address, a ``tcp://127.0.0.1:port`` world would then
have every gloo pair listening on that network address, reachable by anyone on
the network (gloo authenticates nobody), although its rendezvous store listens
on loopback only. Every rank of a loopback rendezvous is on this host, so the
pairs can listen on the loopback interface: :func:`pin_gloo_to_loopback` sets
``GLOO_SOCKET_IFNAME`` to it for the world's life (torch reads the variable
each time it builds a gloo group, the model-parallel groups included), and
:func:`unpin_gloo` restores the variable when the world is destroyed. A
variable the user set is never changed.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from shm_broadcast.host_address import is_loopback_host

__all__ = ["GLOO_IFNAME_ENV", "loopback_interface", "pin_gloo_to_loopback", "unpin_gloo"]

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def loopback_interface() -> str | None:
    """The name of this host's interface that holds an IPv4 loopback address
    (``lo`` on Linux); None when there is none (gloo then keeps its default)."""
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET and ipaddress.ip_address(addr.address).is_loopback:
                return name
    return None


def pin_gloo_to_loopback(host: str | None) -> str | None:
    """Make gloo listen on the loopback interface when the rendezvous ``host`` is a
    loopback address and ``GLOO_SOCKET_IFNAME`` is unset.

    Returns:
        The interface name this call set (hand it to :func:`unpin_gloo`), or None
        when it changed nothing.
    """
    if not host or os.environ.get(GLOO_IFNAME_ENV) or not is_loopback_host(host):
        return None
    name = loopback_interface()
    if name is not None:
        os.environ[GLOO_IFNAME_ENV] = name
    return name


def unpin_gloo(name: str | None) -> None:
    """Undo :func:`pin_gloo_to_loopback` that returned ``name``, unless the variable
    was changed since."""
    if name is not None and os.environ.get(GLOO_IFNAME_ENV) == name:
        del os.environ[GLOO_IFNAME_ENV]
