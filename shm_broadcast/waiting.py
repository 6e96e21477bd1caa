"""How a blocked queue side waits: spin, then yield, then park; never forever.

A side that finds nothing to do (a reader with no new message, a writer with a
full ring) waits in three phases, driven by :class:`Backoff`::

      start
        |
        v
    +--------+  spin_s elapsed   +---------+  yield_s elapsed   +----------+
    |  SPIN  | ----------------> |  YIELD  | -----------------> |   PARK   |
    | (poll  |                   | (poll + |                    | (poll(2) |
    |  flag) |                   |  sched_ |                    | doorbell,|
    +--------+                   |  yield) |                    | <= park_ |
        |                        +---------+                    | poll_s)  |
        |                            |                          +----------+
        |  condition true            |                              |
        +----------------------------+------------------------------+--> done

* **SPIN** re-reads the shared flag in a tight loop for ``spin_s`` (default
  5 us): a peer answering on another core is seen within a microsecond or so.
  Longer spins measured *worse* on the oversubscribed 2-core development
  machine (4 KB round trip p50 ~50 us with 0-5 us, ~100 us with 20 us, ~400 us
  with 200 us): spinning burns the time slice the peer may be waiting for.
* **YIELD** keeps polling but calls ``sched_yield()`` between polls, so an
  oversubscribed machine gives the core to whoever needs it (with nothing else
  runnable the call returns at once: polling continues at ~1 us granularity).
  It lasts ``yield_s`` (default 2 ms): back-to-back messages never leave this
  phase, while a reader waiting for the next engine step (tens of ms) parks
  instead of burning a core -- the 100%-CPU readers of polling-only queues are
  exactly what this avoids. Raise it if you prefer CPU to wake-up latency.
* **PARK** declares itself parked in shared memory and blocks in ``poll(2)``
  on its doorbell (:mod:`shm_broadcast.doorbell`), which the peer rings only
  when it sees the parked flag; an idle side costs ~0% CPU and wakes with a
  single kernel wake-up. That wake-up has a platform floor the queue cannot
  beat: ``groupcoord bench mq`` measures it in the same run (a bare process
  sleeping in ``poll(2)``; 160-240 us p50 on the 2-vCPU development VM, where
  the queue measured 1.5-1.8x that). Engines that cannot afford it between
  steps raise ``yield_s`` to cover their step time, trading CPU for latency.

Whatever the phase, :meth:`Backoff.step` runs the checks every ``liveness_s``
(default 0.2 s) and at the deadline: the caller's timeout
(:class:`~shm_broadcast.errors.QueueTimeout`), a ``shutdown()``
(:class:`~shm_broadcast.errors.QueueClosedError`) and whether the peer process
still lives (:class:`PeerWatch`, :class:`~shm_broadcast.errors.PeerDiedError`).
That is why no wait can hang silently: without a timeout, a dead peer is
noticed within ``liveness_s`` plus one park poll.

A pause is not a death. A peer stopped by ``SIGSTOP``, job control, a
debugger, swapping or a long GC pause is alive: :class:`PeerWatch` reports it
alive (and :meth:`PeerWatch.state` says ``"stopped"``), so its peers keep
waiting and raise ``QueueTimeout`` when their timeout runs out, never
``PeerDiedError``. Death is declared only on evidence: the process is gone
(same host: pid *and* start time), or the OS closed or reset its connection.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

import psutil

__all__ = ["WaitPolicy", "Backoff", "PeerWatch", "own_pid_space", "SPIN", "YIELD", "PARK"]

SPIN = 0
YIELD = 1
PARK = 2

_monotonic = time.monotonic
_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


@dataclass(frozen=True)
class WaitPolicy:
    """Timing knobs of the spin -> yield -> park waiting strategy.

    Attributes:
        spin_s: Seconds of pure busy polling before yielding (the spin window).
            Keep it short: it burns a core. 0 disables spinning.
        yield_s: Further seconds of polling with ``sched_yield()`` in between
            before parking. A reader that waits longer parks.
        park_poll_s: Upper bound of one parked ``zmq.poll``; the side re-checks
            the flag, its deadline and the peer's liveness after each.
        liveness_s: How often (seconds) a waiting side checks that its peer
            process is alive.
    """

    spin_s: float = 5e-6
    yield_s: float = 0.002
    park_poll_s: float = 0.1
    liveness_s: float = 0.2

    def __post_init__(self) -> None:
        for field in ("spin_s", "yield_s", "park_poll_s", "liveness_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"WaitPolicy.{field} must be a number >= 0 (seconds), got {value!r}")
        if self.park_poll_s <= 0 or self.liveness_s <= 0:
            raise ValueError(
                "WaitPolicy.park_poll_s and liveness_s must be > 0, got "
                f"{self.park_poll_s!r} and {self.liveness_s!r}"
            )


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
        from shm_broadcast.owner_identity import OwnerIdentity

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
            return self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
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
        try:
            status = self._proc.status()  # type: ignore[union-attr]  # set by alive()
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


class Backoff:
    """One wait: phases by elapsed time plus periodic checks.

    Usage (the condition itself is checked by the caller, inline, for speed)::

        b.start(deadline)
        while not ready():
            if b.step() == PARK:
                park()

    Args:
        policy: The timing knobs.
        check: Called at most every ``policy.liveness_s`` seconds and at the
            deadline with ``expired`` telling whether the deadline has passed;
            it raises to end the wait (timeout, dead peer, shutdown).
    """

    __slots__ = ("_policy", "_check", "_deadline", "_spin_until", "_yield_until", "_next_check")

    def __init__(self, policy: WaitPolicy, check: Callable[[bool], None]) -> None:
        self._policy = policy
        self._check = check
        self._deadline: float | None = None
        self._spin_until = 0.0
        self._yield_until = 0.0
        self._next_check = 0.0

    def start(self, deadline: float | None) -> None:
        """Begin a new wait that ends at ``deadline`` (monotonic) or never."""
        now = _monotonic()
        p = self._policy
        self._deadline = deadline
        self._spin_until = now + p.spin_s
        self._yield_until = self._spin_until + p.yield_s
        nxt = now + p.liveness_s
        self._next_check = nxt if deadline is None or deadline > nxt else deadline

    def step(self) -> int:
        """Advance the wait by one poll; returns the phase to wait in.

        Returns:
            :data:`SPIN` (poll again now), :data:`YIELD` (after having yielded
            the CPU once) or :data:`PARK` (the caller should block on its
            doorbell for :meth:`park_timeout` seconds).
        """
        now = _monotonic()
        if now >= self._next_check:
            self._run_check(now)
        if now < self._spin_until:
            return SPIN
        if now < self._yield_until:
            _sched_yield()
            return YIELD
        return PARK

    def rearm(self) -> None:
        """Restart the spin and yield phases (keeping deadline and checks).

        Called after a doorbell woke a parked side: the bell announces a
        message that may still be in the making, so poll actively again.
        """
        now = _monotonic()
        self._spin_until = now + self._policy.spin_s
        self._yield_until = self._spin_until + self._policy.yield_s

    def park_timeout(self) -> float:
        """Seconds the caller may block while parked before calling :meth:`step` again."""
        now = _monotonic()
        t = min(self._policy.park_poll_s, self._next_check - now)
        return t if t > 0 else 0.0

    def check_now(self) -> None:
        """Run the checks immediately (used right after a park)."""
        self._run_check(_monotonic())

    def _run_check(self, now: float) -> None:
        deadline = self._deadline
        expired = deadline is not None and now >= deadline
        self._check(expired)
        nxt = now + self._policy.liveness_s
        self._next_check = nxt if deadline is None or deadline > nxt or expired else deadline
