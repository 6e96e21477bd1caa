"""destroy() from another thread while a collective runs: no crash, clear errors.

A destroy that lands after a fast path read the engine and before it took the
call's token (the last test) makes that call raise ``CommunicatorClosed`` instead
of copying into the unmapped workspace.

The shared-memory engine copies by address into its workspace, so unmapping it
under a running call crashed the process (SIGSEGV in a ``memmove``). Now
``destroy()`` tells the running call (its wait raises within a health check),
waits for it to leave, and only then unmaps; peers learn that the rank left.

The overlap is made certain: rank 0's worker thread starts a collective and
publishes its step while rank 1 holds back (it waits on the store), then rank
0's main thread destroys the communicator under it; rank 1's call then either
completes with rank 0's published contribution or learns that rank 0 left.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.errors import CommunicatorClosed

#: (name, elements): the one-step small path and the large two-rank path.
_SIZES = {"small": 256, "large": 4 * GRAIN}


def destroyed_rank(rank: int, world_size: int, numel: int, key: str) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="destroyed",
                           timeout=20)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    try:
        for _ in range(3):  # the path's entry and views exist: the call below takes them
            comm.all_reduce(torch.ones(numel))
        if rank == 0:
            gen = comm._flat.sync.gen
            worker_out: dict[str, Any] = {}

            def in_flight() -> None:
                try:
                    comm.all_reduce(torch.ones(numel))
                    worker_out["got"] = "returned"
                except Exception as e:  # reported to the parent
                    worker_out["got"] = type(e).__name__

            worker = threading.Thread(target=in_flight)
            worker.start()
            deadline = time.monotonic() + 30
            while comm._flat.sync.gen == gen and time.monotonic() < deadline:
                time.sleep(0.001)  # published its step: it waits for rank 1 now
            t0 = time.monotonic()
            comm.destroy()
            out["destroy_s"] = time.monotonic() - t0
            worker.join(30)
            out["worker"] = worker_out.get("got", "still running")
            store.set(key, "1")
        else:
            store.wait([key])
            t0 = time.monotonic()
            try:
                got = comm.all_reduce(torch.ones(numel))
                out["peer"] = "sum" if torch.equal(got, torch.full((numel,), 2.0)) else "wrong"
            except Exception as e:  # the parent checks the class
                out["peer"] = type(e).__name__
            out["peer_s"] = time.monotonic() - t0
    finally:
        comm.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", sorted(_SIZES))
def test_destroy_under_a_running_collective(dist_pool, size: str) -> None:
    outs = dist_pool(2).run(destroyed_rank, _SIZES[size], f"destroyed-{uuid.uuid4().hex}",
                            timeout=110)
    mine, peer = outs
    assert mine["worker"] in ("BrokenCommunicator", "CommunicatorClosed", "ClosedError"), mine
    assert mine["destroy_s"] < 5, mine
    # Rank 0's step was published before it left: the peer's call may complete with it
    # (the right sum), or learn that rank 0 left; never a wrong result or a long wait.
    assert peer["peer"] in ("sum", "PeerDiedError") and peer["peer_s"] < 10, peer


def _fast_call(comm: CpuCommunicator, op: str, rank: int) -> Any:
    """``op`` on a layout the communicator keeps (its fast path, no checks)."""
    x = torch.ones(4, 64)
    if op == "all_reduce":
        return comm.all_reduce(x)
    if op == "broadcast":
        return comm.broadcast(x, src=0)
    if op == "gather":
        return comm.gather(x, 1, 0)
    if op == "all_gather":
        return comm.all_gather(x, 0)
    return comm.reduce_scatter(x, 0)


def window_rank(rank: int, world_size: int, op: str) -> dict[str, Any]:
    """Rank 0 destroys its communicator on another thread after the fast path of ``op``
    read the engine and before it took the call's token (the token's take, or the
    communicator's engine call, runs the destroy first, once)."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"window-{op}",
                           timeout=20)
    out: dict[str, Any] = {}
    try:
        for _ in range(3):  # the layout is kept: the next call takes the fast path
            _fast_call(comm, op, rank)
        if rank == 0:
            # all_reduce takes the token itself; the others through _engine_call
            token = comm._one_call
            take, engine_call = token.take, comm._engine_call

            def destroy_first() -> None:
                token.take = take  # once
                del comm._engine_call
                worker = threading.Thread(target=comm.destroy)
                worker.start()
                worker.join()

            def take_late(blocking: bool) -> bool:
                destroy_first()
                return take(blocking)

            def engine_call_late(*args: Any) -> Any:
                destroy_first()
                return engine_call(*args)

            token.take = take_late
            comm._engine_call = engine_call_late  # type: ignore[method-assign]
        try:
            _fast_call(comm, op, rank)
            out["error"] = None
        except CommunicatorClosed:
            out["error"] = "closed"
        except Exception as e:
            out["error"] = type(e).__name__
    finally:
        comm.destroy()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "gather", "all_gather",
                                "reduce_scatter"])
def test_destroy_between_a_fast_paths_checks_and_its_token(dist_pool, op: str) -> None:
    results = dist_pool(2).run(window_rank, op, timeout=50)
    assert results[0]["error"] == "closed", results
    assert results[1]["error"] in ("PeerDiedError", "CollectiveTimeout"), results
