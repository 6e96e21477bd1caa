"""The exception family of :mod:`shm_broadcast`.

Every error raised on purpose by this package derives from
:class:`ShmBroadcastError`, mixed with the builtin it resembles so callers can
catch either (``except TimeoutError`` works for :class:`QueueTimeout`).
"""

from __future__ import annotations

__all__ = [
    "ShmBroadcastError",
    "QueueTimeout",
    "PeerDiedError",
    "QueueClosedError",
    "ShmSpaceError",
    "SegmentError",
]


class ShmBroadcastError(Exception):
    """Base class of every error raised on purpose by ``shm_broadcast``."""


class QueueTimeout(ShmBroadcastError, TimeoutError):
    """An enqueue or dequeue did not complete within its timeout."""


class PeerDiedError(ShmBroadcastError, RuntimeError):
    """The process on the other side of a queue or segment has exited."""


class QueueClosedError(ShmBroadcastError, RuntimeError):
    """The queue was closed or shut down while a caller used or waited on it."""


class SegmentError(ShmBroadcastError, OSError):
    """A shared-memory segment could not be created, attached or removed."""


class ShmSpaceError(SegmentError):
    """``/dev/shm`` has too little free space for a new segment."""
