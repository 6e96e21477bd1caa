"""The shared-memory engine's thread count: the sizing rule, the setting (lowered and
raised), and collectives run with more torch threads than the node has CPUs (torch's
default on a busy host)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.testing import run_distributed
from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.cpu_shm.engine_threads import (
    GRAIN,
    THREADS_ENV,
    KernelThreads,
    cores_per_rank,
    engine_threads,
    env_threads,
    openmp_backend,
)

OWN = sorted(os.sched_getaffinity(0))


# ---------------------------------------------------------------------- the sizing rule
def test_one_rank_gets_its_whole_mask() -> None:
    assert cores_per_rank([os.getpid()], 0) == len(OWN)


@pytest.mark.timeout(30)
def test_ranks_share_the_union_of_their_masks() -> None:
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.sched_setaffinity(peer.pid, {OWN[0]})  # inside our mask: the union stays ours
        assert cores_per_rank([os.getpid(), peer.pid], 0) == max(1, len(OWN) // 2)
        assert cores_per_rank([peer.pid, os.getpid(), os.getpid()], 1) == max(1, len(OWN) // 3)
    finally:
        peer.kill()
        peer.wait()


def test_unreadable_peer_counts_as_sharing_our_mask() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    assert cores_per_rank([os.getpid(), gone.pid], 0) == max(1, len(OWN) // 2)


@pytest.mark.timeout(30)
def test_never_more_than_own_mask() -> None:
    # A rank bound to one CPU gets one thread even if its peers may use many.
    code = (
        "import os; from device_comms.cpu_shm.engine_threads import cores_per_rank;"
        f"os.sched_setaffinity(0, {{{OWN[0]}}});"
        "print(cores_per_rank([os.getpid(), os.getppid()], 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_environment_overrides_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert env_threads() is None
    assert engine_threads([os.getpid()], 0, env_threads()) == len(OWN)
    monkeypatch.setenv(THREADS_ENV, " 3 ")
    assert env_threads() == 3
    assert engine_threads([os.getpid()], 0, env_threads()) == 3


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_bad_environment_value(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(THREADS_ENV, raw)
    with pytest.raises(ValueError, match=f"{THREADS_ENV} must be a positive int.*{raw!r}"):
        env_threads()


# ---------------------------------------------------------------------- the setting
@pytest.fixture
def four_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not openmp_backend(), reason="the setting acts on torch's OpenMP backend only")
def test_setting_applies_and_restores(four_threads: None) -> None:
    cap = KernelThreads(1)
    with cap:
        assert torch.get_num_threads() == 1
        with cap:  # nested: only the outer block restores
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 4
    with pytest.raises(RuntimeError, match="boom"), cap:
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 4
    with KernelThreads(6):  # above torch's setting: raised for the block
        assert torch.get_num_threads() == 6
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("bad", [0, -1])
def test_cap_rejects_bad_limit(bad: int) -> None:
    with pytest.raises(ValueError, match=f"limit must be a positive int, got {bad}"):
        KernelThreads(bad)


@pytest.mark.parametrize("bad", [1.0, True, "2", None])
def test_cap_rejects_non_int_limit(bad: Any) -> None:
    with pytest.raises(TypeError, match=f"limit must be a positive int, got {type(bad).__name__}"):
        KernelThreads(bad)


# ---------------------------------------------------------------------- on real ranks
def _thread_cpu_ns(tids: set[int]) -> int:
    """CPU time (ns) the threads ``tids`` of this process have used."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # exited
            pass
    return total


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _sizes(comm: CpuCommunicator) -> list[tuple[int, ...]]:
    """Shapes around every boundary of the engine: 0-d, empty, odd, the torch grain,
    the slot, the one-shot limit (two-phase above it)."""
    eng = comm._engine
    assert eng is not None
    slot = eng.ws.slot_bytes // 4  # float32 elements
    lengths = [0, 1, 3, 1001, GRAIN - 1, GRAIN, GRAIN + 1, slot - 1, slot + 1, 2 * slot + 7,
               (eng.oneshot_bytes // 4) + 13, 3 * slot + 5]
    return [()] + [(n,) for n in lengths] + [(7, 1 + GRAIN // 7)]


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)


def _ops(dtype: torch.dtype) -> tuple[ReduceOp, ...]:
    if dtype == torch.bool or dtype.is_complex:
        return (ReduceOp.SUM,)
    if dtype.is_floating_point:
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)
    return (ReduceOp.SUM, ReduceOp.BXOR, ReduceOp.MIN)


def _input(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 50, shape, generator=g, dtype=dtype)


def default_threads_rank(rank: int, world_size: int, threads: int) -> dict[str, Any]:
    """Every dtype and boundary size with ``threads`` torch threads and the engine capped
    at one; the OpenMP workers' CPU time while only collectives run."""
    torch.set_num_threads(threads)
    torch.ones(1 << 20).add_(1)  # start the OpenMP team (its workers are new threads)
    os.environ[THREADS_ENV] = "1"
    try:
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="thr",
                               workspace_bytes=1 << 20, oneshot_bytes=256 << 10)
    finally:
        del os.environ[THREADS_ENV]
    workers = _tids() - {threading.get_native_id()}
    cases = [(dtype, shape, op)
             for dtype in _DTYPES for shape in _sizes(comm) for op in _ops(dtype)]
    inputs = [_input(i, rank, shape, dtype) for i, (dtype, shape, op) in enumerate(cases)]
    big = torch.full((world_size << 18,), float(rank))
    copies = [big.clone() for _ in range(10)]
    comm.barrier()
    time.sleep(0.2)  # the team's workers stop spinning and sleep
    before = _thread_cpu_ns(workers)
    got, restored = [], True
    # only collectives while the workers are watched
    for x, (_, _, op) in zip(inputs, cases, strict=True):
        got.append(comm.all_reduce(x, op))
        restored &= torch.get_num_threads() == threads
    for c in copies:
        comm.all_gather(big, 0)
        comm.reduce_scatter(big.view(world_size, -1), 0)
        comm.broadcast(c, 0)
    capped = _thread_cpu_ns(workers) - before
    comm.barrier()
    time.sleep(0.2)
    before = _thread_cpu_ns(workers)
    large = torch.zeros(1 << 22)
    for _ in range(80):  # the same kind of kernels outside the engine: the team runs
        large.add_(1.0)
    uncapped = _thread_cpu_ns(workers) - before
    info = comm.describe()
    comm.destroy()
    bad = []
    for i, ((dtype, shape, op), res) in enumerate(zip(cases, got, strict=True)):
        want = reduce_local([_input(i, r, shape, dtype) for r in range(world_size)], op)
        if res.dtype != want.dtype or res.shape != want.shape or not torch.equal(res, want):
            bad.append(f"{dtype} {shape} {op.name}")
    return {"bad": bad, "restored": restored, "capped_ns": capped, "uncapped_ns": uncapped,
            "workers": len(workers), "engine_threads": info["engine_threads"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_with_more_threads_than_cpus(world_size: int) -> None:
    threads = 2 * len(OWN)  # oversubscribed whatever the machine
    outs = run_distributed(default_threads_rank, world_size, threads, timeout=220)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: wrong results for {o['bad'][:5]}"
        assert o["restored"], "the caller's torch thread count must be restored after each call"
        assert o["engine_threads"] == 1
        if openmp_backend():  # the engine's kernels never woke the team; plain torch kernels did
            assert o["workers"] >= 1, "the OpenMP team should exist"
            # Measured on 2 vCPUs, 4 threads: capped 0.3-4 ms, without the cap 24-45 ms,
            # the plain kernels below 25-35 ms; a ratio survives a loaded machine.
            assert 3 * o["capped_ns"] < o["uncapped_ns"], o


def bad_env_rank(rank: int, world_size: int) -> str:
    os.environ[THREADS_ENV] = "none"
    try:
        CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="thr")
    except ValueError as e:
        return str(e)
    finally:
        del os.environ[THREADS_ENV]
    return "no error"


def one_thread_rank(rank: int, world_size: int, engine: int) -> dict[str, Any]:
    """torch at one thread, the engine at ``engine``: large collectives run on more
    threads than the caller's (new OpenMP workers use CPU), results stay exact and the
    caller's setting is back after every call."""
    torch.set_num_threads(1)
    os.environ[THREADS_ENV] = str(engine)
    try:
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="one",
                               workspace_bytes=1 << 20)
    finally:
        del os.environ[THREADS_ENV]
    before = _tids()
    n = 1 << 21  # 8 MiB of float32: pieces far above the grain
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    got, restored = [], True
    for _ in range(3):
        got.append(comm.all_reduce(x, ReduceOp.SUM))
        restored &= torch.get_num_threads() == 1
        got.append(comm.all_gather(x[: n // 4], 0))
        restored &= torch.get_num_threads() == 1
    workers = _tids() - before
    cpu = _thread_cpu_ns(workers)
    info = comm.describe()
    comm.destroy()
    total = sum(range(1, world_size + 1))
    want_sum = torch.arange(n, dtype=torch.float32) * total
    want_gather = torch.cat([torch.arange(n // 4, dtype=torch.float32) * (r + 1)
                             for r in range(world_size)])
    exact = all(torch.equal(g, want_sum if i % 2 == 0 else want_gather)
                for i, g in enumerate(got))
    return {"exact": exact, "restored": restored, "workers": len(workers), "cpu_ns": cpu,
            "engine_threads": info["engine_threads"]}


@pytest.mark.timeout(90)
@pytest.mark.skipif(not openmp_backend(), reason="the setting acts on torch's OpenMP backend only")
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_engine_raises_one_torch_thread(world_size: int) -> None:
    for rank, o in enumerate(run_distributed(one_thread_rank, world_size, 2, timeout=80)):
        assert o["exact"], f"rank {rank}: wrong results"
        assert o["restored"], "the caller's torch thread count must be restored after each call"
        assert o["engine_threads"] == 2
        assert o["workers"] >= 1 and o["cpu_ns"] > 0, (
            f"rank {rank}: the engine's kernels should have run on a second thread: {o}")


@pytest.mark.timeout(60)
def test_communicator_rejects_bad_environment() -> None:
    for msg in run_distributed(bad_env_rank, 2, timeout=50):
        assert THREADS_ENV in msg and "'none'" in msg, msg


def kernel_threads_rank(rank: int, world_size: int, engine: int) -> tuple[int, int, int]:
    """Torch's threads inside ``CpuCommunicator.kernel_threads()`` (the engine's share,
    set by ``GROUPCOORD_CPU_SHM_THREADS``), and before and after (the caller's)."""
    torch.set_num_threads(3)
    os.environ[THREADS_ENV] = str(engine)
    try:
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="kt",
                               workspace_bytes=1 << 20)
    finally:
        del os.environ[THREADS_ENV]
    try:
        before = torch.get_num_threads()
        with comm.kernel_threads():
            inside = torch.get_num_threads()
        return before, inside, torch.get_num_threads()
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not openmp_backend(), reason="the setting acts on torch's OpenMP backend only")
@pytest.mark.parametrize("engine", [1, 2])
def test_callers_copies_run_on_the_engines_threads(dist_pool: Any, engine: int) -> None:
    """What the torch backend wraps its copies in: the engine's thread share inside,
    the caller's setting restored after."""
    for rank, got in enumerate(dist_pool(2).run(kernel_threads_rank, engine, timeout=50)):
        assert got == (3, engine, 3), f"rank {rank}: (before, inside, after) = {got}"
