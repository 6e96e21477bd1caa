"""Whether a peer process still lives: pid plus start time, zombies, pid spaces.

Every queue side watches the process it waits for (the writer its lagging
readers, a reader its writer) and declares it dead only on evidence: the
process is gone (same host: pid *and* start time, so a reused pid is not the
peer), or the OS closed or reset its connection (checked by the sides
themselves, see :mod:`shm_broadcast.queue.transport`).

A pause is not a death. A peer stopped by ``SIGSTOP``, job control, a
debugger, swapping or a long GC pause is alive: :class:`PeerWatch` reports it
alive (and :meth:`PeerWatch.state` says ``"stopped"``), so its peers keep
waiting and raise ``QueueTimeout`` when their timeout runs out, never
``PeerDiedError``.

A pid can be checked only from the pid space it lives in
(:func:`own_pid_space`: the same running kernel and pid namespace);
hostnames cannot tell, so a peer in another pid space is always alive here.
"""

from __future__ import annotations

import os
import socket

import psutil

__all__ = ["PeerWatch", "own_pid_space", "state_text"]

_PID_SPACE: tuple[int, str] | None = None  # (pid it was read in, value)


def own_pid_space() -> str:
    """Where this process's pid means something: ``"<boot id>/<pid namespace inode>"``.

    Two processes can check each other's pids exactly when these are equal
    (same running kernel, same pid namespace). ``""`` when it cannot be read
    (no ``/proc`` of our own). Read once per process (a fork re-reads it).
    """
    global _PID_SPACE
    pid = os.getpid()
    if _PID_SPACE is None or _PID_SPACE[0] != pid:
        from shm_broadcast.lifecycle.owner_identity import OwnerIdentity

        me = OwnerIdentity.of_self()
        _PID_SPACE = (pid, f"{me.boot_id}/{me.pidns}" if me.boot_id and me.pidns else "")
    return _PID_SPACE[1]


class PeerWatch:
    """Tells whether a peer process (pid + creation time) is still alive.

    A pid alone is not an identity: it can be reused after the process exits.
    We also compare the creation time recorded when the peer registered, and
    treat zombies (exited, not yet reaped by their parent) as dead.

    Args:
        pid: The peer's process id.
        create_time: ``psutil.Process(pid).create_time()`` as the peer reported
            it, or ``None`` to skip the reuse check.
        host: Hostname of the peer, for messages (and the fallback below).
        pid_space: The peer's :func:`own_pid_space`. Its pid is checked with
            psutil only when that equals ours: hostnames cannot tell, since
            hosts may share a name while their pids live in different pid
            spaces (and containers on one kernel have pid spaces of their
            own). Without it (``""``), a peer whose ``host`` differs from ours
            is taken as remote. A remote peer is always reported alive.
    """

    def __init__(self, pid: int, create_time: float | None, host: str | None = None,
                 *, pid_space: str = "") -> None:
        self.pid = pid
        self.create_time = create_time
        self.host = host
        mine = own_pid_space() if pid_space else ""
        if pid_space and mine:
            self._remote = pid_space != mine
        else:
            self._remote = host is not None and host != socket.gethostname()
        self._proc: psutil.Process | None = None

    def alive(self) -> bool:
        """Return whether the peer process exists and is not a zombie."""
        if self._remote or self.pid <= 0:
            return True
        try:
            if self._proc is None:
                self._proc = psutil.Process(self.pid)
                if self.create_time is not None and abs(
                    self._proc.create_time() - self.create_time
                ) > 0.05:
                    return False  # the pid was reused by another process
            running: bool = (self._proc.is_running()
                             and self._proc.status() != psutil.STATUS_ZOMBIE)
            return running
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            return False

    def state(self) -> str:
        """What can be told about the peer process, for error messages.

        Returns:
            ``"exited"`` (gone or a zombie), ``"stopped"`` (alive but paused:
            ``SIGSTOP``, job control, a debugger), ``"running"`` (alive: on a
            CPU, runnable or sleeping in a wait) or ``"unknown"`` (on another
            host, where no check is possible).
        """
        if self._remote or self.pid <= 0:
            return "unknown"
        if not self.alive():
            return "exited"
        proc = self._proc  # set by alive() for a peer on this host
        if proc is None:
            return "unknown"
        try:
            status = proc.status()
        except (psutil.NoSuchProcess, ProcessLookupError):
            return "exited"
        except psutil.Error:
            return "unknown"
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return "stopped"
        return "running"

    def describe(self) -> str:
        """Return ``pid N`` or ``pid N on HOST`` for error messages."""
        if self._remote:
            return f"pid {self.pid} on {self.host}"
        return f"pid {self.pid}"


def state_text(watch: PeerWatch | None) -> str:
    """A peer's process state for a timeout message (``watch`` None: not identified)."""
    if watch is None:
        return "process not identified"
    state = watch.state()
    if state == "stopped":
        return f"{watch.describe()} is stopped (SIGSTOP, job control or a debugger)"
    if state == "unknown":
        return f"{watch.describe()}, not checkable from here"
    return f"{watch.describe()} is {state}"
