"""Shared-memory broadcast: one writer, many readers, microseconds per message.

This package uses nothing else of groupcoord. It also hosts the shared-memory
segment lifecycle (:mod:`shm_broadcast.segment`) and same-node detection
(:mod:`shm_broadcast.topology`) that the higher layers reuse.
"""

from shm_broadcast.errors import (
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    SegmentError,
    ShmBroadcastError,
    ShmSpaceError,
)
from shm_broadcast.segment import SharedSegment, list_segments, remove_orphans
from shm_broadcast.topology import in_the_same_node_as, node_assignment

__all__ = [
    "ShmBroadcastError",
    "QueueTimeout",
    "PeerDiedError",
    "QueueClosedError",
    "SegmentError",
    "ShmSpaceError",
    "SharedSegment",
    "list_segments",
    "remove_orphans",
    "in_the_same_node_as",
    "node_assignment",
]
