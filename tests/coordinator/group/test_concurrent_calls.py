"""A second thread's collective on a group that is in a collective is refused, and
the group stays in step.

The ranks pair their calls by the group's call numbers. A call refused with
:class:`~coordinator.errors.ConcurrentCallError` used to take a number all the
same (the group numbered it before its communicator refused it), and a gloo
call from a second thread (a barrier, an object broadcast) was not refused at
all and renumbered the call in flight: either way the rank stayed one call
ahead of its peers, and every later call raised ``CollectiveMismatch``. Now
the group takes its token before numbering, so the refused call leaves no
trace: the call in flight completes with the right result, and the calls
after it too.

Rank 0 starts an all_reduce on a thread and waits until that call is numbered
(the peers hold theirs back until rank 0 says so through the store), then
makes every kind of collective from its main thread.
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

from tests.coordinator.rank_checks import env_set

_N = 1 << 16  # above the small-message path of the shared-memory engine


def _calls(g: Any, n: int) -> dict[str, Callable[[], Any]]:
    """Every kind of the group's collectives (world size ``n``)."""
    return {
        "all_reduce": lambda: g.all_reduce(torch.ones(8)),
        "all_reduce-out": lambda: g.all_reduce(torch.ones(8), out=torch.empty(8)),
        "all_gather": lambda: g.all_gather(torch.ones(3), 0),
        "all_gatherv": lambda: g.all_gatherv(torch.ones(2, 1), 0, [2] * n),
        "reduce_scatter": lambda: g.reduce_scatter(torch.ones(2 * n), 0),
        "gather": lambda: g.gather(torch.ones(3), 0),
        "broadcast": lambda: g.broadcast(torch.ones(3), 0),
        "all_to_all": lambda: g.all_to_all(torch.ones(n), 0, 0),
        "barrier": lambda: g.barrier(),
        "broadcast_object": lambda: g.broadcast_object("x", 0),
        "broadcast_object_list": lambda: g.broadcast_object_list(["x"], 0),
        "broadcast_tensor_dict": lambda: g.broadcast_tensor_dict({"a": torch.ones(2)}, 0),
    }


def concurrent_group_rank(rank: int, world_size: int, transport: str,
                          done_key: str) -> dict[str, Any]:
    from coordinator import GroupCoordinator

    with env_set("GROUPCOORD_CPU_SHM", "1" if transport == "shm" else "0"):
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, True,
                             group_name=f"threads-{transport}", timeout=20.0)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {"refused": {}}
    try:
        g.all_reduce(torch.ones(4))
        first: dict[str, Any] = {}
        if rank == 0:
            numbered = g.collectives

            def in_flight() -> None:
                try:
                    first["got"] = g.all_reduce(torch.full((_N,), 2.0))
                except Exception as e:  # reported to the parent
                    first["got"] = f"{type(e).__name__}: {e}"

            worker = threading.Thread(target=in_flight)
            worker.start()
            deadline = time.monotonic() + 30
            while g.collectives == numbered and time.monotonic() < deadline:
                time.sleep(0.001)  # the worker's call is numbered: it holds the group
            for name, call in _calls(g, world_size).items():
                t0 = time.monotonic()
                try:
                    call()
                    got = "ok"
                except Exception as e:  # the parent checks the class
                    got = f"{type(e).__name__}: {str(e)[:200]}"
                out["refused"][name] = (got, time.monotonic() - t0)
            out["numbered"] = g.collectives - numbered
            store.set(done_key, "1")
            worker.join()
        else:
            store.wait([done_key])
            first["got"] = g.all_reduce(torch.full((_N,), 2.0))
        out["first"] = first["got"]
        out["after"] = [g.all_reduce(torch.full((5,), float(rank + k))).tolist()
                        for k in range(3)]
        out["object"] = g.broadcast_object(f"from {rank}", world_size - 1)
    finally:
        g.destroy()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_refused_call_leaves_the_group_in_step(dist_pool, world_size: int,
                                                 transport: str) -> None:
    outs = dist_pool(world_size).run(concurrent_group_rank, transport,
                                     f"group-threads-done-{uuid.uuid4().hex}", timeout=140)
    want = torch.full((_N,), 2.0 * world_size)
    for rank, o in enumerate(outs):
        assert isinstance(o["first"], torch.Tensor) and torch.equal(o["first"], want), (
            rank, o["first"])
        assert o["after"] == [[float(sum(r + k for r in range(world_size)))] * 5
                              for k in range(3)], (rank, o["after"])
        assert o["object"] == f"from {world_size - 1}"
    refused = outs[0]["refused"]
    assert set(refused) == set(_calls(None, world_size))
    bad = {name: got for name, (got, elapsed) in refused.items()
           if not got.startswith("ConcurrentCallError") or "another thread" not in got
           or elapsed > 2.0}
    assert not bad, bad
    assert outs[0]["numbered"] == 1  # only the call in flight took a number
