"""A mismatched, rejected or skipped call on a groupcoord group raises on every rank.

Each rank returns what it raised (type name and text) and whether the group
still gives right results afterwards; the group of the file's first test is
reused (it stays usable after a mismatch), the timeout case gets its own.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.coordinator.torch_backend import cases

WORLDS = (2, 3)


def _mismatch(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank 0 and the others make different calls (``kind`` says how)."""
    pg = cases.group()
    first = rank == 0
    try:
        if kind == "shape":
            dist.all_reduce(torch.ones(4 if first else 5), group=pg)
        elif kind == "dtype":
            dist.all_reduce(torch.ones(4, dtype=torch.float32 if first else torch.float64),
                            group=pg)
        elif kind == "reduce_op":
            dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM if first else dist.ReduceOp.MAX,
                            group=pg)
        elif kind == "op":
            if first:
                dist.all_reduce(torch.ones(4), group=pg)
            else:
                dist.broadcast(torch.ones(4), src=0, group=pg)
        elif kind == "root":
            dist.broadcast(torch.ones(4), src=0 if first else 1, group=pg)
        elif kind == "skipped":  # rank 0 makes one call more than the others
            if first:
                dist.all_reduce(torch.ones(4), group=pg)
            dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4), group=pg)
        elif kind == "bad_list":  # one rank's own arguments are wrong
            n = world + 1 if first else world
            dist.all_gather([torch.empty(4) for _ in range(n)], torch.ones(4), group=pg)
        elif kind == "bad_op":
            op = dist.ReduceOp.BAND if first else dist.ReduceOp.SUM
            dist.all_reduce(torch.ones(4), op, group=pg)
        elif kind == "premul_sum":
            op = dist._make_nccl_premul_sum(2.0) if first else dist.ReduceOp.SUM
            dist.all_reduce(torch.ones(4), op, group=pg)
        else:
            raise AssertionError(kind)
        raised = None
    except Exception as e:
        raised = (type(e).__name__, str(e))
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=pg)
    return {"raised": raised, "after": t.tolist()}


_KINDS = ["shape", "dtype", "reduce_op", "op", "root", "skipped", "bad_list", "bad_op",
          "premul_sum"]
#: what the rank with the bad arguments raises, and what names the argument
_OWN = {"bad_list": ("ValueError", "output_tensor_list"), "bad_op": ("TypeError", "BAND"),
        "premul_sum": ("TypeError", "PREMUL_SUM")}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", _KINDS)
def test_mismatch_raises_on_every_rank(pools: Callable[[int], Any], kind: str,
                                       world: int) -> None:
    results = pools(world).run(_mismatch, kind, timeout=60)
    want = float(sum(range(world)))
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} raised nothing for {kind}"
        assert res["after"] == [want] * 3, f"rank {rank}: the group is broken after {kind}"
    name, text = results[0]["raised"]
    if kind in _OWN:
        assert (name, _OWN[kind][1] in text) == (_OWN[kind][0], True), results[0]["raised"]
        assert {r["raised"][0] for r in results[1:]} == {"PeerRejectedError"}
    else:
        assert {r["raised"][0] for r in results} <= {"CollectiveMismatch", "PeerRejectedError"}


def _one_rank_absent(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 calls all_reduce on a group of a 1 s timeout; the others never do."""
    import time

    import coordinator  # noqa: F401 - registers the backend

    pg = dist.new_group(backend="groupcoord", timeout=datetime.timedelta(seconds=1))
    dist.barrier(group=pg)  # the communicator is built: the timeout is the wait itself
    raised, took = None, 0.0
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=pg)
        except Exception as e:
            raised = type(e).__name__
        took = time.monotonic() - t0
    dist.barrier()  # the gloo world: the others keep their group open until rank 0 is done
    dist.destroy_process_group(pg)
    return {"raised": raised, "took": took}


def test_absent_rank_times_out(dist_pool: Callable[[int], Any]) -> None:
    results = dist_pool(2).run(_one_rank_absent, timeout=60)
    assert results[0]["raised"] == "CommTimeout", results
    assert results[0]["took"] < 10.0


def _peer_killed(rank: int, world: int, op: str) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself while rank 0 waits for it in ``op`` on a group of a
    20 s timeout: rank 0 must raise PeerDiedError promptly, naming the group."""
    import os
    import signal
    import time

    import coordinator  # noqa: F401 - registers the backend

    pg = dist.new_group(backend="groupcoord", timeout=datetime.timedelta(seconds=20))
    dist.all_reduce(torch.ones(4), group=pg)
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        if op == "all_reduce":
            dist.all_reduce(torch.ones(4), group=pg)
        elif op == "scatter":  # on gloo, after a shared-memory agreement step
            dist.scatter(torch.empty(4), [torch.ones(4)] * world, src=0, group=pg)
        elif op == "recv":
            dist.recv(torch.empty(4), src=1, group=pg)
        else:
            dist.barrier(group=pg)
        return {"raised": None}
    except Exception as e:
        return {"raised": type(e).__name__, "text": str(e), "took": time.monotonic() - t0}


@pytest.mark.slow
@pytest.mark.parametrize("op", ["all_reduce", "scatter", "recv", "barrier"])
def test_dead_peer_raises_promptly(op: str) -> None:
    from shm_broadcast.ranks.launcher import spawn_group

    outs = spawn_group(_peer_killed, 2, (op,), timeout=60)
    assert outs[0].ok, outs[0].error
    res = outs[0].result
    assert res["raised"] == "PeerDiedError", res
    assert res["took"] < 5.0, res
    assert "group '" in res["text"], res
