"""A waiting rank moves off a CPU a peer waits on, to its own CPU of the spread.

:class:`CpuSpread` runs here on this process's real thread, with the real
``sched_getcpu`` and affinity calls, over a header of int64 words like the
workspace's. A peer's record is written as a peer writes it. Each case checks
whether the thread moved (and where it runs afterwards), that the affinity
it had is back, and what the record says. The last test runs two real ranks
that start on one CPU and checks the engine moved one of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator
from device_comms.cpu_shm import placement
from device_comms.cpu_shm.placement import MOVE_EVERY, SPREAD_ENV, CpuSpread, current_cpu

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs this process may run on",
)

_MINE, _PEER = 10, 26  # the words of two ranks' records (lines of 16 words)


def _record(gen: int, cpu: int) -> int:
    return (gen << 16) | (cpu + 1)


@pytest.fixture
def allowed() -> Iterator[list[int]]:
    """This thread's CPUs, given back after the test whatever it did."""
    mask = os.sched_getaffinity(0)
    try:
        yield sorted(mask)
    finally:
        os.sched_setaffinity(0, mask)


def _on(cpu: int, allowed: list[int]) -> None:
    """Run this thread on ``cpu`` now, without keeping it pinned there."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setaffinity(0, allowed)


def _spread(local_rank: int = 1, local_size: int = 2, **kw: Any) -> tuple[CpuSpread, Any]:
    hdr = np.zeros(32, dtype=np.int64)
    return CpuSpread(hdr, _MINE, [_PEER], local_rank, local_size, **kw), hdr


def test_targets_spread_the_allowed_cpus(allowed: list[int]) -> None:
    n = len(allowed)
    targets = [_spread(rank, n)[0].target for rank in range(n)]
    assert targets == allowed  # one CPU each when there are as many ranks as CPUs
    assert [_spread(rank, 2)[0].target for rank in range(2)] == [allowed[0], allowed[n // 2]]


@pytest.mark.parametrize("peer_age", [0, 1], ids=["same-step", "step-before"])
def test_moves_to_its_cpu_when_a_peer_waits_on_this_one(allowed: list[int],
                                                        peer_age: int) -> None:
    spread, hdr = _spread()
    other = allowed[0]
    assert spread.target != other
    _on(other, allowed)
    hdr[_PEER] = _record(7 - peer_age, current_cpu())
    spread.waiting(7)
    assert spread.moves == 1
    assert current_cpu() == spread.target
    assert sorted(os.sched_getaffinity(0)) == allowed  # nothing stays pinned
    assert hdr[_MINE] == _record(7, other)  # where it waited


@pytest.mark.parametrize("case", ["stale-peer", "peer-elsewhere", "no-peer-record",
                                  "already-on-target", "disabled", "disabled-by-env"])
def test_stays_where_it_is(allowed: list[int], case: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "disabled-by-env":
        monkeypatch.setenv(SPREAD_ENV, "0")
    spread, hdr = _spread(enabled=False if case == "disabled" else None)
    here = spread.target if case == "already-on-target" else allowed[0]
    assert here is not None or case.startswith("disabled")
    _on(here if here is not None else allowed[0], allowed)
    cpu = current_cpu()
    if case == "stale-peer":
        hdr[_PEER] = _record(5, cpu)
    elif case == "peer-elsewhere":
        hdr[_PEER] = _record(7, allowed[-1] if cpu != allowed[-1] else allowed[0])
    elif case != "no-peer-record":
        hdr[_PEER] = _record(7, cpu)
    spread.waiting(7)
    assert spread.moves == 0
    if case.startswith("disabled"):
        assert spread.target is None and hdr[_MINE] == 0  # no record either
    else:
        assert hdr[_MINE] == _record(7, cpu)


def test_one_move_per_interval(allowed: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    assert MOVE_EVERY <= 0.01  # short enough to leave a shared CPU within a few steps
    monkeypatch.setattr(placement, "MOVE_EVERY", 60.0)  # the second wait comes within it
    spread, hdr = _spread()
    for gen in (3, 4):
        _on(allowed[0], allowed)
        hdr[_PEER] = _record(gen, current_cpu())
        spread.waiting(gen)
    assert spread.moves == 1


def test_no_spread_when_ranks_outnumber_cpus(allowed: list[int]) -> None:
    spread, hdr = _spread(local_rank=0, local_size=len(allowed) + 1)
    assert spread.target is None
    hdr[_PEER] = _record(2, current_cpu())
    spread.waiting(2)
    assert spread.moves == 0


def test_a_narrowed_affinity_is_respected(allowed: list[int]) -> None:
    spread, hdr = _spread()
    narrowed = {allowed[0]}
    assert spread.target not in narrowed
    os.sched_setaffinity(0, narrowed)  # the caller pins the thread after set-up
    hdr[_PEER] = _record(4, current_cpu())
    spread.waiting(4)
    assert spread.moves == 0 and spread.target is None
    assert os.sched_getaffinity(0) == narrowed


# ---------------------------------------------------------------- two real ranks
def co_located_rank(rank: int, world_size: int) -> tuple[int, int, int]:
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="placement")
    try:
        os.sched_setaffinity(0, {first})  # both ranks start on one CPU ...
        comm.barrier()
        os.sched_setaffinity(0, allowed)  # ... and are free to leave it
        x = torch.ones(1024)
        for _ in range(2000):
            comm.all_reduce(x)
        moves = int(comm.describe()["cpu_moves"])
        comm.barrier()
        return moves, current_cpu(), len(allowed)
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
def test_ranks_started_on_one_cpu_are_spread(dist_pool: Any) -> None:
    results = dist_pool(2).run(co_located_rank, timeout=50)
    moves = sum(m for m, _, _ in results)
    cpus = {cpu for _, cpu, _ in results}
    # Left alone, two ranks handing one CPU to each other stay on it; on a busy
    # machine the kernel may separate them first (or bring them back together,
    # and a rank moves again).
    assert moves >= 1 or len(cpus) == 2, results
