"""The watchdog of device calls: a call whose device work does not complete in time
is dumped, the ranks behind are named, and the communicator is aborted.

A call on a CUDA device returns once its work is enqueued; if a peer never
joins, the work never completes and whoever waits for it (a stream
synchronisation, ``tensor.item()``) waits forever: no timeout of the host
side covers it. One thread per process (started with the first watched
group, stopped and joined when the last one goes) looks at every watched
group's device calls a few times per group timeout (every tenth of the
shortest timeout, between 0.05 s and 0.5 s).

**Which groups.** A group of two or more ranks whose communicator reports
marks of its calls (``provides_device_marks``, e.g. a stand-in of a device),
or whose device is a CUDA device (the group marks its calls with CUDA events,
:mod:`coordinator.trace.cuda_marks`). CPU transports are not watched: their
calls wait on the host, bounded by the group's timeout. The group calls
:meth:`MarkLog.__call__` after numbering each device call and before
issuing it, and the marks' ``finish()`` once the call returned or raised; the
marks then say when the work started and completed, read lazily; they
complete once the work ended, however it ended (a failed call's too).

**States of a device call** (its marks, as the watchdog sees them)::

    scheduled --start seen--> started --end seen--> completed
        |                        |
        +------------------------+-- older than the group's timeout,
                                 |   not completed: stuck
                                 v
                               stuck --dump, name the ranks behind--> (log)
                                 |
                                 +--abort (default)--> aborted

*stuck* is decided on the oldest call not known complete (calls of a group
complete in issue order: one stream), counted from when the call was
issued. A stuck call is dumped once: the flight recorder goes to
``<GROUPCOORD_TRACE_DUMP><rank>`` (:func:`coordinator.trace.dump.write_dump`),
the message names the call, the ranks behind and what each published
(:mod:`coordinator.trace.progress`), and it is logged. Then, unless
``GROUPCOORD_WATCHDOG_ABORT=0``, the communicator is *aborted* with that
message as a :class:`~coordinator.errors.CommTimeout`
(:meth:`~device_comms.base.DeviceCommunicator.abort`; NCCL: ``ncclCommAbort``):
a call blocked inside it raises that ``CommTimeout``, every later call of the
group on it raises :class:`~device_comms.errors.BrokenCommunicator` saying
why, and the group is no longer watched. Without the abort the call stays
stuck (and may still complete); it is not reported again.

**The ranks behind.** Each rank publishes, per watched group, the last
collective it issued and the last it knows completed, where its peers can
read it (:mod:`coordinator.trace.progress`). For a stuck collective ``#n``,
the ranks whose last issued collective is below ``n`` have not reached it
and are named (``peers`` of the error); if none is below, every rank issued
it and the ones that have not completed it are named; ranks that published
nothing are named as unknown.

**Why an abort from this thread is safe** (who calls what, from which thread):

* the call's thread makes the marks (:meth:`MarkLog.__call__` appends to a
  deque: atomic) and calls ``finish()``; it issues every call of the
  communicator;
* the watchdog's thread is the only one that removes marks from the deque
  (``popleft``, atomic) and the only one that publishes and reads progress
  (on its own store connection); it queries events (never synchronises), and
  writes dumps, which read the recorder's ring (lists replaced or stored into
  one item at a time under the GIL);
* ``abort(error)`` stores two attributes of the communicator (atomic under
  the GIL), after which its calls refuse to start, then runs the transport's
  hook: the NCCL communicator takes its launch lock before it frees the
  handle (:mod:`device_comms.cuda.pynccl.communicator`, "Aborting"), so no
  launch uses a freed communicator; a call blocked in the communicator fails
  and raises the abort's error;
* the group's ``destroy`` closes its :class:`GroupWatch` first, which waits
  for a check of that group in progress (each group's checks hold its
  watch's lock) and makes later ticks skip it: no abort runs during or after
  the communicator's own destroy;
* the watchdog makes no call that blocks without a bound: store waits end
  after :data:`~coordinator.trace.progress.STORE_TIMEOUT_S`; an abort waits
  at most a second for a launch in progress on another thread, then at most
  ten seconds for NCCL to release the communicator (an abort that does not
  finish in time is logged and the group counts as aborted all the same: its
  communicator refuses every call from the start of the abort); the thread
  is joined with a bound.

**Removed groups' progress keys.** :meth:`Watchdog.remove` queues the key of
the group it removes (a deque: ``append`` and ``popleft`` are atomic); the
thread deletes the queued keys from the store at each tick, and once more
when it stops, so a key queued while it stopped is not left behind. Two
threads may drain the queue at once (one stopping, its successor started):
each ``popleft`` hands a key to one of them, an empty queue ends the drain.
Without a store nothing is published and the queue is cleared.

Configuration (read and checked first thing when a group is created,
:func:`settings_from_env`): ``GROUPCOORD_WATCHDOG=0`` watches nothing (CUDA
calls are still marked for the recorder while it is on);
``GROUPCOORD_WATCHDOG_ABORT=0`` dumps and logs without aborting.

The CPU tests drive the thread through a stand-in device communicator whose
completion they control. On a GPU (``tests/gpu/test_watchdog_cuda.py``, run on
one H200) two processes sharing the device hold a custom all-reduce that one
of them never joins: the watchdog dumps it, names that rank and aborts the
communicator, or with the abort off logs it once and the late call
completes; ``ncclCommAbort`` from another thread ran at world size 1 only
(NCCL refuses two ranks on one GPU), so an abort of NCCL work that waits for
a peer is not verified on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable
from time import monotonic_ns
from typing import Any, NamedTuple, Protocol

import torch

from coordinator.trace import progress
from coordinator.trace.auto_dump import DUMP_ATTR
from coordinator.trace.dump import write_dump
from coordinator.trace.recorder import DEVICE, GROUP, OP, P2P_SEQ, SEQ, recorder
from device_comms.errors import add_note
from shm_broadcast.checks import env_flag
from shm_broadcast.errors import CommTimeout

__all__ = ["ENV_WATCHDOG", "ENV_ABORT", "GroupWatch", "MarkLog", "Watchdog", "WatchSettings",
           "device_marker", "settings_from_env", "watch_group", "watchdog"]

ENV_WATCHDOG = "GROUPCOORD_WATCHDOG"
ENV_ABORT = "GROUPCOORD_WATCHDOG_ABORT"
#: Device calls kept for the watchdog per group, oldest dropped first; a group
#: whose host runs this far ahead of its device is stuck on later calls too.
MAX_PENDING = 16384
_MIN_TICK_S, _MAX_TICK_S = 0.05, 0.5
_JOIN_S = 10.0  # the thread's last tick may read the store and abort NCCL

logger = logging.getLogger(__name__)


class _Marks(Protocol):
    """What the watchdog reads of a call's marks (a
    :class:`~coordinator.trace.recorder.DeviceMarks`)."""

    def completed_ns(self) -> int | None: ...


class _Counts(Protocol):
    """A group's call numbers (:class:`~coordinator.calls.call_book.CallBook`)."""

    collectives: int
    p2p_calls: int


