"""One collective at a time per communicator: another thread's call is refused.

The shared-memory engine keeps one step counter and one slot per rank, so two
threads of one rank in collectives at once would take each other's steps and
mix their data, and every rank would return a wrong result. :class:`OneCall`
is the communicator's token for "a collective is running": a thread takes it
without waiting, and a second thread that finds it taken gets
:class:`~device_comms.errors.ConcurrentCallError` before touching anything,
while the call in flight goes on unharmed. Waiting for the token instead is
no cure: ranks would still pair their threads' calls in whatever order each
rank happened to run them.

The token is reentrant (a collective may run its own nested steps), and
point-to-point calls do not take it: the coordinator runs sends and receives
on worker threads while collectives run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NoReturn

from device_comms.errors import ConcurrentCallError

__all__ = ["OneCall"]


class OneCall:
    """The token of a communicator's one collective at a time.

    A call takes it with :meth:`enter`, or, on a hot path, with
    ``if not token.take(False): token.refuse(op)``, which is the same without
    a Python frame: :attr:`take` and :attr:`leave` are the lock's own methods.

    Args:
        who: Names the communicator in errors, e.g. ``"group 'tp' (rank 1/4)"``;
            a string, so that the token holds no reference to its owner.

    Attributes:
        take: ``take(False)`` takes the token without waiting and returns
            whether this thread holds it now (a thread holding it takes it
            again: the token is reentrant).
        leave: Gives the token back; called by the thread that took it, once
            per take.
    """

    __slots__ = ("_lock", "_who", "leave", "take")

    def __init__(self, who: str) -> None:
        self._lock = threading.RLock()
        self._who = who
        self.take: Callable[[bool], bool] = self._lock.acquire
        self.leave: Callable[[], None] = self._lock.release

    def enter(self, op: str) -> None:
        """Take the token for collective ``op``; :attr:`leave` after the call.

        Raises:
            ConcurrentCallError: Another thread holds it.
        """
        if not self._lock.acquire(False):
            self.refuse(op)

    def refuse(self, op: str) -> NoReturn:
        """Raise the error of collective ``op`` finding the token taken by another thread.

        Raises:
            ConcurrentCallError: Always.
        """
        raise ConcurrentCallError(
            f"{self._who}: {op} was called on thread "
            f"{threading.current_thread().name!r} while another thread is in a "
            f"collective of this communicator; a communicator runs one collective at a "
            f"time: call its collectives from one thread (or give each thread its own group)"
        )

    def wait_idle(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until no other thread holds the token.

        Returns:
            Whether none does (the calling thread's own holding counts as idle).
        """
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            return False
        self._lock.release()
        return True
