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

from device_comms.errors import ConcurrentCallError

__all__ = ["OneCall"]


class OneCall:
    """The token of a communicator's one collective at a time.

    Args:
        who: Names the communicator in errors, e.g. ``"group 'tp' (rank 1/4)"``;
            a string, so that the token holds no reference to its owner.
    """

    __slots__ = ("_lock", "_who")

    def __init__(self, who: str) -> None:
        self._lock = threading.RLock()
        self._who = who

    def enter(self, op: str) -> None:
        """Take the token for collective ``op``; :meth:`leave` after the call.

        Raises:
            ConcurrentCallError: Another thread holds it.
        """
        if not self._lock.acquire(False):
            raise ConcurrentCallError(
                f"{self._who}: {op} was called on thread "
                f"{threading.current_thread().name!r} while another thread is in a "
                f"collective of this communicator; a communicator runs one collective at a "
                f"time: call its collectives from one thread (or give each thread its own group)"
            )

    def leave(self) -> None:
        """Give the token back (the thread that took it)."""
        self._lock.release()

    def wait_idle(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, until no other thread holds the token.

        Returns:
            Whether none does (the calling thread's own holding counts as idle).
        """
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            return False
        self._lock.release()
        return True
