"""A fatal signal is acted on even while the main thread is stuck in a C call.

CPython runs a Python-level signal handler only in the main thread, between
bytecodes. When the signal lands on another thread (any thread that does not
block it may take a process-directed signal) while the main thread waits in
one long C call (``time.sleep``, a gloo wait, a blocking read that retries on
``EINTR``), the handler does not run until that call returns: a process whose
``SIGTERM`` handler is :mod:`shm_broadcast.exit_cleanup`'s would then carry on
instead of dying. CPython's C-level handler does one thing in every thread,
though: it writes the signal number to the *wakeup fd*
(:func:`signal.set_wakeup_fd`). :class:`SignalWatch` owns that fd (a pipe)
and a daemon thread blocked on reading it, which calls ``act(signum)`` for
each signal number it reads, at once, whatever the main thread is doing.

What holds:

* Only one wakeup fd exists per process. The watch takes it only when none is
  set (asyncio's event loop, for one, sets its own); otherwise it stays off
  and the main-thread handler alone acts, as before. Whoever sets one later
  replaces ours silently; the watch then idles.
* The pipe's ends are close-on-exec, and a forked child drops the watch
  (:meth:`SignalWatch.after_fork_in_child` clears the inherited wakeup fd,
  which still points at the parent's pipe), so no other process's signal
  reaches ``act``.
* ``act`` runs on the watch thread, concurrently with the main thread: it
  must be thread-safe and idempotent (the main thread's handler may run too).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

__all__ = ["SignalWatch"]


class SignalWatch:
    """Calls ``act(signum)`` on a daemon thread for every signal Python handles.

    Args:
        act: Called with each signal number read from the wakeup fd.
    """

    def __init__(self, act: Callable[[int], None]) -> None:
        self._act = act
        self._fds: tuple[int, int] | None = None
        self._refused = False

    @property
    def running(self) -> bool:
        """Whether the watch owns the wakeup fd."""
        return self._fds is not None

    def start(self) -> bool:
        """Take the wakeup fd and start the thread (main thread only; idempotent).

        Returns:
            Whether the watch runs: False where another wakeup fd was set (the
            watch then stays off for good) or this is not the main thread.
        """
        if self._fds is not None:
            return True
        if self._refused or threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)  # CPython requires it: a full pipe must not block a handler
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = -2
        if old != -1:  # someone else's (or none could be set): leave theirs in place
            if old >= 0:
                signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            self._refused = True
            return False
        self._fds = (r, w)
        threading.Thread(target=self._loop, args=(r,), name="groupcoord-signal-watch",
                         daemon=True).start()
        return True

    def _loop(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                self._act(signum)

    def after_fork_in_child(self) -> None:
        """In a forked child: release the inherited wakeup fd and pipe (the thread
        did not survive the fork); a later :meth:`start` takes it afresh."""
        if self._fds is None:
            return
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = None
