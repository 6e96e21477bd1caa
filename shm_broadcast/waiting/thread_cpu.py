"""Where the calling thread runs, and moving it off a CPU it shares with a peer.

Two processes that wait for each other in turns (a queue's writer and its
reader, the ranks of a CPU collective) are fast only on different CPUs: on
one CPU each hand-over waits for a context switch, and a reader polling for
a message waits until the writer, which publishes it on the same CPU, has
finished its call and blocked. Linux does not keep them apart by itself. A
woken task goes back to its previous CPU when that CPU is idle, and a
socket's wake-up (the queue's doorbell) is synchronous, which can draw the
woken task to the waker's CPU; so two tasks that both sleep between their
exchanges come together on one CPU and stay there while other CPUs idle.
Measured on the 2-vCPU development VM, a writer and its reader of 10 ms
steps shared one CPU at 95-100% of the steps in 11 runs of 13
(docs/performance.md, "A reader that shares its writer's CPU").

:func:`move_off` moves the calling thread: it narrows the thread's affinity
to the CPUs it may run on less the given ones (the kernel migrates the
thread before the call returns) and at once restores the affinity it had,
so nothing stays pinned and the kernel may place the thread anywhere
afterwards. A move costs about 40 us (the migration, 2-vCPU VM). Should the
restore fail (a cpuset that changed between the two calls), the thread gets
every CPU its cpuset allows and a warning is logged. On Linux 6.2 and later
a thread whose affinity was ever set keeps that set when its cpuset later
grows; where CPUs are added to running processes' cpusets, set
``GROUPCOORD_CPU_SPREAD=0``.

Who moves: the CPU collectives' ranks (:mod:`device_comms.cpu_shm.placement`,
which records each rank's CPU in shared memory), and a queue reader whose
planned poll found its CPU shared (:class:`CpuHop`), when a CPU is likely
free (:func:`free_cpu_likely`). Both are off where the platform lacks
``sched_getcpu`` or thread affinity (anything but Linux), and with
``GROUPCOORD_CPU_SPREAD=0``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable, Iterable

from shm_broadcast.checks import env_flag

__all__ = ["SPREAD_ENV", "spread_enabled", "sched_getcpu", "current_cpu", "can_move",
           "move_off", "free_cpu_likely", "CpuHop", "UNDONE_WITHIN", "MAX_PAUSE"]

logger = logging.getLogger(__name__)

#: ``0`` (or ``false``/``no``/``off``) turns every move off: the collectives'
#: ranks' and the queue readers' (read when a communicator is built and when a
#: queue is made with a policy whose readers may move; another value raises
#: ``ValueError``).
SPREAD_ENV = "GROUPCOORD_CPU_SPREAD"

#: A reader's move needed again within this many waits after its pause ended
#: did not hold (the kernel put it back, or no CPU is free) ...
UNDONE_WITHIN = 4
#: ... and doubles the pause (waits that must pass before the next move), up to
#: this many waits.
MAX_PAUSE = 256


def spread_enabled() -> bool:
    """``GROUPCOORD_CPU_SPREAD`` (default on).

    Raises:
        ValueError: The variable is not a recognised on/off word.
    """
    return env_flag(SPREAD_ENV, True)


def _libc_getcpu() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu`` through ctypes, or None where it or thread
    affinity is missing."""
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    getcpu: Callable[[], int] = fn
    return getcpu


#: The C library's ``sched_getcpu()`` (0.16 us: the hot paths call it directly),
#: or None where the platform has no such call or no thread affinity.
sched_getcpu = _libc_getcpu()


def current_cpu() -> int:
    """The CPU the calling thread runs on (-1 where the platform cannot say)."""
    return int(sched_getcpu()) if sched_getcpu is not None else -1


def can_move() -> bool:
    """Whether the calling thread may run on more than one CPU and can be moved."""
    if sched_getcpu is None:
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except OSError:  # pragma: no cover - affinity unavailable
        return False


def free_cpu_likely() -> bool:
    """Whether a thread that shares its CPU with another task likely has a free
    CPU to go to: no more tasks are runnable than the thread may use CPUs.

    The kernel's count of runnable tasks (``/proc/loadavg``) includes the
    calling thread and the task it shares its CPU with, which together hold
    one CPU; so with ``n`` CPUs allowed and at most ``n`` tasks runnable, one
    is free. Tasks outside the thread's CPUs count too, so on a machine busy
    with other work this says "no" more often than it should, never "yes"
    where every CPU is busy. True where the count cannot be read.
    """
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
        return running <= len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError):
        return True


