"""``destroy()`` on one thread ends the collective another thread is blocked in.

A watchdog thread destroys the group while the rank's main thread waits in a
collective its peer never joins. Calls that wait in gloo (a barrier, an
object broadcast, an all-reduce without the shared-memory engine) used to
sit there until the group's timeout (or complete after ``destroy()``
returned, once the peer came); now they raise ``ClosedError`` within about a
second, whatever the transport.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from tests.coordinator.rank_checks import env_set

pytestmark = pytest.mark.timeout(120)

_GROUP_TIMEOUT = 30.0

CASES = {
    "barrier-shm": ("barrier", "1"),
    "broadcast_object-gloo": ("broadcast_object", "0"),
    "all_reduce-gloo": ("all_reduce", "0"),
    "all_reduce-shm": ("all_reduce", "1"),
}


def destroyed_under_a_call(rank: int, world_size: int, op: str, shm: str) -> dict[str, Any]:
    from coordinator import GroupCoordinator
    from coordinator.errors import ClosedError

    with env_set("GROUPCOORD_CPU_SHM", shm):
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=f"watchdog-{op}-{shm}", timeout=_GROUP_TIMEOUT)
    g.all_reduce(torch.ones(4))
    out: dict[str, Any] = {}
    if rank == 0:
        watchdog = threading.Timer(1.0, g.destroy)
        watchdog.start()
        start = time.monotonic()
        try:
            if op == "barrier":
                g.barrier()
            elif op == "broadcast_object":
                g.broadcast_object(None, 1)
            elif op == "all_reduce":
                g.all_reduce(torch.ones(8))
            else:
                g.all_gather(torch.ones(8), 0)
            out["error"] = None
        except ClosedError as e:
            out["error"] = "ClosedError"
            out["message"] = str(e)
        out["ended_after"] = time.monotonic() - start
        watchdog.join()
    else:
        time.sleep(4.0)  # joins no call of the group; leaves it after rank 0 did
        g.destroy()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_watchdogs_destroy_ends_the_blocked_call(dist_pool: Any, case: str) -> None:
    op, shm = CASES[case]
    outs = dist_pool(2).run(destroyed_under_a_call, op, shm, timeout=100)
    got = outs[0]
    assert got["error"] == "ClosedError", got
    assert got["ended_after"] < 3.5, got  # the destroy came at 1 s; the timeout is 30 s
    assert f"op {op}" in got["message"] and "destroyed while this call was running" in \
        got["message"], got
    assert "within" not in got["message"], got  # no timeout that never ran out
