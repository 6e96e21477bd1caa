"""Rank processes kept across tests: one pool per layout, replaced after a failure.

A :class:`RankPool` holds the ranks of one
:class:`~coordinator.pytest_plugin.marker.Layout` (processes from
:func:`shm_broadcast.ranks.launcher.start_ranks`, each running
:func:`~coordinator.pytest_plugin.rank_process.rank_main`). :meth:`RankPool.run`
sends a test to every rank and waits for all of them at once:

* every rank reports: the results, by rank;
* a rank fails, dies, skips or xfails: the others get :data:`FAILURE_GRACE_S`
  to report, as ones that do not depend on it will; those still running then
  are stopped (most wait in a collective for the rank that left);
* the timeout passes: the ranks still running are timed out.

Before a rank still running is killed it is asked for its Python stacks
(:data:`~coordinator.pytest_plugin.rank_process.STACK_SIGNAL`), which go into its
result, with what it printed so far (its output file); so does the output of a
rank that died. Unless every rank passed (or skipped) and reset itself, every rank is
then stopped and reaped (SIGTERM, so that ranks unlink their shared memory, then
SIGKILL; :func:`~shm_broadcast.ranks.launcher.stop_ranks`), and the next test
starts a fresh pool: a failure never leaks into the next test. Stopping the
ranks also kills their process groups (what their tests started). A run or a
start that is interrupted (Ctrl-C, pytest-timeout's signal) stops its ranks
before the interruption goes on.

A :class:`PoolSet` keeps the pools of a pytest session by layout, and closes the
least recently used ones when more than :data:`MAX_IDLE_RANKS` ranks would wait.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection, wait
from typing import Any

from coordinator.pytest_plugin.marker import Layout
from coordinator.pytest_plugin.protocol import (
    DIED,
    FAILED,
    PASSED,
    SKIPPED,
    STOPPED,
    TIMED_OUT,
    XFAILED,
    RankResult,
    TestCall,
)
from coordinator.pytest_plugin.rank_call import read_output, safe_str
from coordinator.pytest_plugin.rank_process import STACK_SIGNAL, output_path, rank_main
from shm_broadcast.ranks.launcher import describe_exit, free_port, start_ranks, stop_ranks

__all__ = ["FAILURE_GRACE_S", "MAX_IDLE_RANKS", "START_TIMEOUT_S", "PoolStartError",
           "RankPool", "PoolSet"]

#: Seconds the other ranks get to report after one fails, dies, skips or xfails.
FAILURE_GRACE_S = 3.0
#: Seconds the ranks of a pool get to start and initialise their groups.
START_TIMEOUT_S = 90.0
#: Ranks kept waiting in pools of layouts not in use before the oldest pools close.
MAX_IDLE_RANKS = 8
#: Seconds a rank gets to write its stacks after being asked.
_STACK_WAIT_S = 1.0
#: Longest wait for what a stopped pool's ranks started to end after SIGKILL (seconds).
_GROUP_EXIT_S = 5.0


class PoolStartError(RuntimeError):
    """The ranks of a pool did not start; ``results`` says how each rank ended
    (empty when the processes could not be started: the message says why)."""

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message)
        self.results = results


class RankPool:
    """The rank processes of one layout.

    Args:
        layout: What the ranks start with.
        start_timeout: Seconds for the ranks to start and initialise.
    """

    def __init__(self, layout: Layout, start_timeout: float = START_TIMEOUT_S,
                 base: tuple[dict[str, str], str] | None = None) -> None:
        self.layout = layout
        self._start_timeout = start_timeout
        self._base = base
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._dump_dir: str | None = None

    @property
    def started(self) -> bool:
        """Whether the ranks are up (a fresh pool is started by :meth:`start`)."""
        return bool(self._procs)

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the live ranks."""
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> None:
        """Start the ranks unless they are up.

        Raises:
            PoolStartError: A rank failed, died or did not get ready in time, or
                the ranks could not be started at all (``results`` is then
                empty); every rank has been stopped, and the stacks directory
                removed.
        """
        if self._procs:
            return
        n, port, me = self.layout.world_size, free_port(), os.getpid()
        dump_dir = tempfile.mkdtemp(prefix="groupcoord-pytest-stacks-")
        dumps = [os.path.join(dump_dir, f"rank{r}") for r in range(n)]
        try:
            # start_ranks stops the ranks it started before it raises.
            procs, conns = start_ranks(
                rank_main, n,
                lambda r, child: (r, self.layout, port, child, me, dumps[r], self._base),
                name="groupcoord-test-rank", duplex=True)
        except BaseException as e:
            # No rank is up, so stop() will never run for this directory.
            shutil.rmtree(dump_dir, ignore_errors=True)
            if not isinstance(e, Exception):  # Ctrl-C and the like go on as they are
                raise
            raise PoolStartError(
                f"the ranks of {self.layout.describe()} could not be started: "
                f"{type(e).__name__}: {safe_str(e)}\n"
                + "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip(),
                []) from e
        self._dump_dir = dump_dir
        self._procs, self._conns = procs, conns
        results = self._collect_or_stop(self._start_timeout)
        bad = [r for r in results if r.status != PASSED]
        if bad:
            self.stop()
            raise PoolStartError(
                f"the ranks of {self.layout.describe()} did not start: "
                + "; ".join(f"rank {r.rank} {r.status} {r.summary}".strip() for r in bad),
                results)

    def run(self, call: TestCall, timeout: float) -> list[RankResult]:
        """Run ``call`` on every rank (starting them first if needed).

        Returns:
            One result per rank, by rank. Unless every rank passed or skipped and
            is fit for more, the ranks have been stopped and reaped.
        """
        self.start()
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):  # _collect reports a dead rank
                conn.send(("run", call))
        results = self._collect_or_stop(timeout)
        if not all(r.reusable and r.status in (PASSED, SKIPPED, XFAILED) for r in results):
            self.stop()
        return results

    def ask_to_stop(self) -> None:
        """Tell every rank to leave its groups and exit (:meth:`stop` reaps them)."""
        for c in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(("stop",))

    def stop(self, graceful: bool = False) -> None:
        """Stop and reap every rank (after a ``stop`` message when ``graceful``)."""
        if graceful:
            self.ask_to_stop()
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        groups = [p.pid for p in procs if p.pid is not None]  # each rank leads its own
        stop_ranks(procs, conns, wait_first=10.0 if graceful else 0.0)
        for pgid in groups:  # what the ranks' tests started and left running
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        _wait_for_groups(groups, _GROUP_EXIT_S)
        if self._dump_dir is not None:
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None

    # ------------------------------------------------------------------ internals
    def _collect_or_stop(self, timeout: float) -> list[RankResult]:
        """:meth:`_collect`; interrupted (Ctrl-C, pytest-timeout's signal), the ranks
        are stopped and reaped before the interruption goes on."""
        try:
            return self._collect(timeout, grace=FAILURE_GRACE_S)
        except BaseException:
            self.stop()
            raise

    def _collect(self, timeout: float, grace: float) -> list[RankResult]:
        """Each rank's result (``("ready",)`` counts as passed) until the timeout, or
        ``grace`` after the first rank that did not pass (failed, died, skipped,
        xfailed); the rest stopped or timed out."""
        n = self.layout.world_size
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout
        first_bad: float | None = None
        by_conn = {c: r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        eof: set[int] = set()
        while len(results) < n:
            end = deadline if first_bad is None else min(deadline, first_bad + grace)
            left = end - time.monotonic()
            if left <= 0:
                break
            pending = [r for r in range(n) if r not in results]
            ready = wait([self._conns[r] for r in pending if r not in eof]
                         + [self._procs[r].sentinel for r in pending], timeout=left)
            ready.sort(key=lambda o: 0 if o in by_conn else 1)  # results before deaths
            for obj in ready:
                r = by_conn[obj] if obj in by_conn else by_sentinel[obj]
                if r in results:
                    continue
                result = self._receive(r)
                if result is None:
                    if obj in by_conn:
                        eof.add(r)  # the sentinel reports the death
                        continue
                    self._procs[r].join(1.0)
                    result = RankResult(r, DIED, summary=describe_exit(self._procs[r].exitcode),
                                        reusable=False)
                results[r] = result
                # A rank that did not pass (a skip and an xfail included) no longer
                # takes part: ranks waiting for it in a collective would wait the
                # whole timeout, so the others get the grace period from now.
                if result.status != PASSED and first_bad is None:
                    first_bad = time.monotonic()
        missing = [r for r in range(n) if r not in results]
        if missing:
            stacks = self._stacks(missing)
            status = TIMED_OUT if first_bad is None else STOPPED
            for r in missing:
                results[r] = RankResult(r, status, traceback=stacks.get(r, ""), reusable=False)
        for r in range(n):  # what a rank that did not report printed before it stopped
            if results[r].status in (DIED, TIMED_OUT, STOPPED) and self._dump_dir is not None:
                results[r].output = read_output(
                    output_path(os.path.join(self._dump_dir, f"rank{r}")))
        return [results[r] for r in range(n)]

    def _receive(self, rank: int) -> RankResult | None:
        """``rank``'s message when one is there; None at end of file."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return None
            msg = conn.recv()
        except (EOFError, OSError):
            return None
        if isinstance(msg, RankResult):
            return msg
        return RankResult(rank, PASSED if msg == ("ready",) else FAILED,
                          summary="" if msg == ("ready",) else f"unexpected message {msg!r}")

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stacks of ``ranks`` (still running), as they write them."""
        if self._dump_dir is None:
            return {}
        paths = {r: os.path.join(self._dump_dir, f"rank{r}") for r in ranks}
        sizes = {r: _size(p) for r, p in paths.items()}
        for r in ranks:
            pid = self._procs[r].pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, STACK_SIGNAL)
        deadline = time.monotonic() + _STACK_WAIT_S
        # faulthandler writes a dump in one go, from a signal handler: a size that
        # holds still twice in a row is a whole dump.
        last = dict(sizes)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = {r: _size(p) for r, p in paths.items()}
            if all(now[r] > sizes[r] for r in ranks) and now == last:
                break
            last = now
        out = {}
        for r, p in paths.items():
            try:
                with open(p, errors="replace") as f:
                    f.seek(sizes[r])
                    out[r] = f.read()
            except OSError:
                out[r] = ""
        return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class PoolSet:
    """A session's pools, by layout."""

    def __init__(self, max_idle_ranks: int = MAX_IDLE_RANKS,
                 base: tuple[dict[str, str], str] | None = None) -> None:
        self._pools: OrderedDict[Layout, RankPool] = OrderedDict()
        self._max_idle_ranks = max_idle_ranks
        self._base = base

    def get(self, layout: Layout) -> RankPool:
        """The pool of ``layout`` (made, not started, when new); marks it most recent.

        Pools of other layouts close, oldest first, while their ranks together
        exceed the limit of idle ranks.
        """
        pool = self._pools.pop(layout, None) or RankPool(layout, base=self._base)
        self._pools[layout] = pool
        idle = [p for p in self._pools.values() if p is not pool and p.started]
        waiting = sum(p.layout.world_size for p in idle)
        for old in idle:
            if waiting <= self._max_idle_ranks:
                break
            old.stop(graceful=True)
            waiting -= old.layout.world_size
        return pool

    @property
    def worker_pids(self) -> list[int]:
        """Pids of every live rank of every pool."""
        return [pid for p in self._pools.values() for pid in p.worker_pids]

    def close(self) -> None:
        """Stop every pool's ranks (all told first, so that they leave together)."""
        for pool in self._pools.values():
            pool.ask_to_stop()
        for pool in self._pools.values():
            pool.stop(graceful=True)
        self._pools.clear()


def _wait_for_groups(pgids: list[int], limit: float) -> None:
    """Wait, at most ``limit`` seconds, until no process of the process groups
    ``pgids`` runs: a killed process may still run when ``killpg`` returns (the
    signal is delivered asynchronously). A zombie runs nothing: its reaper, the
    init process for an orphan, removes it later."""
    wanted = set(pgids)
    deadline = time.monotonic() + limit
    while wanted and _live_members(wanted) and time.monotonic() < deadline:
        time.sleep(0.01)


def _live_members(pgids: set[int]) -> bool:
    """Whether a process that is not a zombie belongs to one of the groups ``pgids``
    (False where ``/proc`` cannot say)."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return False
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z" and int(pgrp) in pgids:
            return True
    return False
