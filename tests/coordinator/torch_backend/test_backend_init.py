"""``dist.init_process_group("groupcoord")`` itself, in fresh rank processes.

The harness initialises the default group with the backend named (after
``import coordinator``, which registers it), so the world group is ours.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.testing import run_distributed


def _world_is_ours(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from coordinator.torch_backend import GroupcoordProcessGroup

    pg = dist.group.WORLD
    t = torch.full((3, 2), float(rank + 1))
    dist.all_reduce(t)
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    x = torch.arange(world * 2, dtype=torch.float32) + rank
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, x)
    dist.barrier()
    comm = pg.communicator
    served = sum(comm.shm_calls.values())  # the three calls above
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    sent = [{"from": rank}]
    dist.broadcast_object_list(sent, src=world - 1)
    mesh_group = init_device_mesh("cpu", (world,)).get_group()
    sub = dist.new_group(list(range(world)), backend="cpu:groupcoord")
    s = torch.ones(2)
    dist.all_reduce(s, group=sub)
    return {
        "type": type(pg).__name__ if isinstance(pg, GroupcoordProcessGroup) else "not ours",
        "backend": dist.get_backend(), "sub_backend": dist.get_backend(sub),
        "sum": t.flatten().tolist(), "gathered": [v.tolist() for v in outs],
        "rs": o.tolist(), "mode": comm.mode, "served": served,
        "sub": s.tolist(), "objs": objs, "sent": sent,
        "mesh": isinstance(mesh_group, GroupcoordProcessGroup),
    }


def _check(results: list[dict[str, Any]], world: int, backend: str, mode: str = "shm") -> None:
    total = float(sum(range(1, world + 1)))
    for rank, r in enumerate(results):
        assert r["type"] == "GroupcoordProcessGroup"
        assert r["backend"] == backend and r["sub_backend"] == "cpu:groupcoord"
        assert r["sum"] == [total] * 6
        assert r["gathered"] == [[float(i)] * 2 for i in range(world)]
        base = float(sum(range(world)))
        assert r["rs"] == [world * (2 * rank + j) + base for j in range(2)]
        assert r["mode"] == mode
        if mode == "shm":
            assert r["served"] == 3  # the barrier is not counted
        assert r["sub"] == [float(world)] * 2
        assert r["objs"] == [{"rank": i} for i in range(world)]
        assert r["sent"] == [{"from": world - 1}] and r["mesh"]


def test_init_process_group_groupcoord() -> None:
    _check(run_distributed(_world_is_ours, 2, backend="groupcoord", timeout=120), 2, "groupcoord")


@pytest.mark.slow
def test_init_process_group_cpu_device_string_world_4() -> None:
    _check(run_distributed(_world_is_ours, 4, backend="cpu:groupcoord", timeout=180), 4,
           "cpu:groupcoord")


@pytest.mark.slow
def test_init_process_group_simulated_hosts_world_4() -> None:
    """Two simulated hosts of two ranks: all-reduce runs hierarchically, the rest on gloo."""
    env = [{"GROUPCOORD_NODE_ID": f"host{r // 2}"} for r in range(4)]
    _check(run_distributed(_world_is_ours, 4, backend="groupcoord", timeout=180, env=env), 4,
           "groupcoord", mode="hierarchical")
