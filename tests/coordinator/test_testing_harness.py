"""coordinator.testing: run_distributed and DistributedPool report every failure fast.

Covered: results by rank; args and per-rank env reach the ranks; a rank's
exception is re-raised in the parent with its type, ``groupcoord_rank`` and the
remote traceback; unpicklable exceptions; ranks that exit or are killed;
timeouts naming the pending ranks; pool reuse, restart after a failure and
teardown of model-parallel state between runs; startup failures; ranks dying
with their parent. The autouse ``no_leaks`` fixture checks after each test that
no process or shared-memory segment was left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from coordinator.errors import (
    CommTimeout,
    DistributedTimeout,
    RankDiedError,
    RankFailedError,
)
from coordinator.testing import DistributedPool, live_pool_pids, run_distributed
from shm_broadcast.ranks.launcher import START_METHOD_ENV
from tests.child_env import child_env
from tests.processes import running


@pytest.fixture(scope="module")
def pool():
    """A private pool of 2 ranks that the failure tests are allowed to break."""
    p = DistributedPool(2)
    yield p
    p.close()


@pytest.mark.timeout(120)
def test_results_by_rank_args_and_reuse(pool):
    first = pool.run(echo, "a", 3)
    assert [r[:3] for r in first] == [(0, 2, ("a", 3)), (1, 2, ("a", 3))]
    pids = [r[3] for r in first]
    assert set(pids) == set(pool.worker_pids) <= live_pool_pids()
    assert [r[3] for r in pool.run(echo)] == pids, "a healthy pool must reuse its ranks"


@pytest.mark.timeout(120)
def test_model_parallel_state_is_torn_down_between_runs(pool):
    assert pool.run(init_mp_then_check, 0) == [True, True]
    assert pool.run(init_mp_then_check, 1) == [False, False]


@pytest.mark.timeout(120)
def test_exception_is_reraised_with_type_rank_and_remote_traceback(pool):
    with pytest.raises(RankBoom, match="boom on rank 1") as info:
        pool.run(raise_on, 1, "custom")
    e = info.value
    assert e.groupcoord_rank == 1
    tb = str(e.__cause__)
    assert "rank 1 of 2 raised RankBoom" in tb and "in raise_on" in tb and "Traceback" in tb
    # the pool restarts on the next run, with new processes
    with pytest.raises(KeyError) as info:
        pool.run(raise_on, 0, "keyerror")
    assert info.value.groupcoord_rank == 0
    assert pool.run(raise_on, -1, "none") == [0, 1]


@pytest.mark.timeout(120)
def test_unpicklable_result_is_reported(pool):
    with pytest.raises(Exception, match="lambda|pickle") as info:
        pool.run(return_unpicklable)
    assert info.value.groupcoord_rank in (0, 1)


@pytest.mark.timeout(120)
def test_unpicklable_exception_becomes_rank_failed_error(pool):
    with pytest.raises(RankFailedError) as info:
        pool.run(raise_on, 0, "unpicklable")
    e = info.value
    assert e.rank == 0 and "Unpicklable" in str(e) and "cannot travel" in str(e)
    assert "in raise_on" in e.remote_traceback


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,words", [("exit", "exit code 3"), ("kill", "SIGKILL")])
def test_rank_that_dies_raises_rank_died_error(pool, how, words):
    before = {r[3] for r in pool.run(echo)}  # (starts the ranks if a failure stopped them)
    t0 = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        pool.run(exit_on, 1, how, timeout=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and words in str(info.value) and "exit_on" in str(info.value)
    assert not pool.worker_pids  # every rank was killed and reaped
    assert not any(running(p) for p in before)
    # (that the pool restarts after a failure is checked by the exception test)


@pytest.mark.timeout(120)
def test_timeout_raises_distributed_timeout_naming_pending_ranks(pool):
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        pool.run(sleep_then, 60.0, None, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 20, elapsed
    e = info.value
    assert isinstance(e, CommTimeout) and isinstance(e, TimeoutError)
    assert e.pending_ranks == [0, 1]
    assert "[0, 1]" in str(e) and "sleep_then" in str(e) and "1.0s" in str(e)


@pytest.mark.timeout(120)
def test_closed_pool_and_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        DistributedPool(0)
    with pytest.raises(ValueError, match="world_size"):
        DistributedPool(True)
    with pytest.raises(TypeError, match="backend"):
        DistributedPool(2, backend=None)
    with pytest.raises(ValueError, match="env"):
        DistributedPool(2, env=[{}])
    p = DistributedPool(1)
    with pytest.raises(TypeError, match="fn"):
        p.run("not callable")
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.run(echo)


_BAD_TIMEOUTS = [
    pytest.param(None, TypeError, "number of seconds", id="none"),
    pytest.param("5", TypeError, "number of seconds", id="str"),
    pytest.param(True, TypeError, "number of seconds", id="bool"),
    pytest.param(float("nan"), ValueError, "finite number of seconds > 0", id="nan"),
    pytest.param(float("inf"), ValueError, "finite number of seconds > 0", id="inf"),
    pytest.param(-1, ValueError, "finite number of seconds > 0", id="negative"),
    pytest.param(0, ValueError, "finite number of seconds > 0", id="zero"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value,exc,words", _BAD_TIMEOUTS)
def test_bad_run_timeout_is_refused_before_the_ranks_get_work(pool, value, exc, words):
    assert [r[2] for r in pool.run(echo, "warm")] == [("warm",)] * 2
    with pytest.raises(exc, match=f"^timeout must be a.*{words}"):
        pool.run(echo, "refused", timeout=value)
    # Nothing of the refused call reached a rank: the next run gets its own results.
    assert [r[2] for r in pool.run(echo, "next")] == [("next",)] * 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["pool_start_timeout", "run_distributed_timeout"])
@pytest.mark.parametrize("value,exc,words", _BAD_TIMEOUTS)
def test_bad_start_timeout_is_refused_at_once(where, value, exc, words):
    name = "start_timeout" if where.startswith("pool") else "timeout"
    before = live_pool_pids()  # (the module's pool may be up)
    t0 = time.monotonic()
    with pytest.raises(exc, match=f"^{name} must be a.*{words}"):
        if where.startswith("pool"):
            DistributedPool(2, start_timeout=value)
        else:
            run_distributed(echo, 2, timeout=value)
    assert time.monotonic() - t0 < 5  # refused before any rank started
    assert live_pool_pids() <= before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("env,exc,words", [
    pytest.param("A=1", TypeError, "env must be a mapping of str to str", id="str"),
    pytest.param(5, TypeError, "env must be a mapping of str to str", id="int"),
    pytest.param([("A", "1"), ("B", "2")], TypeError, r"env\[0\] must be a mapping",
                 id="list-of-pairs"),
    pytest.param({"A": 1}, TypeError, "env must map str to str", id="int-value"),
    pytest.param([{"A": "1"}, {"B": None}], TypeError, r"env\[1\] must map str to str",
                 id="per-rank-none-value"),
    pytest.param([{}], ValueError, "env must be one mapping or 2 mappings", id="too-few"),
])
def test_bad_env_is_refused_at_construction(env, exc, words):
    before = live_pool_pids()  # (the module's pool may be up)
    with pytest.raises(exc, match=words):
        DistributedPool(2, env=env)
    assert live_pool_pids() <= before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,type_name", [("keyboard_interrupt", "KeyboardInterrupt"),
                                            ("system_exit", "SystemExit")])
def test_a_rank_base_exception_becomes_rank_failed_error(pool, kind, type_name):
    # Re-raised here, a rank's KeyboardInterrupt would end this pytest session
    # and its SystemExit would exit a script: a rank's failure is a RankFailedError.
    with pytest.raises(RankFailedError) as info:
        pool.run(raise_on, 1, kind)
    e = info.value
    assert type(e) is RankFailedError and e.rank == 1
    assert f"rank 1 of 2 raised {type_name}" in str(e)
    assert "in raise_on" in e.remote_traceback and type_name in e.remote_traceback
    assert not pool.worker_pids  # every rank was stopped
    assert [r[2] for r in pool.run(echo, "after")] == [("after",)] * 2


@pytest.mark.timeout(120)
def test_exception_whose_str_raises_is_reported_with_its_traceback(pool):
    with pytest.raises(BrokenStr) as info:
        pool.run(raise_on, 1, "broken_str")
    e = info.value
    assert e.groupcoord_rank == 1  # reported as raised, not as a rank that died
    tb = str(e.__cause__)
    assert "rank 1 of 2 raised BrokenStr" in tb and "in raise_on" in tb


@pytest.mark.timeout(120)
def test_run_distributed_env_per_rank_and_node_simulation():
    results = run_distributed(
        read_env, 2, "GROUPCOORD_NODE_ID",
        env=[{"GROUPCOORD_NODE_ID": "nodeA"}, {"GROUPCOORD_NODE_ID": "nodeB"}], timeout=90,
    )
    assert [r["env"] for r in results] == ["nodeA", "nodeB"]
    assert all(r["same_node"] == [True, False] for r in results)


@pytest.mark.timeout(120)
def test_startup_failure_is_reported():
    # Without a GPU the nccl backend cannot start: a CPU build of torch has no
    # NCCL, a CUDA build has no device. Every rank fails in init_process_group.
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        pytest.skip("a GPU is visible: the nccl backend may start here")
    t0 = time.monotonic()
    # torch raises RuntimeError or ValueError here depending on its build.
    with pytest.raises((RuntimeError, ValueError), match="(?i)nccl|gpu|cuda device") as info:
        run_distributed(echo, 2, backend="nccl", timeout=60)
    assert time.monotonic() - t0 < 45
    assert info.value.groupcoord_rank in (0, 1)
    assert "init_distributed_environment" in str(info.value.__cause__)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("starter", [pytest.param("main_thread", marks=pytest.mark.slow),
                                     "short_lived_thread"])
def test_ranks_die_with_their_parent(tmp_path, starter: str, method: str):
    """SIGKILL the process that owns a pool: its ranks must not outlive it. A pool
    started from a thread that has exited since keeps its ranks until then. Ranks
    forked by a fork server (whose parent is the server) watch the owner too."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, threading, time
        from coordinator.testing import DistributedPool
        from tests.coordinator.test_testing_harness import echo
        if __name__ == "__main__":
            pools = []
            if {starter!r} == "main_thread":
                pools.append(DistributedPool(2))
            else:
                def start():  # the ranks start at a pool's first run
                    pools.append(DistributedPool(2))
                    pools[0].run(echo)
                t = threading.Thread(target=start)
                t.start()
                t.join()
                time.sleep(1.0)  # a rank tied to the thread would be dead by now
            pids = [r[3] for r in pools[0].run(echo)]
            print(" ".join(map(str, pids)), flush=True)
            time.sleep(120)
    """))
    env = child_env()
    env[START_METHOD_ENV] = method
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=os.getcwd())
    try:
        line = owner.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, f"owner printed {line!r}"
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if running(p)]
            time.sleep(0.05)
        assert not alive, f"ranks {alive} outlived their parent"
    finally:
        owner.kill()
        owner.wait(10)
        owner.stdout.close()


# ---------------------------------------------------------------------- on the ranks
class RankBoom(ValueError):
    """A custom exception raised on one rank (re-raised in the parent with its type)."""


class Unpicklable(Exception):
    """An exception that cannot be pickled (holds a lambda)."""

    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.fn = lambda: None


class BrokenStr(Exception):
    """An exception whose ``str()`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def raise_on(rank: int, world_size: int, bad_rank: int, kind: str) -> int:
    """Raise on ``bad_rank`` (the others return their rank)."""
    if rank == bad_rank:
        if kind == "keyboard_interrupt":
            raise KeyboardInterrupt("raised by the code under test")
        if kind == "system_exit":
            sys.exit(3)
        if kind == "broken_str":
            raise BrokenStr("the real problem")
        if kind == "custom":
            raise RankBoom(f"boom on rank {rank}")
        if kind == "keyerror":
            raise KeyError("missing")
        if kind == "unpicklable":
            raise Unpicklable()
    return rank


def exit_on(rank: int, world_size: int, bad_rank: int, how: str) -> int:
    """Die without a result on ``bad_rank``: ``os._exit(3)`` or SIGKILL."""
    import signal

    if rank == bad_rank:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def return_unpicklable(rank: int, world_size: int) -> Any:
    """Return something the pipe cannot carry."""
    return lambda: rank


def echo(rank: int, world_size: int, *args: Any) -> tuple[Any, ...]:
    """Return what the rank was called with, plus its pid and parent pid."""
    return (rank, world_size, args, os.getpid())


def read_env(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """The rank's view of env var ``name`` and of its node placement."""
    from coordinator import parallel_state as ps

    return {"env": os.environ.get(name), "same_node": ps.in_the_same_node_as(ps.get_world_group())}


def init_mp_then_check(rank: int, world_size: int, step: int) -> bool:
    """Step 0 leaves model parallelism initialised; step 1 sees it torn down."""
    from coordinator import parallel_state as ps

    if step == 0:
        ps.initialize_model_parallel(world_size, 1)
        return ps.model_parallel_is_initialized()
    was = ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(1, world_size)
    return was


def sleep_then(rank: int, world_size: int, seconds: float, value: Any) -> Any:
    """Sleep, then return ``value`` (harness tests)."""
    time.sleep(seconds)
    return value