def move_off(cpus: Iterable[int]) -> bool:
    """Move the calling thread to a CPU it may run on other than ``cpus``.

    The thread's affinity is what it was when this returns (see the module
    docstring).

    Args:
        cpus: The CPUs to leave (the thread's own, and any a peer runs on).

    Returns:
        Whether the thread moved: False when ``cpus`` covers every CPU it may
        run on (nothing changed).

    Raises:
        OSError: The kernel refused the affinity call (a seccomp policy);
            callers stop moving.
    """
    allowed = os.sched_getaffinity(0)
    free = allowed.difference(cpus)
    if not free:
        return False
    try:
        os.sched_setaffinity(0, free)  # migrates this thread before returning
    finally:
        _restore(allowed)
    return True


def _restore(allowed: set[int]) -> None:
    """Give the calling thread back the CPUs ``allowed``; if the kernel refuses them
    (its cpuset changed meanwhile), every CPU the cpuset allows now.

    Raises:
        OSError: Even the cpuset's CPUs were refused.
    """
    try:
        os.sched_setaffinity(0, allowed)
    except OSError as e:
        # The kernel keeps the part of a mask its cpuset allows: all CPUs = the cpuset's.
        os.sched_setaffinity(0, range(max(os.cpu_count() or 1, max(allowed) + 1)))
        logger.warning("could not give a thread back its CPUs %s after moving it (%s); it "
                       "may now run on every CPU its cpuset allows: %s", sorted(allowed), e,
                       sorted(os.sched_getaffinity(0)))


class CpuHop:
    """A queue reader's moves off a CPU its waits found shared.

    Before each wait that sleeps, the reader says whether its waits since
    the last such call found the CPU shared (a planned poll whose
    ``sched_yield`` returned only after another task ran:
    :class:`~shm_broadcast.waiting.policy.Backoff`'s ``contended``); if so,
    the thread moves to another CPU it may run on, before the sleep and off
    the message's path. A reader whose writer published on its CPU then finds
    the next message within microseconds instead of after the writer's call.

    A move needs a CPU to go to: where more tasks are runnable than the
    thread may use CPUs (:func:`free_cpu_likely`), a shared CPU moves
    nothing. Moves are also spaced by a pause counted in those calls: for
    ``pause`` calls after a move, a shared CPU moves nothing. A move due within
    :data:`UNDONE_WITHIN` calls after the pause ended means the last one did
    not hold: the pause doubles (at least 1, at most :data:`MAX_PAUSE`); a
    move due later resets it to none. So where the kernel keeps undoing the
    moves, they soon come once per :data:`MAX_PAUSE` waits, while a writer
    and its reader that the kernel put together again after many steps are
    separated at once.

    Args:
        enabled: False turns the moves off (so does ``GROUPCOORD_CPU_SPREAD=0``).
        free_cpu: Says whether a CPU to move to is likely free now
            (:func:`free_cpu_likely` unless given).

    Attributes:
        active: Whether this reader may move.
        moves: How many times it moved.
        no_free_cpu: Moves not made because no CPU was likely free (more
            tasks runnable than CPUs: an oversubscribed machine).

    Raises:
        ValueError: ``GROUPCOORD_CPU_SPREAD`` is not an on/off word.
    """

    __slots__ = ("active", "moves", "no_free_cpu", "_free_cpu", "_since", "_pause")

    def __init__(self, enabled: bool = True,
                 free_cpu: Callable[[], bool] = free_cpu_likely) -> None:
        self.active = enabled and spread_enabled() and can_move()
        self._free_cpu = free_cpu
        self.moves = 0
        self.no_free_cpu = 0
        self._since = MAX_PAUSE + UNDONE_WITHIN + 1  # waits since the last move
        self._pause = 0  # waits that must pass after a move before the next

    def before_sleep(self, shared: bool) -> None:
        """Move if the reader's waits found its CPU shared, the pause allows and a
        CPU is likely free.

        Call it before a wait that sleeps, on the thread that waits (the CPUs
        it may run on are those of that thread).

        Args:
            shared: Whether the reader's waits since the last call found the
                CPU shared (a contended poll).
        """
        if not self.active:
            return
        since = self._since = self._since + 1
        if not shared or since <= self._pause:
            return
        if not self._free_cpu():
            self.no_free_cpu += 1
            return
        pause = self._pause
        undone = since <= pause + UNDONE_WITHIN
        self._pause = min(MAX_PAUSE, max(1, 2 * pause)) if undone else 0
        self._since = 0
        try:
            moved = move_off((current_cpu(),))
        except OSError:  # pragma: no cover - refused (a seccomp policy)
            self.active = False
            return
        if moved:
            self.moves += 1
