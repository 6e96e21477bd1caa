"""Shared-memory broadcast: one writer, many readers, microseconds per message.

This package uses nothing else of groupcoord. Main entry point:
:class:`MessageQueue` (see :mod:`shm_broadcast.queue.message_queue`). It also hosts
the shared-memory segment lifecycle (:mod:`shm_broadcast.lifecycle.segment`) and
same-node detection (:mod:`shm_broadcast.ranks.topology`) that the higher layers
reuse.
"""

from shm_broadcast.errors import (
    ClosedError,
    CollectiveMismatch,
    CommTimeout,
    ConcurrentCallError,
    DecodeError,
    EncodeError,
    GroupCoordError,
    PeerDiedError,
    QueueClosedError,
    QueueRoleError,
    QueueTimeout,
    SegmentError,
    ShmBroadcastError,
    ShmSpaceError,
)
from shm_broadcast.lifecycle.segment import SharedSegment, list_segments, remove_orphans
from shm_broadcast.queue.handle import Handle
from shm_broadcast.queue.message_queue import MessageQueue
from shm_broadcast.queue.ring_buffer import ShmRingBuffer
from shm_broadcast.ranks.topology import in_the_same_node_as, node_assignment
from shm_broadcast.waiting.policy import WaitPolicy
from shm_broadcast.waiting.predictive import PredictivePolicy

__all__ = [
    "GroupCoordError",
    "CommTimeout",
    "ClosedError",
    "CollectiveMismatch",
    "DecodeError",
    "EncodeError",
    "ShmBroadcastError",
    "QueueTimeout",
    "PeerDiedError",
    "QueueClosedError",
    "ConcurrentCallError",
    "QueueRoleError",
    "SegmentError",
    "ShmSpaceError",
    "MessageQueue",
    "Handle",
    "WaitPolicy",
    "PredictivePolicy",
    "ShmRingBuffer",
    "SharedSegment",
    "list_segments",
    "remove_orphans",
    "in_the_same_node_as",
    "node_assignment",
]
