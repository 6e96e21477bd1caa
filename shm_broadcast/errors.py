"""The exception family of :mod:`shm_broadcast`.

Every error raised on purpose by this package derives from
:class:`ShmBroadcastError`, mixed with the builtin it resembles so callers can
catch either (``except TimeoutError`` works for :class:`QueueTimeout`).

The queue errors carry structured context besides their message, so callers
(for example a GroupCoordinator) can react without parsing text:

* ``queue``: the queue's name,
* ``side``: ``"writer"`` or ``"reader <rank>"`` (who raised),
* ``peers``: the ranks of the peers involved (lagging or dead readers, or the
  writer's rank/``None``).
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "ShmBroadcastError",
    "QueueTimeout",
    "PeerDiedError",
    "QueueClosedError",
    "QueueRoleError",
    "ShmSpaceError",
    "SegmentError",
]


class ShmBroadcastError(Exception):
    """Base class of every error raised on purpose by ``shm_broadcast``."""


class _QueueError(ShmBroadcastError):
    """Base of the queue errors: a message plus where it happened."""

    def __init__(
        self,
        message: str,
        *,
        queue: str | None = None,
        side: str | None = None,
        peers: Sequence[object] | None = None,
    ) -> None:
        super().__init__(message)
        self.queue = queue
        self.side = side
        self.peers: tuple[object, ...] = tuple(peers) if peers is not None else ()


class QueueTimeout(_QueueError, TimeoutError):
    """An enqueue or dequeue did not complete within its timeout.

    Attributes:
        queue: Name of the queue.
        side: ``"writer"`` or ``"reader <rank>"``.
        peers: Ranks of the readers the writer waited for (lagging readers),
            or, on the reader side, the writer's identity.
    """


class PeerDiedError(_QueueError, RuntimeError):
    """The process on the other side of a queue or segment has exited.

    Attributes:
        queue: Name of the queue (``None`` outside a queue).
        side: Who noticed: ``"writer"`` or ``"reader <rank>"``.
        peers: The dead peer(s), as ranks (readers) or ``"writer"``.
    """


class QueueClosedError(_QueueError, RuntimeError):
    """The queue was closed or shut down while a caller used or waited on it."""


class QueueRoleError(ShmBroadcastError, RuntimeError):
    """A writer-only method was called on a reader, or the reverse."""


class SegmentError(ShmBroadcastError, OSError):
    """A shared-memory segment could not be created, attached or removed."""


class ShmSpaceError(SegmentError):
    """``/dev/shm`` has too little free space for a new segment."""
