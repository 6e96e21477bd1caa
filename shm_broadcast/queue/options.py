"""What a queue's creator chooses: the ring's defaults and the checks of those options.

Shared by the two ways a queue is made: :class:`~shm_broadcast.queue.message_queue.MessageQueue`
(one writer, its readers later) and the collective
:func:`~shm_broadcast.queue.process_group.create_from_process_group`, which checks
the same options on every rank before any rank creates anything.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from shm_broadcast.checks import check_int, check_timeout
from shm_broadcast.timeouts import env_timeout
from shm_broadcast.waiting.policy import WaitPolicy
from shm_broadcast.waiting.thread_cpu import spread_enabled

__all__ = ["check_connect_ip", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS",
           "DEFAULT_READY_TIMEOUT",
           "DEFAULT_WARN_INTERVAL", "WARN_INTERVAL_ENV", "check_ring_options",
           "check_wait_policy", "check_warn_interval"]

#: Ring defaults: 4 chunks of 2 MiB (8 MiB per queue). A message up to 2 MiB
#: (the 1 MiB tensors of ``groupcoord bench mq`` included) goes through the
#: ring; larger ones take the overflow path (zmq ``ipc://``, no size limit).
#: Sized so that a TP=8 host's segments (this ring, the CPU communicator
#: workspaces) fit Docker's default 64 MiB ``/dev/shm`` with room to spare;
#: see docs/lifecycle.md, "How much /dev/shm".
DEFAULT_MAX_CHUNK_BYTES = 2 << 20
DEFAULT_MAX_CHUNKS = 4
#: Seconds every side waits for the queue to connect, unless told otherwise.
DEFAULT_READY_TIMEOUT = 120.0
#: Seconds a side waits before it logs who holds it up, and then again every
#: as many seconds while the wait lasts (:mod:`shm_broadcast.queue.laggards`).
DEFAULT_WARN_INTERVAL = 10.0
#: Environment variable overriding :data:`DEFAULT_WARN_INTERVAL` (seconds, > 0);
#: a queue's ``warn_interval`` argument overrides both.
WARN_INTERVAL_ENV = "GROUPCOORD_MQ_WARN_INTERVAL"


def check_ring_options(max_chunk_bytes: Any, max_chunks: Any,
                       connect_ip: Any) -> tuple[int, int]:
    """Check a writer's ring sizes and TCP address; the sizes as ints.

    Raises:
        TypeError: A size is not an int.
        ValueError: A size is too small, or ``connect_ip`` is not None or an IP
            address remote readers can connect to (:func:`check_connect_ip`).
    """
    chunk_bytes = check_int(max_chunk_bytes, "max_chunk_bytes", minimum=128)
    chunks = check_int(max_chunks, "max_chunks", minimum=1)
    if connect_ip is not None and not isinstance(connect_ip, str):
        raise TypeError(f"connect_ip must be None or an IP address string, got "
                        f"{type(connect_ip).__name__} ({connect_ip!r:.60})")
    if connect_ip is not None:
        check_connect_ip(connect_ip)
    return chunk_bytes, chunks


def check_connect_ip(connect_ip: str) -> str:
    """``connect_ip`` if it is an IPv4 or IPv6 address a remote host can connect to.

    The writer binds its TCP sockets on it and hands it to remote readers, so
    neither a host name nor a wildcard (``0.0.0.0``, ``::``, ``*``: no reader
    reaches it) will do.

    Raises:
        ValueError: Not such an address.
    """
    try:
        address = ipaddress.ip_address(connect_ip)
    except ValueError:
        raise ValueError(f"connect_ip must be None or an IP address string such as "
                         f"'10.0.0.5' or 'fd00::5', got {connect_ip!r:.80}") from None
    if address.is_unspecified:
        raise ValueError(f"connect_ip must be an address remote readers can connect to, got "
                         f"the wildcard {connect_ip!r}; pass this host's address on the "
                         f"readers' network (or None for the default)")
    return connect_ip


def check_wait_policy(wait_policy: Any) -> WaitPolicy | None:
    """Return ``wait_policy`` if it is a :class:`WaitPolicy` or None.

    A predictive policy whose reader may move off a shared CPU reads
    ``GROUPCOORD_CPU_SPREAD`` here, so that a bad value raises on every rank
    before anything is made (not only in the readers, after the writer made
    the queue).

    Raises:
        TypeError: It is anything else.
        ValueError: ``GROUPCOORD_CPU_SPREAD`` is not an on/off word (and the
            policy's readers would read it).
    """
    if wait_policy is None:
        return None
    if not isinstance(wait_policy, WaitPolicy):
        raise TypeError(f"wait_policy must be a WaitPolicy, got {type(wait_policy).__name__}")
    if wait_policy.predict is not None and wait_policy.predict.leave_shared_cpu:
        spread_enabled()
    return wait_policy


def check_warn_interval(warn_interval: Any) -> float:
    """Return the seconds between a waiting side's warnings.

    Args:
        warn_interval: A positive finite number of seconds (or a
            ``datetime.timedelta``); None: ``$GROUPCOORD_MQ_WARN_INTERVAL``
            if set, else :data:`DEFAULT_WARN_INTERVAL`.

    Raises:
        TypeError: ``warn_interval`` is not a number of seconds.
        ValueError: ``warn_interval`` (or the environment variable) is not a
            finite number of seconds > 0; the message names it.
    """
    seconds = (env_timeout(WARN_INTERVAL_ENV) if warn_interval is None
               else check_timeout(warn_interval, "warn_interval", positive=True))
    return DEFAULT_WARN_INTERVAL if seconds is None else seconds