class _Comm(Protocol):
    """What the watchdog uses of a communicator."""

    @property
    def provides_device_marks(self) -> bool: ...

    def device_marks(self) -> Any: ...

    def abort(self, error: BaseException) -> None: ...


class Pending(NamedTuple):
    """A device call not known complete."""

    seq: int  # the group's collective number
    call: int  # the group's call number (collective and point-to-point)
    created_ns: int
    marks: _Marks


class MarkLog:
    """Makes a watched group's device marks and keeps the calls not known complete.

    Call it (as the group's ``_marks``) after numbering a device call and
    before issuing it; it returns the marks of ``make()``.

    Args:
        make: Makes the marks of one call.
        counts: The group's call numbers.
    """

    __slots__ = ("_make", "_counts", "pending")

    def __init__(self, make: Callable[[], Any], counts: _Counts) -> None:
        self._make = make
        self._counts = counts
        #: Calls not known complete, oldest first (the watchdog removes them).
        self.pending: collections.deque[Pending] = collections.deque(maxlen=MAX_PENDING)

    def __call__(self) -> Any:
        marks = self._make()
        counts = self._counts
        n = counts.collectives
        self.pending.append(Pending(n, n + counts.p2p_calls, monotonic_ns(), marks))
        return marks


class GroupWatch:
    """One watched group (made by :func:`watch_group`); :meth:`close` it when the
    group goes, before its communicator.

    Attributes:
        marks: The group's :class:`MarkLog`.
    """

    def __init__(self, dog: Watchdog, name: str, ranks: list[int], rank: int,
                 timeout_s: float, comm: _Comm, pg_name: str, counts: _Counts,
                 marks: MarkLog, abort: bool) -> None:
        self.dog = dog
        self.counts = counts
        self.name, self.ranks, self.rank = name, ranks, rank
        self.timeout_ns = int(timeout_s * 1e9)
        self.timeout_s = timeout_s
        self.comm = comm
        self.marks = marks
        self.abort = abort
        self.keys = [progress.progress_key(pg_name, r) for r in range(len(ranks))]
        self.lock = threading.Lock()  # held by a check of this group, and by close()
        self.closed = False
        self.reported: Pending | None = None
        self.failed = False  # a check raised (logged once)

    def close(self) -> None:
        """Stop watching; returns after a check of this group in progress ended,
        after which the watchdog never touches the group again. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.dog.remove(self)


class Watchdog:
    """The process's watchdog thread and its groups (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields below
        self._groups: list[GroupWatch] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._gone: collections.deque[str] = collections.deque()  # keys to remove

    @property
    def running(self) -> bool:
        """Whether the thread runs (some group is watched)."""
        with self._lock:
            return self._thread is not None

    def add(self, watch: GroupWatch) -> None:
        """Watch ``watch``'s group; starts the thread with the first group."""
        with self._lock:
            self._groups.append(watch)
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                                name="groupcoord-watchdog", daemon=True)
                self._thread.start()

    def remove(self, watch: GroupWatch) -> None:
        """Stop watching ``watch``'s group; with the last group, stop the thread and
        join it (at most ``_JOIN_S``; not when called from the thread itself)."""
        with self._lock:
            if watch in self._groups:
                self._groups.remove(watch)
            self._gone.append(watch.keys[watch.rank])
            if self._groups or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not threading.current_thread():
            thread.join(_JOIN_S)
            if thread.is_alive():
                logger.warning("the groupcoord watchdog thread did not stop within %gs", _JOIN_S)

    # ------------------------------------------------------------------ the thread
    def _run(self, stop: threading.Event) -> None:
        board: progress.ProgressBoard | None = None
        board_tried = False
        failed = False  # a tick raised (logged once)
        while True:
            tick = _MAX_TICK_S
            try:
                if not board_tried:
                    board_tried = True
                    board = progress.ProgressBoard.of_default_store()
                self._forget_gone(board)
                if stop.is_set():
                    self._forget_gone(board)  # keys queued while it stopped
                    return
                tick = self._check_groups(board)
            except Exception:  # the thread goes on: later ticks may work again
                if not failed:
                    failed = True
                    logger.exception("groupcoord watchdog: a tick failed")
            stop.wait(min(_MAX_TICK_S, max(_MIN_TICK_S, tick)))

    def _check_groups(self, board: progress.ProgressBoard | None) -> float:
        """Check every watched group once; returns the next tick's length (a tenth
        of the shortest timeout). The groups are listed only for this call, so a
        group closed meanwhile (and its communicator) is not kept until the next
        tick."""
        with self._lock:
            groups = list(self._groups)
        for watch in groups:
            try:
                self._check(watch, board)
            except Exception:  # a bug or a broken device: say so once, watch the rest
                if not watch.failed:
                    watch.failed = True
                    logger.exception("groupcoord watchdog: checking group %r failed",
                                     watch.name)
        return min((w.timeout_s for w in groups), default=_MAX_TICK_S * 10) / 10

    def _forget_gone(self, board: progress.ProgressBoard | None) -> None:
        """Delete the queued keys of removed groups from the store (see the module
        docstring); without a store, drop them."""
        gone = self._gone
        if board is None:
            gone.clear()
            return
        while True:
            try:
                key = gone.popleft()
            except IndexError:  # empty, or another thread took the last key
                return
            board.forget(key)

    def _check(self, watch: GroupWatch, board: progress.ProgressBoard | None) -> None:
        with watch.lock:
            if watch.closed:
                return
            oldest = _settle(watch.marks.pending)
            issued = watch.counts.collectives
            if board is not None:
                done = issued if oldest is None else oldest.seq - 1
                board.publish(watch.keys[watch.rank], issued, done)
            if oldest is None or oldest is watch.reported:
                return
            if monotonic_ns() - oldest.created_ns <= watch.timeout_ns:
                return
            watch.reported = oldest
            aborted = self._fire(watch, oldest, board)
        if aborted:
            with self._lock:
                if watch in self._groups:
                    self._groups.remove(watch)

    def _fire(self, watch: GroupWatch, stuck: Pending, board: progress.ProgressBoard | None
              ) -> bool:
        """Dump, log and (unless configured otherwise) abort; returns whether it aborted."""
        known: list[tuple[int, int] | None] = [None] * len(watch.keys)
        if board is not None:
            known = board.read(watch.keys)
        suspects, why = _behind(stuck.seq, watch.rank, known)
        op = _op_of(watch.name, stuck)
        waited = (monotonic_ns() - stuck.created_ns) / 1e9
        what = "" if op is None else f"op {op}, "
        message = (f"group {watch.name!r} (rank {watch.rank} of {len(watch.ranks)}), {what}"
                   f"call #{stuck.call}: its device work (collective #{stuck.seq}) did not "
                   f"complete within the group's timeout of {watch.timeout_s:g}s (issued "
                   f"{waited:.1f}s ago); {why}")
        path = ""
        try:
            path = write_dump(reason=f"watchdog: {message}")
            message += f"; flight recorder dumped to {path}"
        except Exception as e:  # the dump is best effort: the abort matters more
            message += f"; the flight recorder dump failed ({type(e).__name__}: {e})"
        if watch.abort:
            message += "; the communicator is aborted: destroy the group and create it again"
        err = CommTimeout(message, queue=watch.name, side=f"rank {watch.rank}", peers=suspects)
        err.call = stuck.call  # type: ignore[attr-defined]  # read by the group's explanation
        err.op = op  # type: ignore[attr-defined]
        setattr(err, DUMP_ATTR, path)  # dumped: the call that raises it (a copy) does not again
        logger.error("groupcoord watchdog: %s", message)
        if not watch.abort:
            return False
        try:
            watch.comm.abort(err)
        except Exception as e:  # NCCL did not release the communicator in time
            note = (f"the abort did not finish ({type(e).__name__}: {e}); the communicator "
                    f"refuses every call all the same")
            add_note(err, note)
            logger.error("groupcoord watchdog: group %r: %s", watch.name, note)
        return True


