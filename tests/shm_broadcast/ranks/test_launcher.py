"""The process launcher: outcomes per rank, deaths that spare the others, reaping."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from shm_broadcast.ranks.launcher import (
    describe_exit,
    per_rank_env,
    spawn_group,
    start_ranks,
    stop_ranks,
)

pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------ rank code
def _mixed(rank: int, world_size: int, victim: int) -> int:
    """Rank ``victim`` dies by SIGKILL, rank 1 raises, the others outlive both and return."""
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        raise KeyError("rank one fails on purpose")
    time.sleep(2.0)  # the other two are gone by now
    return rank * 10


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _env_value(rank: int, world_size: int) -> str | None:
    return os.environ.get("GC_LAUNCHER_PROBE")


def _idle_child(conn) -> None:
    conn.recv()


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("world_size", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_each_rank_reports_its_own_outcome(world_size: int) -> None:
    victim = world_size - 1
    outs = spawn_group(_mixed, world_size, (victim,), timeout=120)
    assert [o.rank for o in outs] == list(range(world_size))
    assert outs[victim].exitcode == -signal.SIGKILL and not outs[victim].ok
    assert not outs[1].ok and outs[1].error.startswith("KeyError:"), outs[1]
    for r in range(world_size):
        if r not in (victim, 1):
            assert outs[r].ok and outs[r].result == r * 10 and outs[r].exitcode == 0


def test_a_rank_past_the_timeout_is_killed_and_reaped() -> None:
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    t0 = time.monotonic()
    outs = spawn_group(_sleep_forever, 2, timeout=3)  # started or not, the ranks are killed
    assert time.monotonic() - t0 < 60
    assert all(not o.ok and o.error is None and o.exitcode is None for o in outs), outs
    left = {c.pid for c in me.children(recursive=True)} - before
    assert not [p for p in left if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_env_reaches_each_rank() -> None:
    outs = spawn_group(_env_value, 2, env=[{"GC_LAUNCHER_PROBE": "a"},
                                           {"GC_LAUNCHER_PROBE": "b"}], timeout=120)
    assert [o.result for o in outs] == ["a", "b"]


def test_stop_ranks_terminates_reaps_and_closes() -> None:
    procs, conns = start_ranks(_idle_child, 2, lambda r, child: (child,),
                               name="gc-launcher-test", duplex=True)
    pids = [p.pid for p in procs]
    stop_ranks(procs, conns)
    assert all(c.closed for c in conns)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(
    "env, exc, match",
    [
        ([{}], ValueError, "env must be one mapping or 2 mappings"),
        ([{}, {}, {}], ValueError, "got 3"),
    ],
    ids=["too-few", "too-many"],
)
def test_per_rank_env_rejects_a_wrong_count(env, exc, match) -> None:
    with pytest.raises(exc, match=match):
        per_rank_env(env, 2)


@pytest.mark.parametrize("world_size", [0, -1, True, 1.5])
def test_spawn_group_rejects_a_bad_world_size(world_size) -> None:
    with pytest.raises((TypeError, ValueError), match="world_size"):
        spawn_group(_env_value, world_size)


@pytest.mark.parametrize("code, words", [(0, "exit code 0"), (3, "exit code 3"),
                                         (-9, "killed by signal SIGKILL"),
                                         (None, "still running")])
def test_describe_exit(code, words) -> None:
    assert describe_exit(code) == words
