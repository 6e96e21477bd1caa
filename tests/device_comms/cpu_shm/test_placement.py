"""A waiting rank moves off a CPU a peer with a lower index waits on, to another CPU.

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
from device_comms.cpu_shm.placement import (
    MOVE_EVERY,
    MOVE_MAX,
    SPREAD_ENV,
    CpuSpread,
    current_cpu,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs this process may run on",
)

_MINE, _PEER, _THIRD = 10, 26, 42  # the words of three ranks' records (lines of 16 words)


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
    """A spread of local rank ``local_rank`` whose peer of the other index records in
    ``_PEER`` (and, with three ranks, the third in ``_THIRD``)."""
    hdr = np.zeros(64, dtype=np.int64)
    others = [r for r in range(local_size) if r != local_rank][:2]
    peers = list(zip(others, [_PEER, _THIRD], strict=False))
    return CpuSpread(hdr, _MINE, peers, local_rank, local_size, **kw), hdr


class _Clock:
    """A monotonic clock the test advances (the spacing of moves is in seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("peer_age", [0, 1], ids=["same-step", "step-before"])
def test_leaves_a_cpu_a_lower_peer_waits_on(allowed: list[int], peer_age: int) -> None:
    # The case needs this thread still on the peer's CPU when it records its wait; on
    # a loaded machine the scheduler may move it in between: then the case is rebuilt.
    for _ in range(100):
        spread, hdr = _spread()
        _on(allowed[0], allowed)
        shared = current_cpu()
        hdr[_PEER] = _record(7 - peer_age, shared)
        spread.waiting(7)
        if hdr[_MINE] == _record(7, shared):  # it waited where the peer did
            break
    else:
        pytest.fail("the scheduler moved this thread before every one of 100 waits")
    assert spread.moves == 1
    assert sorted(os.sched_getaffinity(0)) == allowed  # nothing stays pinned


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3, reason="needs three CPUs")
def test_avoids_the_cpus_other_peers_wait_on(allowed: list[int]) -> None:
    spread, hdr = _spread(local_rank=2, local_size=3)
    _on(allowed[0], allowed)
    hdr[_PEER] = _record(5, allowed[0])  # rank 0 shares this CPU
    hdr[_THIRD] = _record(5, allowed[1])  # rank 1 waits on another
    spread.waiting(5)
    assert spread.moves == 1
    assert current_cpu() not in (allowed[0], allowed[1])


@pytest.mark.parametrize("case", ["lower-index", "stale-peer", "peer-elsewhere",
                                  "no-peer-record", "disabled", "disabled-by-env"])
def test_stays_where_it_is(allowed: list[int], case: str,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "disabled-by-env":
        monkeypatch.setenv(SPREAD_ENV, "0")
    spread, hdr = _spread(local_rank=0 if case == "lower-index" else 1,
                          enabled=False if case == "disabled" else None)
    _on(allowed[0], allowed)
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
        assert not spread.active and hdr[_MINE] == 0  # no record either
    else:
        assert hdr[_MINE] == _record(7, cpu)


def test_moves_are_spaced_and_back_off(allowed: list[int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(placement, "time", clock)
    spread, hdr = _spread()
    moved_at: list[float] = []
    for gen in range(2, 402):  # a shared CPU every 2.5 ms for 1 s: the kernel undoes each move
        clock.now += 0.0025
        _on(allowed[0], allowed)
        hdr[_PEER] = _record(gen, current_cpu())
        before = spread.moves
        spread.waiting(gen)
        if spread.moves > before:
            moved_at.append(clock.now)
    gaps = [b - a for a, b in zip(moved_at, moved_at[1:], strict=False)]
    assert gaps and gaps[0] >= MOVE_EVERY
    assert all(b >= a - 1e-9 for a, b in zip(gaps, gaps[1:], strict=False))  # never closer
    assert gaps[-1] >= MOVE_MAX - 0.003  # spaced out to the longest
    assert len(moved_at) <= 20  # about 8 while backing off, then one per MOVE_MAX
    clock.now += 10 * MOVE_MAX  # quiet for a while: the next move comes at once again
    _on(allowed[0], allowed)
    hdr[_PEER] = _record(500, current_cpu())
    before = spread.moves
    spread.waiting(500)
    assert spread.moves == before + 1


def test_no_spread_when_ranks_outnumber_cpus(allowed: list[int]) -> None:
    spread, hdr = _spread(local_rank=1, local_size=len(allowed) + 1)
    assert not spread.active
    hdr[_PEER] = _record(2, current_cpu())
    spread.waiting(2)
    assert spread.moves == 0


def test_a_narrowed_affinity_is_respected(allowed: list[int]) -> None:
    spread, hdr = _spread()
    narrowed = {allowed[0]}
    os.sched_setaffinity(0, narrowed)  # the caller pins the thread after set-up
    hdr[_PEER] = _record(4, current_cpu())
    spread.waiting(4)
    assert spread.moves == 0
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
        for _ in range(800):
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
