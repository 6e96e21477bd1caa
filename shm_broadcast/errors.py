"""The project's one exception family, rooted here in the bottom package.

Every error that ``shm_broadcast``, ``device_comms`` and ``coordinator`` raise
on purpose derives from :class:`GroupCoordError`, mixed with the builtin it
resembles, so callers can catch either (``except TimeoutError`` catches
:class:`CommTimeout`). The upper packages re-export these classes and add
only errors of their own kind (NCCL, kernel compilation, rank failures of the
test harness); the same condition raises the same class in every layer:

=====================  ==========================================  ==============
condition              class                                       builtin
=====================  ==========================================  ==============
a wait ran out         :class:`CommTimeout`                        TimeoutError
a peer process exited  :class:`PeerDiedError`                      RuntimeError
used after close       :class:`ClosedError`                        RuntimeError
ranks disagree, or     :class:`CollectiveMismatch`                 ValueError
the source failed      (:class:`PeerRejectedError`: a peer refused
                       its own arguments)
wrong queue role       :class:`QueueRoleError`                     RuntimeError
a second thread in a   :class:`ConcurrentCallError`                RuntimeError
one-at-a-time object
(queue, communicator)
malformed bytes from   :class:`DecodeError`                        ValueError
a peer (or refused
pickle)
shared memory          :class:`SegmentError` (:class:`ShmSpaceError`)  OSError
=====================  ==========================================  ==============

Argument errors are plain ``TypeError`` (wrong type) and ``ValueError``
(wrong value), never a class of this family.

Errors raised around a channel carry structured context besides their message,
so callers can react without parsing text:

* ``queue``: the queue's (or group's) name,
* ``side``: who raised (``"writer"``, ``"reader <rank>"``, ``"rank <r>"``),
* ``peers``: the ranks of the peers involved (lagging, missing or dead ones).

The older names stay as aliases of the same classes: ``ShmBroadcastError``
(the root), ``QueueTimeout`` (:class:`CommTimeout`) and ``QueueClosedError``
(:class:`ClosedError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "GroupCoordError",
    "CommTimeout",
    "PeerDiedError",
    "ClosedError",
    "CollectiveMismatch",
    "PeerRejectedError",
    "QueueRoleError",
    "ConcurrentCallError",
    "DecodeError",
    "EncodeError",
    "SegmentError",
    "ShmSpaceError",
    "ShmBroadcastError",
    "QueueTimeout",
    "QueueClosedError",
]


class GroupCoordError(Exception):
    """Base class of every error raised on purpose by this project.

    Args:
        message: What happened, naming the group or queue, the op and the ranks.
        queue: Name of the queue or group involved, if any.
        side: Who raised (``"writer"``, ``"reader <rank>"``, ``"rank <r>"``).
        peers: Ranks (or names) of the peers involved.
    """

    def __init__(
        self,
        message: str = "",
        *,
        queue: str | None = None,
        side: str | None = None,
        peers: Sequence[object] | None = None,
    ) -> None:
        super().__init__(message)
        self.queue = queue
        self.side = side
        self.peers: tuple[object, ...] = tuple(peers) if peers is not None else ()


class CommTimeout(GroupCoordError, TimeoutError):
    """A wait did not complete within its timeout.

    The message names the group (or queue), the operation and the ranks that
    did not arrive; ``peers`` holds those ranks when they are known.
    """


class PeerDiedError(GroupCoordError, RuntimeError):
    """The process on the other side of a queue, segment or collective has exited."""


class ClosedError(GroupCoordError, RuntimeError):
    """A queue, group or communicator was used (or waited on) after it was closed."""


class CollectiveMismatch(GroupCoordError, ValueError):
    """Ranks called the same operation incompatibly, or its source rank failed.

    Raised on the ranks whose own call was valid: different shapes, dtypes or
    ops, a source whose payload could not be produced or decoded.
    """


class PeerRejectedError(CollectiveMismatch):
    """A peer rejected its own arguments of the collective this rank was in.

    Raised on the ranks whose call was valid, promptly, instead of leaving them
    waiting for a rank that raised ``ValueError``/``TypeError`` locally.
    Nothing was exchanged and the communicator stays usable.

    Attributes:
        rank: Group rank that rejected the call.
        op: The operation this rank was running.
        reason: The rejecting rank's error message (may be empty).
    """

    def __init__(self, group: str, op: str, rank: int, reason: str) -> None:
        super().__init__(
            f"group {group!r}, op {op}: rank {rank} rejected its arguments of this collective "
            f"({reason or 'no reason given'}); this call was abandoned on every rank, nothing "
            f"was exchanged and the group stays usable. Fix the call on rank {rank}.",
            queue=group, peers=(rank,),
        )
        self.rank, self.op, self.reason = rank, op, reason

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the custom __init__ picklable across processes
        return (_rebuild_rejected, (str(self), self.rank, self.op, self.reason))


def _rebuild_rejected(msg: str, rank: int, op: str, reason: str) -> PeerRejectedError:
    e = PeerRejectedError.__new__(PeerRejectedError)
    GroupCoordError.__init__(e, msg, peers=(rank,))
    e.rank, e.op, e.reason = rank, op, reason
    return e


class QueueRoleError(GroupCoordError, RuntimeError):
    """A writer-only method was called on a reader, or the reverse."""


class ConcurrentCallError(GroupCoordError, RuntimeError):
    """A call was made while another thread's call of the same object was still
    running, where the object serves one call at a time (a communicator's
    collectives, a queue side's enqueue or dequeue).

    Raised before the call touches anything; the call in flight is unaffected.
    """


class DecodeError(GroupCoordError, ValueError):
    """Received bytes could not be decoded: malformed, truncated or refused.

    The one error every decoder of this project raises for input it cannot
    accept: a size that does not match the bytes present, a negative or
    overflowing shape, an unknown dtype or type code, bad UTF-8, a pickled
    value on a side that did not opt in to pickle. Nothing was allocated for
    the claimed sizes before it is raised. ``queue`` and ``side`` name the
    channel when the decoder knows it.
    """


class EncodeError(GroupCoordError, TypeError, ValueError):
    """A value could not be encoded for sending; nothing of it was sent.

    Raised by the codec for what is wrong with a value rather than with its
    type: a tensor whose storage was freed or shrunk under it (the ValueError
    a collective raises for the same tensor), a structure nested too deeply,
    a tensor whose sizes torch cannot report. Both a ``TypeError`` (what the
    codec raises for every value it cannot send, which callers report to the
    receivers) and a ``ValueError`` (what the same mistake raises elsewhere).
    """


class SegmentError(GroupCoordError, OSError):
    """A shared-memory segment could not be created, attached or removed."""


class ShmSpaceError(SegmentError):
    """``/dev/shm`` has too little free space for a new segment."""


# Older names of the same classes.
ShmBroadcastError = GroupCoordError
QueueTimeout = CommTimeout
QueueClosedError = ClosedError
