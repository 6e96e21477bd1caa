"""``destroy()`` ends the group's sockets and threads before it returns, also when
another thread of the rank was blocked in one of its collectives.

The blocked call fails with ``ClosedError`` (this rank destroyed first) or
``PeerDiedError`` (its peers did). Its error used to sit in a reference cycle
with the frames that raised it (a frame holding the error its traceback
holds), which kept the communicator, and through it the gloo process group's
sockets and threads, alive until the garbage collector ran: a process with
the collector off, or tuned down, kept a listening socket and three threads
per destroyed group.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return n


def blocked_then_destroyed(rank: int, world_size: int, op: str, first: str) -> dict[str, Any]:
    """The last rank's thread blocks in ``op``; ``first``: which destroys first, the
    blocked rank (its call raises ClosedError) or its peers (PeerDiedError)."""
    from coordinator import GroupCoordinator
    from coordinator.errors import ClosedError, PeerDiedError

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # what is left must be left without the collector's help
    try:
        before = (_sockets(), threading.active_count())
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=f"release-{op}", timeout=30)
        g.all_reduce(torch.ones(4))
        got: list[str] = []
        th = None
        if rank == world_size - 1:  # the others never enter: this call blocks
            def call() -> None:
                try:
                    if op == "all_reduce":
                        g.all_reduce(torch.ones(16))
                    else:
                        g.all_gather(torch.ones(16), 0)
                except (ClosedError, PeerDiedError) as e:
                    got.append(type(e).__name__)
                except BaseException as e:
                    got.append(type(e).__name__)

            th = threading.Thread(target=call)
            th.start()
        blocked_first = first == "blocked-rank"
        if th is not None and not blocked_first:
            th.join(30)  # ends when the peers destroy theirs
        time.sleep(1.0 if (th is not None) == blocked_first else 2.0)
        g.destroy()
        if th is not None:
            th.join(30)
        g = None  # its last reference here
        after = (_sockets(), threading.active_count())
        return {"before": before, "after": after, "blocked": got}
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first,raised", [("blocked-rank", "ClosedError"),
                                          ("peers", "PeerDiedError")])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_destroy_with_a_blocked_call_leaves_no_socket_or_thread(dist_pool, world_size, op,
                                                                first, raised) -> None:
    results = dist_pool(world_size).run(blocked_then_destroyed, op, first, timeout=100)
    for rank, r in enumerate(results):
        # (fewer is fine: a pool rank's earlier test may still be letting go of its own)
        assert r["after"][0] <= r["before"][0] and r["after"][1] <= r["before"][1], (rank, r)
    assert results[-1]["blocked"] == [raised], results[-1]
