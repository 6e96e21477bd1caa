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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,world_size", [
    pytest.param("shm", 3, marks=pytest.mark.distributed(world_size=3, timeout=80)),
    pytest.param("gloo", 2, marks=pytest.mark.distributed(world_size=2, timeout=80)),
])
def test_a_missing_rank_times_out_naming_it(rank: int, group: Any, transport: str,
                                            world_size: int) -> None:
    from coordinator import GroupCoordinator
    from coordinator.errors import CommTimeout

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="a2av-wait",
                         device_communicator="torch" if transport == "gloo" else None,
                         timeout=TIMEOUT_S)
    x = torch.ones(world_size, 2)
    g.all_to_allv(x, [1] * world_size)  # call 1: everyone
    last = world_size - 1
    error = None
    if rank != last:
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as caught:
            g.all_to_allv(x, [1] * world_size)  # call 2: the last rank is not there
        elapsed, error = time.monotonic() - t0, caught.value
    group.barrier(timeout=30)  # the skipper leaves only once the others gave up
    g.destroy()
    if rank == last:
        assert error is None
        return
    assert type(error).__name__ == "CommTimeout", error
    assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + 2.0, elapsed
    assert getattr(error, "op", None) == "all_to_allv" and getattr(error, "call", None) == 2
    assert "a2av-wait" in str(error) and "all_to_allv" in str(error), str(error)
    assert last in list(error.peers), list(error.peers)
