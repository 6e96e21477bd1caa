"""The plugin's rank pool alone (``RankPool``), on real rank processes: the same
ranks serve test after test; a failure or a timeout replaces them."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from coordinator.pytest_plugin.marker import Layout
from coordinator.pytest_plugin.pool import PoolSet, RankPool
from coordinator.pytest_plugin.protocol import (
    FAILED,
    PASSED,
    STOPPED,
    TIMED_OUT,
    RankFixture,
    TestCall,
)
from tests.coordinator.pytest_plugin import rank_functions

_PATH = os.path.abspath(rank_functions.__file__)


def _call(name: str, **kwargs: Any) -> TestCall:
    args = {"rank": RankFixture("rank"), **kwargs}
    return TestCall(f"rank_functions::{name}", rank_functions.__name__, _PATH, name,
                    pickle.dumps(args), [])


@pytest.mark.timeout(120)
def test_the_same_ranks_run_test_after_test() -> None:
    pool = RankPool(Layout(2))
    try:
        pool.start()
        pids = pool.worker_pids
        for _ in range(2):
            results = pool.run(_call("passes", group=RankFixture("group")), timeout=60)
            assert [r.status for r in results] == [PASSED, PASSED], results
            assert pool.worker_pids == pids
    finally:
        pool.stop(graceful=True)
    assert not pool.started


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
