"""Naming laggards: a wait that lasts is logged with who holds it up.

A queue side blocked for longer than its ``warn_interval`` (default 10 s,
``$GROUPCOORD_MQ_WARN_INTERVAL``; see
:func:`~shm_broadcast.queue.options.check_warn_interval`) logs a WARNING on
the ``shm_broadcast.queue`` logger (:data:`logger`), then one more per
interval for as long as the wait lasts:

* the writer, waiting for room (its ring is full, or a remote reader is a
  window behind) or for the readers of a confirmed message: the queue, how
  long it has waited and, for each reader holding it up (those that have not
  read the oldest message the writer needs back), the reader's ring slot and
  rank (a remote reader: its rank), how many messages it has outstanding and
  what its process is doing (running, stopped, on another host). A reader
  the writer can tell is dead or closed never gets here: the wait raises
  ``PeerDiedError`` / ``QueueClosedError`` naming it instead;
* a reader waiting for a message: the queue, the writer (rank, pid and
  state), how long it has waited and how long ago its last message arrived
  (or how long ago it connected, before the first message).

The bookkeeping lives off the message path: a wait starts its
:class:`WaitWarnings` when it begins, and the wait's periodic check (every
``WaitPolicy.liveness_s``, see :class:`~shm_broadcast.waiting.policy.Backoff`)
asks it whether a warning is due, so a warning comes at most ``liveness_s``
after it is due. A message that finds room, or finds its message published,
does no work for it. The per-reader lag the writer's warning reports is
readable at any time from
:meth:`~shm_broadcast.queue.message_queue.MessageQueue.lag_stats`.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

__all__ = ["logger", "WaitWarnings", "Laggard", "LastMessage", "WRITER_STATE",
           "writer_warning", "reader_warning"]

#: One logger for every side of every queue, named after the package: one
#: setting routes or silences them all.
logger = logging.getLogger("shm_broadcast.queue")


#: How a reader's messages describe the writer's process (:meth:`PeerWatch.state`).
WRITER_STATE = {
    "running": "alive",
    "stopped": "alive but stopped (SIGSTOP, job control or a debugger)",
    "exited": "gone",
    "unknown": "on another host",
}


class WaitWarnings:
    """When the current wait's next warning is due.

    Args:
        interval: Seconds from the wait's start to its first warning, and
            between warnings (> 0, checked by the queue).

    Attributes:
        interval: As given.
        began: When the current wait began (monotonic seconds).
    """

    __slots__ = ("interval", "began", "_due")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.began = 0.0
        self._due = math.inf

    def start(self, now: float) -> None:
        """A wait that warns begins at ``now`` (monotonic)."""
        self.began = now
        self._due = now + self.interval

    def stop(self) -> None:
        """The wait that begins now warns not (it is not one this module names)."""
        self._due = math.inf

    def due(self, now: float) -> bool:
        """Whether a warning is due at ``now``; if so the next one is due an
        interval later."""
        if now < self._due:
            return False
        self._due = now + self.interval
        return True


class Laggard(NamedTuple):
    """One reader holding the writer up, as its warning names it."""

    #: ``"local reader <slot> (rank <r>)"`` or ``"remote reader rank <r>"``.
    who: str
    #: Messages written that it has not read (a remote reader: not acknowledged).
    outstanding: int
    #: Whether it reads over TCP (its count is of unacknowledged messages).
    remote: bool
    #: Its process's state (:func:`~shm_broadcast.waiting.peer_watch.state_text`).
    state: str


class LastMessage(NamedTuple):
    """What a waiting reader knows of its last message's arrival."""

    #: ``"arrived"``: ``seconds`` ago exactly; ``"before"``: before the wait
    #: began, so at least ``seconds`` (the wait's length) ago; ``"none"``: no
    #: message yet, and the reader connected ``seconds`` ago.
    kind: str
    seconds: float


def _messages(n: int) -> str:
    return f"{n} message{'' if n == 1 else 's'}"


def writer_warning(queue: str, side: str, waited: float, what: str,
                   laggards: list[Laggard]) -> str:
    """The writer's warning: it has ``waited`` seconds for ``what``, held up by
    ``laggards``."""
    behind = "; ".join(
        f"{lag.who} with {_messages(lag.outstanding)} "
        f"{'unacknowledged' if lag.remote else 'unread'} ({lag.state})" for lag in laggards)
    return (f"queue {queue!r}: the {side} has waited {waited:.1f} s for {what}; "
            f"reader(s) behind: {behind}")


def reader_warning(queue: str, side: str, waited: float, seq: int, writer: str,
                   writer_state: str, last: LastMessage) -> str:
    """A reader's warning: it has ``waited`` seconds for message ``seq`` from
    ``writer``, whose process is in ``writer_state`` (:meth:`PeerWatch.state`)."""
    if last.kind == "none":
        since = f"no message yet since it connected {last.seconds:.1f} s ago"
    elif last.kind == "arrived":
        since = f"its last message (#{seq - 1}) arrived {last.seconds:.1f} s ago"
    else:
        since = (f"its last message (#{seq - 1}) arrived before this wait began, at least "
                 f"{last.seconds:.1f} s ago")
    return (f"queue {queue!r}: {side} has waited {waited:.1f} s for message #{seq} from the "
            f"{writer}, which is {WRITER_STATE[writer_state]}; {since}")
