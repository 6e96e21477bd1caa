"""Native calls given up on: waited for, briefly, when the interpreter exits.

A thread inside a C++ call of torch (a TCPStore request, its client's
constructor) has released the GIL. If that call returns while the
interpreter is being finalised, the thread cannot take the GIL back: CPython
ends it with ``pthread_exit``, whose unwinding through the C++ frames hits a
``noexcept`` destructor and aborts the whole process ("terminate called
without an active exception", SIGABRT), after the program meant to exit
cleanly.

The callers here never block on such a call past their limit: they run it on
a daemon thread and give up on it. What they give up on is registered with
:func:`wait_at_exit`, and an ``atexit`` handler waits, for at most
:data:`EXIT_GRACE_S` in all, until each has returned, so that a call whose
peer answers late returns before finalisation rather than during it. A call
that is still stuck after the grace stays stuck through the exit (its thread
dies with the process, which is harmless); only an answer arriving in the
moments between the grace and the end of the process can still abort it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["wait_at_exit", "EXIT_GRACE_S"]

#: The longest the exit waits for the calls given up on, all together (a live
#: peer answers in milliseconds; a stopped one may never).
EXIT_GRACE_S = 2.0

_PENDING: list[threading.Event] = []
_LOCK = threading.Lock()
_REGISTERED = False


def _forget_in_child() -> None:
    # The threads behind the events did not survive the fork: nothing to wait for.
    global _LOCK
    _LOCK = threading.Lock()
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def wait_at_exit(done: threading.Event) -> None:
    """Have the interpreter's exit wait (up to :data:`EXIT_GRACE_S`) until ``done`` is set.

    Args:
        done: Set by the thread once its native call has returned.
    """
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            atexit.register(_wait_for_pending)
            _REGISTERED = True
        _PENDING[:] = [e for e in _PENDING if not e.is_set()]  # keep the list short
        _PENDING.append(done)


def _wait_for_pending() -> None:
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    deadline = time.monotonic() + EXIT_GRACE_S
    for done in pending:
        # One shared grace: the calls wait in parallel, each on its own peer.
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return