def _settle(pending: collections.deque[Pending]) -> Pending | None:
    """Drop the calls known complete from the front of ``pending``; the oldest
    left (None: none). Calls complete in issue order, so the first one not
    complete is found by bisection (a few event queries however many calls)."""
    n = len(pending)
    if n == 0:
        return None
    if pending[n - 1].marks.completed_ns() is not None:
        lo = n
    else:
        lo, hi = 0, n - 1  # pending[hi] is not complete
        while lo < hi:
            mid = (lo + hi) // 2
            if pending[mid].marks.completed_ns() is not None:
                lo = mid + 1
            else:
                hi = mid
    for _ in range(lo):
        pending.popleft()
    return pending[0] if pending else None


def _behind(seq: int, me: int, known: list[tuple[int, int] | None]
            ) -> tuple[list[int], str]:
    """The ranks to name for stuck collective ``seq`` and why (see the module docstring)."""
    others = [r for r in range(len(known)) if r != me]

    def said(r: int) -> str:
        p = known[r]
        return f"rank {r}: unknown" if p is None else f"rank {r}: issued #{p[0]}, done #{p[1]}"

    listing = "; ".join(said(r) for r in others)
    behind = [r for r in others if (p := known[r]) is not None and p[0] < seq]
    unknown = [r for r in others if known[r] is None]
    if behind:
        return behind, (f"rank(s) {behind} have not reached collective #{seq} (what each "
                        f"rank published: {listing})")
    if unknown:
        return unknown, (f"rank(s) {unknown} published no progress, the others issued "
                         f"collective #{seq} ({listing})")
    late = [r for r in others if (p := known[r]) is not None and p[1] < seq]
    return late or others, (f"every rank issued collective #{seq}; not completed on rank(s) "
                            f"{late or others} ({listing})")


