"""What a queue's creator chooses: the ring's defaults and the checks of those options.

Shared by the two ways a queue is made: :class:`~shm_broadcast.queue.message_queue.MessageQueue`
(one writer, its readers later) and the collective
:func:`~shm_broadcast.queue.process_group.create_from_process_group`, which checks
the same options on every rank before any rank creates anything.
"""

from __future__ import annotations

from typing import Any

from shm_broadcast.checks import check_int
from shm_broadcast.waiting.policy import WaitPolicy

__all__ = ["DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_MAX_CHUNKS", "DEFAULT_READY_TIMEOUT",
           "check_ring_options", "check_wait_policy"]

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


def check_ring_options(max_chunk_bytes: Any, max_chunks: Any, connect_ip: Any) -> None:
    """Check a writer's ring sizes and TCP address.

    Raises:
        TypeError: A size is not an int.
        ValueError: A size is too small, or ``connect_ip`` is not None or a
            non-empty str.
    """
    check_int(max_chunk_bytes, "max_chunk_bytes", minimum=128)
    check_int(max_chunks, "max_chunks", minimum=1)
    if connect_ip is not None and not isinstance(connect_ip, str):
        raise TypeError(f"connect_ip must be None or an IP address string, got "
                        f"{type(connect_ip).__name__} ({connect_ip!r:.60})")
    if connect_ip == "":
        raise ValueError("connect_ip must be None or an IP address string, got ''")


def check_wait_policy(wait_policy: Any) -> WaitPolicy | None:
    """Return ``wait_policy`` if it is a :class:`WaitPolicy` or None.

    Raises:
        TypeError: It is anything else.
    """
    if wait_policy is not None and not isinstance(wait_policy, WaitPolicy):
        raise TypeError(f"wait_policy must be a WaitPolicy, got {type(wait_policy).__name__}")
    return wait_policy
