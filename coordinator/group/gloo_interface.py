"""gloo's listening interface for a world whose rendezvous is on loopback.

torch's gloo backend listens for its peers on the address this host's *name*
resolves to, unless ``GLOO_SOCKET_IFNAME`` names interfaces. On a server whose
name resolves to a network address, a ``tcp://127.0.0.1:port`` world would then
have every gloo pair listening on that network address, reachable by anyone on
the network (gloo authenticates nobody), although its rendezvous store listens
on loopback only. Every rank of a loopback rendezvous is on this host, so its
pairs can listen on the loopback interface.

torch reads ``GLOO_SOCKET_IFNAME`` each time it builds a gloo group, so the
variable is set only around the groups groupcoord builds
(:func:`pinned_gloo`: the world group, then the model-parallel groups) and
restored at once: processes started meanwhile and other gloo groups of the
process (a cross-host group of the same engine, say) never see it. A variable
the user set is never changed, and wins.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator

import psutil

from shm_broadcast.ranks.host_address import is_loopback_host

__all__ = ["GLOO_IFNAME_ENV", "loopback_interface", "gloo_interface_for", "pinned_gloo"]

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def loopback_interface() -> str | None:
    """The name of this host's interface that holds an IPv4 loopback address
    (``lo`` on Linux); None when there is none (gloo then keeps its default)."""
    name: str  # psutil is untyped: its interface names are str
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family == socket.AF_INET and ipaddress.ip_address(addr.address).is_loopback:
                return name
    return None


def gloo_interface_for(host: str | None) -> str | None:
    """The interface gloo should listen on for a world whose rendezvous is ``host``:
    the loopback interface when ``host`` is a loopback address and the user has not
    set ``GLOO_SOCKET_IFNAME``; None (gloo's own choice) otherwise."""
    if not host or os.environ.get(GLOO_IFNAME_ENV) or not is_loopback_host(host):
        return None
    return loopback_interface()


@contextlib.contextmanager
def pinned_gloo(name: str | None) -> Iterator[None]:
    """Build gloo groups inside this block with ``GLOO_SOCKET_IFNAME=name``; the
    variable is restored on leaving. Nothing changes for ``name`` None or a
    variable the user set."""
    if name is None or os.environ.get(GLOO_IFNAME_ENV) is not None:
        yield
        return
    os.environ[GLOO_IFNAME_ENV] = name
    try:
        yield
    finally:
        if os.environ.get(GLOO_IFNAME_ENV) == name:
            del os.environ[GLOO_IFNAME_ENV]
