"""The state of another process, read without races: stopped, running.

``os.kill(pid, SIGSTOP)`` returns once the signal is queued; each thread of the
target stops the next time the kernel checks its signals, and a thread running
on another core can still serve a request in between. A test that then expects
the process to be silent must wait until the kernel shows every thread stopped.
A process can also end between any two questions about it, so each question
here is asked once and a process that is gone answers for itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil


def _thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``/proc/<pid>/task/*/stat``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), \
                open(f"/proc/{pid}/task/{tid}/stat") as f:  # a thread that just ended: skipped
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return states


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    Raises:
        AssertionError: Some thread was not stopped within ``timeout`` seconds.
    """
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while True:
        states = _thread_states(pid)
        if states and all(s in ("T", "t") for s in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} did not stop within {timeout} s "
                                 f"(thread states {states})")
        time.sleep(0.005)


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
