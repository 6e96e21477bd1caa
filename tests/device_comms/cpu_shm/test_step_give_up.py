"""A rank that arrives after its peers timed out raises too: nobody passes a step
that another rank gave up (``device_comms.cpu_shm.sync``, "Giving up on a step").

The on-time ranks' timeout elapses while the late rank sleeps; the late rank
then calls the same collective. Every rank must raise the project's timeout
error (the late one promptly, naming who gave up), and none may return a result.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator

pytestmark = pytest.mark.timeout(120)

_TIMEOUT = 0.5  # the communicator's timeout (seconds)
_LATE = 1.5  # how long after the others the late rank calls (they give up at ~0.6 s)


def _call(comm: CpuCommunicator, op: str, rank: int, world_size: int) -> Any:
    x = torch.full((8,), float(rank + 1))
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "all_reduce_large":  # several steps: pieces larger than one slot
        return comm.all_reduce(torch.full((300_000,), float(rank + 1)))
    if op == "all_gather":
        return comm.all_gather(x, dim=0)
    if op == "broadcast":
        return comm.broadcast(x, src=0)
    if op == "barrier":
        return comm.barrier()
    raise AssertionError(op)


def late_rank(rank: int, world_size: int, op: str, late: int) -> dict[str, Any]:
    """Rank ``late`` calls ``op`` ``_LATE`` s after the others; what each rank sees."""
    from shm_broadcast.errors import CommTimeout

    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"giveup-{op}",
                           timeout=_TIMEOUT, workspace_bytes=1 << 20)
    out: dict[str, Any] = {"rank": rank}
    try:
        for _ in range(3):  # a few steps in step first
            comm.all_reduce(torch.ones(4))
        dist.barrier()
        if rank == late:
            time.sleep(_LATE)
        t0 = time.monotonic()
        try:
            _call(comm, op, rank, world_size)
            out["result"] = "returned"
        except CommTimeout as e:
            out["result"] = "CommTimeout"
            out["message"] = str(e)
            out["peers"] = list(e.peers)
        except Exception as e:
            out["result"] = f"{type(e).__name__}: {e}"
        out["elapsed"] = time.monotonic() - t0
        try:
            comm.all_reduce(torch.ones(4))
            out["next"] = "returned"
        except Exception as e:
            out["next"] = type(e).__name__
    finally:
        dist.barrier()
        comm.destroy()
    return out


_SLOW = pytest.mark.slow  # the same protocol at one more world size (not in CI's time)


@pytest.mark.parametrize("world_size,op", [
    (2, "all_reduce"), (2, "all_reduce_large"), (2, "all_gather"), (2, "broadcast"),
    (2, "barrier"), (3, "all_reduce"), pytest.param(3, "all_reduce_large", marks=_SLOW),
    pytest.param(3, "all_gather", marks=_SLOW),
])
def test_a_late_rank_raises_after_its_peers_timed_out(dist_pool, world_size: int,
                                                      op: str) -> None:
    late = world_size - 1
    outs = dist_pool(world_size).run(late_rank, op, late)
    for o in outs:
        assert o["result"] == "CommTimeout", o
        assert o["next"] == "BrokenCommunicator", o
    for o in outs[:late]:  # the on-time ranks name the late one
        assert late in o["peers"] and f"[{late}]" in o["message"], o
        assert _TIMEOUT <= o["elapsed"] < _TIMEOUT + 1.0, o
    lo = outs[late]
    assert "gave up" in lo["message"] and lo["elapsed"] < 1.0, lo


def punctual_at_the_deadline(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 arrives while rank 0's timeout check runs: whichever way the race
    goes, both ranks agree (both return the right sum, or both raise)."""
    from shm_broadcast.errors import CommTimeout

    results = []
    for i in range(12):
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"),
                               unique_name=f"deadline-{i}", timeout=0.2,
                               workspace_bytes=1 << 20)
        try:
            comm.all_reduce(torch.ones(4))
            dist.barrier()
            if rank == 1:  # about when rank 0's first health check (0.2 s) fires
                time.sleep(0.17 + 0.01 * i)
            try:
                got = comm.all_reduce(torch.full((4,), float(rank + 1)))
                results.append("ok" if torch.equal(got, torch.full((4,), 3.0)) else "WRONG")
            except CommTimeout:
                results.append("timeout")
        finally:
            dist.barrier()
            comm.destroy()
    return {"rank": rank, "results": results}


def test_ranks_agree_on_a_step_reached_at_the_deadline(dist_pool) -> None:
    a, b = dist_pool(2).run(punctual_at_the_deadline)
    assert a["results"] == b["results"], (a, b)
    assert "WRONG" not in a["results"]


class _Interrupted(Exception):
    pass


def interrupted_rank(rank: int, world_size: int, numel: int) -> dict[str, Any]:
    """The last rank's all_reduce is interrupted (a signal handler raises) while
    it waits for the others; it goes on with its next call, as an application
    that caught the exception would. Nobody may return a wrong sum."""
    import signal

    from coordinator.errors import GroupCoordError

    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"),
                           unique_name=f"interrupt-{numel}", timeout=2.0,
                           workspace_bytes=1 << 20)
    total = sum(r + 1 for r in range(world_size))
    out: dict[str, Any] = {"rank": rank, "calls": []}
    saved = signal.getsignal(signal.SIGALRM)
    try:
        comm.all_reduce(torch.ones(4))
        dist.barrier()
        if rank == world_size - 1:
            def _raise(*_: Any) -> None:
                raise _Interrupted("interrupted by the application")
            signal.signal(signal.SIGALRM, _raise)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
        else:
            time.sleep(0.5)
        for scale in (1.0, 1000.0):
            try:
                got = comm.all_reduce(torch.full((numel,), scale * (rank + 1)))
                ok = torch.equal(got, torch.full((numel,), scale * total))
                out["calls"].append("ok" if ok else "WRONG")
            except (GroupCoordError, _Interrupted) as e:
                out["calls"].append(type(e).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved)
        dist.barrier()
        comm.destroy()
    return out


@pytest.mark.parametrize("numel", [8, 600_000], ids=["one-step", "pieces"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=_SLOW)])
def test_an_interrupted_call_breaks_the_communicator_not_the_results(
        dist_pool, world_size: int, numel: int) -> None:
    outs = dist_pool(world_size).run(interrupted_rank, numel)
    assert all("WRONG" not in o["calls"] for o in outs), outs
    assert outs[-1]["calls"] == ["_Interrupted", "BrokenCommunicator"], outs
    # The interrupted rank withdrew its step: the peers, arriving after it left,
    # raise on that call rather than complete it without it.
    for o in outs[:-1]:
        assert o["calls"][0] == "CommTimeout", outs