def _op_of(name: str, stuck: Pending) -> str | None:
    """The op of the recorder's entry for ``stuck`` (None where the recorder has none)."""
    with contextlib.suppress(Exception):
        for e in reversed(recorder().entries()):
            if e[DEVICE] is stuck.marks or (e[GROUP].name == name and e[SEQ] == stuck.seq
                                            and e[SEQ] + e[P2P_SEQ] == stuck.call):
                return str(e[OP])
    return None


_WATCHDOG = Watchdog()


def watchdog() -> Watchdog:
    """The process's watchdog."""
    return _WATCHDOG


class WatchSettings(NamedTuple):
    """The watchdog's configuration (:func:`settings_from_env`)."""

    watch: bool  # GROUPCOORD_WATCHDOG
    abort: bool  # GROUPCOORD_WATCHDOG_ABORT


def settings_from_env() -> WatchSettings:
    """``GROUPCOORD_WATCHDOG`` and ``GROUPCOORD_WATCHDOG_ABORT`` (default: both on).

    Raises:
        ValueError: Either is neither 0 nor 1 (naming it).
    """
    return WatchSettings(_flag(ENV_WATCHDOG), _flag(ENV_ABORT))


def device_marker(comm: _Comm, device: torch.device,
                  count_replays: bool = True) -> Callable[[], Any] | None:
    """What marks a group's device calls: the communicator's own marks when it
    provides them, CUDA-event marks on a CUDA device, else None (host calls).

    Args:
        count_replays: Count the graph replays of captured CUDA calls (a device
            counter; only the recorder's dumps read it, never the watchdog).
    """
    if comm.provides_device_marks:
        return comm.device_marks
    if device.type == "cuda":
        from coordinator.trace.cuda_marks import CudaMarker

        return CudaMarker(device, count_replays=count_replays)
    return None


