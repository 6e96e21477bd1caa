"""The plugin's rank pool alone (``RankPool``), on real rank processes: the same
ranks serve test after test; a failure or a timeout replaces them."""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.pytest_plugin.marker import Layout
from coordinator.pytest_plugin.pool import PoolSet, PoolStartError, RankPool
from coordinator.pytest_plugin.protocol import (
    FAILED,
    PASSED,
    SKIPPED,
    STOPPED,
    TIMED_OUT,
    XFAILED,
    RankFixture,
    RankResult,
    TestCall,
)
from shm_broadcast.ranks.launcher import START_METHOD_ENV
from tests.coordinator.pytest_plugin import rank_functions

_PATH = os.path.abspath(rank_functions.__file__)


def _call(name: str, **kwargs: Any) -> TestCall:
    args = {"rank": RankFixture("rank"), **kwargs}
    return TestCall(f"rank_functions::{name}", rank_functions.__name__, _PATH, name,
                    pickle.dumps(args), [])


class _Interrupted(Exception):
    """What the test's signal handler raises, standing for Ctrl-C's KeyboardInterrupt."""


def _interrupt_when(path: str) -> threading.Thread:
    """A thread that signals this process (SIGUSR1) once ``path`` exists."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted


@pytest.mark.timeout(120)
def test_the_same_ranks_run_test_after_test_until_interrupted(tmp_path: Path) -> None:
    pool = RankPool(Layout(2))
    try:
        pool.start()
        pids = pool.worker_pids
        for _ in range(2):
            results = pool.run(_call("passes", group=RankFixture("group")), timeout=60)
            assert [r.status for r in results] == [PASSED, PASSED], results
            assert pool.worker_pids == pids
        # What a test changes in the process is put back for the next one
        tmp = str(tmp_path)
        assert _statuses(pool.run(_call("thread_count", tmp=tmp), timeout=60)) == [PASSED] * 2
        threads = int((tmp_path / "threads0").read_text())
        for name in ("changes_process_state", "sees_the_process_state_as_before"):
            results = pool.run(_call(name, tmp=tmp, threads=threads)
                               if name.startswith("sees") else _call(name, tmp=tmp), timeout=60)
            assert _statuses(results) == [PASSED] * 2, results
        assert pool.worker_pids == pids
        # Interrupted while rank 0's test has a child running (as by Ctrl-C): the
        # ranks and the child are ended before the interruption goes on.
        pid_file = str(tmp_path / "child")
        saved = signal.signal(signal.SIGUSR1, _raise_interrupted)
        try:
            thread = _interrupt_when(pid_file)
            with pytest.raises(_Interrupted):
                pool.run(_call("starts_a_child_then_waits", pid_file=pid_file), timeout=60)
        finally:
            signal.signal(signal.SIGUSR1, saved)
        thread.join()
        assert not pool.started
        with open(pid_file) as f:
            child = int(f.read())
        assert not any(_alive(pid) for pid in [*pids, child])
    finally:
        pool.stop(graceful=True)
    assert not pool.started


def _statuses(results: list[RankResult]) -> list[str]:
    return [r.status for r in results]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: the child's parent, gone, reaps it later)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failure_or_a_timeout_replaces_the_ranks() -> None:
    pool = RankPool(Layout(2))
    try:
        pool.start()
        first = pool.worker_pids
        failed = pool.run(_call("fails_on_rank_1"), timeout=60)
        assert [r.status for r in failed] == [PASSED, FAILED], failed
        assert "rank 1 refuses" in failed[1].summary and "assert" in failed[1].traceback
        assert not pool.started  # stopped and reaped
        pool.start()
        assert set(pool.worker_pids).isdisjoint(first)
        hung = pool.run(_call("sleeps_on_rank_0"), timeout=2)
        assert [r.status for r in hung] == [TIMED_OUT, PASSED], hung
        assert "sleeps_on_rank_0" in hung[0].traceback  # its stack, from faulthandler
        assert not pool.started
    finally:
        pool.stop(graceful=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_others_are_stopped_after_a_failure() -> None:
    pool = RankPool(Layout(2))
    try:
        call = _call("fails_on_rank_1_before_a_barrier", group=RankFixture("group"))
        results = pool.run(call, timeout=60)
        assert [r.status for r in results] == [STOPPED, FAILED], results
        assert "barrier" in results[0].traceback  # where it waited for rank 1
        results = pool.run(_call("passes", group=RankFixture("group")), timeout=60)
        assert [r.status for r in results] == [PASSED, PASSED], results  # fresh ranks
    finally:
        pool.stop(graceful=True)


def test_pool_set_keeps_one_pool_per_layout() -> None:
    pools = PoolSet()
    a, b = pools.get(Layout(2)), pools.get(Layout(2, tp=2))
    assert pools.get(Layout(2)) is a and a is not b
    assert pools.worker_pids == []  # made, not started
    pools.close()


def _own_call(name: str, **kwargs: Any) -> TestCall:
    """A call of ``name``, a function of this module (rank code kept with its test)."""
    args = {"rank": RankFixture("rank"), **kwargs}
    return TestCall(f"{__name__}::{name}", __name__, os.path.abspath(__file__), name,
                    pickle.dumps(args), [])


def leaves_on_rank_0_then_barrier(rank: int, group: object, how: str) -> None:
    """Rank code: rank 0 skips or xfails; the others wait for it in a barrier."""
    if rank == 0:
        (pytest.skip if how == "skip" else pytest.xfail)(f"{how} on rank 0")
    group.barrier()  # type: ignore[attr-defined]  # rank 0 never comes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,status", [("skip", SKIPPED), ("xfail", XFAILED)])
def test_the_others_are_stopped_after_a_rank_skips_or_xfails(how: str, status: str) -> None:
    # Before: a skip did not start the grace period, and the ranks waiting for
    # the skipped one ran until the whole timeout (here 60 s).
    pool = RankPool(Layout(2))
    try:
        pool.start()
        t0 = time.monotonic()
        results = pool.run(_own_call("leaves_on_rank_0_then_barrier", how=how,
                                     group=RankFixture("group")), timeout=60)
        elapsed = time.monotonic() - t0
        assert [r.status for r in results] == [status, STOPPED], results
        assert elapsed < 30, elapsed
        assert "barrier" in results[1].traceback  # where it waited for rank 0
        assert not pool.started  # a stopped rank is not reused
    finally:
        pool.stop(graceful=True)


def test_a_start_that_raises_removes_its_stacks_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # start_ranks raises before any rank runs (here: a start method that does
    # not exist); before, the stacks directory was left behind and the error
    # was not a PoolStartError.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(START_METHOD_ENV, "no-such-method")
    pool = RankPool(Layout(2))
    try:
        with pytest.raises(PoolStartError, match="could not be started: ValueError") as info:
            pool.start()
        assert info.value.results == [] and "no-such-method" in str(info.value)
        assert not pool.started
        assert list(tmp_path.iterdir()) == []
    finally:
        pool.stop()
