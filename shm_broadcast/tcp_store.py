"""TCPStore servers that listen on one address only.

``torch.distributed.TCPStore(host, port, is_master=True)`` listens on every
interface of the host whatever ``host`` says: a store meant for
``127.0.0.1`` is open to the network, and anyone who reaches it can read,
overwrite or delete the rendezvous keys of a group (and so block it). The
store server made here binds ``host:port`` itself and hands the listening
socket to the TCPStore (``master_listen_fd``), so it is reachable exactly
where the caller asked: loopback stays loopback.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

__all__ = ["master_store", "client_store"]


def master_store(host: str, port: int, world_size: int | None,
                 timeout: datetime.timedelta) -> Any:
    """A TCPStore server listening on ``host:port`` only (``port=0``: a free port,
    which ``store.port`` gives).

    Args:
        host: The address to listen on (a name resolves to its first address).
        port: The port, or 0.
        world_size: Processes that will use the store (None: not counted).
        timeout: The store's default timeout for waits.

    Raises:
        OSError: ``host:port`` cannot be bound (taken, or not this host's address).
    """
    import torch.distributed as dist

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=512)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns (and closes) the listening socket from here
    try:
        return dist.TCPStore(host_name=host, port=bound, world_size=world_size, is_master=True,
                             timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def client_store(host: str, port: int, world_size: int | None,
                 timeout: datetime.timedelta) -> Any:
    """A client of the TCPStore at ``host:port`` (it retries until ``timeout``)."""
    import torch.distributed as dist

    return dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=False,
                         timeout=timeout, wait_for_workers=False)