def watch_group(name: str, ranks: list[int], rank: int, timeout_s: float, comm: _Comm,
                cpu_group: Any, counts: _Counts, marker: Callable[[], Any],
                settings: WatchSettings | None = None) -> GroupWatch | None:
    """Watch a group's device calls marked by ``marker`` (see the module docstring).

    Args:
        name: The group's unique name.
        ranks: Its members' global ranks.
        rank: This process's group rank.
        timeout_s: The group's timeout.
        comm: Its device communicator (aborted when a call is stuck).
        cpu_group: Its CPU process group (torch's name of it keys the progress).
        counts: Its call numbers.
        marker: Makes the marks of one call (:func:`device_marker`).
        settings: The configuration; None: :func:`settings_from_env` now (a
            group reads it before it makes anything, so that a bad value leaves
            nothing behind).

    Returns:
        The watch, whose ``marks`` the group calls before each device call and
        which it closes when it goes; None with ``GROUPCOORD_WATCHDOG=0``.

    Raises:
        ValueError: ``settings`` is None and ``GROUPCOORD_WATCHDOG`` or
            ``GROUPCOORD_WATCHDOG_ABORT`` is neither 0 nor 1.
    """
    if settings is None:
        settings = settings_from_env()
    if not settings.watch:
        return None
    pg_name = progress.group_name(cpu_group)
    watch = GroupWatch(_WATCHDOG, name, list(ranks), rank, timeout_s, comm, pg_name, counts,
                       MarkLog(marker, counts), settings.abort)
    _WATCHDOG.add(watch)
    return watch


def _flag(var: str) -> bool:
    return env_flag(var, True)
