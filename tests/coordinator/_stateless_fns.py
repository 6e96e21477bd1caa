"""Rank functions for test_stateless_group (module-level so ranks can import them)."""

from __future__ import annotations

import time

import torch.distributed as dist

from coordinator import StatelessProcessGroup
from coordinator.errors import CommTimeout
from coordinator.parallel_state import in_the_same_node_as


def exercise(rank: int, world_size: int, port_a: int, port_b: int) -> dict:
    world_before = dist.get_world_size()
    a = StatelessProcessGroup.create("127.0.0.1", port_a, rank, world_size, timeout=30, name="a")
    # A second, independent group in the same process: only ranks 0 and 1.
    b = None
    if rank < 2:
        b = StatelessProcessGroup.create("127.0.0.1", port_b, rank, 2, timeout=30, name="b")
    out: dict = {}
    # p2p ring, twice, so sequence numbers advance.
    for i in range(2):
        a.send_obj({"from": rank, "i": i}, dst=(rank + 1) % world_size)
        out[f"ring{i}"] = a.recv_obj(src=(rank - 1) % world_size)
    out["bcast"] = [a.broadcast_obj(f"x{src}" if rank == src else None, src=src) for src in range(world_size)]
    out["gather"] = a.all_gather_obj(rank * 10)
    a.barrier()
    if b is not None:
        out["b_gather"] = b.all_gather_obj(("b", rank))
        b.barrier()
    out["same_node"] = in_the_same_node_as(a, source_rank=0)
    a.barrier()
    if rank == 0:
        time.sleep(0.2)  # let the last readers finish their cleanup
        out["keys_left"] = a.store.num_keys()
    a.barrier()
    out["world_unchanged"] = dist.get_world_size() == world_before
    return out


def barrier_timeout(rank: int, world_size: int, port: int) -> dict:
    g = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=30, name="t")
    g.barrier()
    if rank == world_size - 1:
        time.sleep(6.0)  # skip the second barrier until the others gave up
        return {"skipped": True}
    t0 = time.monotonic()
    try:
        g.barrier(timeout=2.0)
    except CommTimeout as e:
        return {"elapsed": time.monotonic() - t0, "msg": str(e), "is_timeout": isinstance(e, TimeoutError)}
    return {"elapsed": None}
