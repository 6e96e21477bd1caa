"""A second thread's collective on a communicator that is in a collective is refused.

The shared-memory engine keeps one step counter and one slot per rank, so two
threads of one rank in collectives at once wrote each other's slot and took
each other's steps: both returned silently wrong sums (or waited for the
timeout). Now a collective called while another thread's collective of the
same communicator is in flight raises
:class:`~device_comms.errors.ConcurrentCallError` at once, before touching
shared memory, and the call in flight completes with the right result.

The test makes the overlap certain: rank 0 starts an all_reduce on a thread,
waits until that thread published its step (the peers hold back theirs until
rank 0 says so through the store), then calls every kind of collective from
its main thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp
from device_comms.cpu_shm.engine_threads import GRAIN

_N = 256


def _calls(comm: Any, n: int) -> dict[str, Callable[[], Any]]:
    """Every way into the communicator's collectives (world size ``n``)."""
    x = torch.ones(_N)
    return {
        "all_reduce-fast-path": lambda: comm.all_reduce(torch.ones(_N)),
        "all_reduce-in-place": lambda: comm.all_reduce(x, out=x),
        "all_reduce-large": lambda: comm.all_reduce(torch.ones(2 * GRAIN)),
        "all_reduce-out": lambda: comm.all_reduce(torch.ones(_N), out=torch.empty(_N)),
        "all_reduce-max": lambda: comm.all_reduce(torch.ones(_N), ReduceOp.MAX),
        "all_gather": lambda: comm.all_gather(torch.ones(3), 0),
        "all_gatherv": lambda: comm.all_gatherv(torch.ones(2, 1), 0, [2] * n),
        "reduce_scatter": lambda: comm.reduce_scatter(torch.ones(2 * n), 0),
        "reduce": lambda: comm.reduce(torch.ones(3), 0),
        "broadcast": lambda: comm.broadcast(torch.ones(3), 0),
        "gather": lambda: comm.gather(torch.ones(3), 0, 0),
        "all_to_allv": lambda: comm.all_to_allv(torch.ones(n, 2), [1] * n),
        "scatter": lambda: comm.scatter(torch.ones(n), 0, 0),
        "all_to_all": lambda: comm.all_to_all(torch.ones(n), 0, 0),
        "barrier": lambda: comm.barrier(),
    }


def concurrent_rank(rank: int, world_size: int, done_key: str) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="two-threads",
                           timeout=20)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {"refused": {}}
    try:
        for _ in range(3):  # the small all_reduce's entry and its views of this address
            comm.all_reduce(torch.ones(_N))
        first: dict[str, Any] = {}
        if rank == 0:
            gen = comm._flat.sync.gen

            def in_flight() -> None:
                try:
                    first["got"] = comm.all_reduce(torch.full((_N,), 2.0))
                except Exception as e:  # reported to the parent
                    first["got"] = f"{type(e).__name__}: {e}"

            worker = threading.Thread(target=in_flight)
            worker.start()
            deadline = time.monotonic() + 30
            while comm._flat.sync.gen == gen and time.monotonic() < deadline:
                time.sleep(0.001)  # the worker published its step and waits for the peers
            for name, call in _calls(comm, world_size).items():
                t0 = time.monotonic()
                try:
                    call()
                    got = "ok"
                except Exception as e:  # the parent checks the class
                    got = f"{type(e).__name__}: {str(e)[:200]}"
                out["refused"][name] = (got, time.monotonic() - t0)
            store.set(done_key, "1")
            worker.join()
        else:
            store.wait([done_key])
            first["got"] = comm.all_reduce(torch.full((_N,), 2.0))
        out["first"] = first["got"]
        out["after"] = comm.all_reduce(torch.full((7,), float(rank + 1))).tolist()
    finally:
        comm.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_second_thread_is_refused_and_first_call_completes(dist_pool, world_size: int) -> None:
    # The pool's store outlives the run: a key of this run's own, never set before.
    outs = dist_pool(world_size).run(concurrent_rank, f"two-threads-done-{uuid.uuid4().hex}",
                                     timeout=110)
    want = torch.full((_N,), 2.0 * world_size)
    for rank, o in enumerate(outs):
        assert isinstance(o["first"], torch.Tensor) and torch.equal(o["first"], want), (
            rank, o["first"])
        assert o["after"] == [float(sum(range(1, world_size + 1)))] * 7, (rank, o["after"])
    refused = outs[0]["refused"]
    assert set(refused) == set(_calls(None, world_size))
    bad = {name: got for name, (got, elapsed) in refused.items()
           if not got.startswith("ConcurrentCallError") or "another thread" not in got
           or elapsed > 1.0}
    assert not bad, bad
