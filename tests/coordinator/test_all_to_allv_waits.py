"""A group's all_to_allv waits at most the group's timeout, and says who is missing.

The last rank skips the call; the others must raise ``CommTimeout`` after the
group's 2 s (not before), naming the group, the op, its call number and (on
shared memory, which knows) the missing rank. Shared memory (world size 3)
and plain gloo (world size 2; gloo names nobody, so the side check names the
running peers).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

TIMEOUT_S = 2.0


def skip_one(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    from coordinator import GroupCoordinator
    from coordinator.errors import CommTimeout
    from coordinator.parallel_state import get_world_group

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="a2av-wait",
                         device_communicator="torch" if transport == "gloo" else None,
                         timeout=TIMEOUT_S)
    x = torch.ones(world_size, 2)
    g.all_to_allv(x, [1] * world_size)  # call 1: everyone
    rec: dict[str, Any] = {"error": None}
    if rank != world_size - 1:
        t0 = time.monotonic()
        try:
            g.all_to_allv(x, [1] * world_size)  # call 2: the last rank is not there
        except CommTimeout as e:
            rec = {"error": type(e).__name__, "elapsed": time.monotonic() - t0, "text": str(e),
                   "peers": list(e.peers), "op": getattr(e, "op", None),
                   "call": getattr(e, "call", None)}
    get_world_group().barrier(timeout=30)  # the skipper leaves only once the others gave up
    g.destroy()
    return rec


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,world_size", [("shm", 3), ("gloo", 2)])
def test_a_missing_rank_times_out_naming_it(dist_pool: Any, transport: str,
                                            world_size: int) -> None:
    results = dist_pool(world_size).run(skip_one, transport, timeout=80)
    last = world_size - 1
    for rank, r in enumerate(results[:-1]):
        assert r["error"] == "CommTimeout", (rank, r)
        assert TIMEOUT_S - 0.1 <= r["elapsed"] <= TIMEOUT_S + 2.0, r["elapsed"]
        assert r["op"] == "all_to_allv" and r["call"] == 2, r
        assert "a2av-wait" in r["text"] and "all_to_allv" in r["text"], r["text"]
        assert last in r["peers"], r["peers"]
    assert results[-1]["error"] is None
