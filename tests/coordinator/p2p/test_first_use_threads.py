"""Two threads whose calls are a group's first asynchronous ones at the same moment.

The group builds its asynchronous calls' channels (one worker thread per peer
and direction) at first use. Here the construction is slowed down by 50 ms in
the rank (a subclass that sleeps before the real one builds itself), so both
threads' first calls find the group without channels: both must end up on one
set, every call must arrive, and ``destroy()`` must join every worker thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def first_calls_on_two_threads(rank: int, world_size: int, same_peer: bool) -> dict[str, Any]:
    import coordinator.p2p.point_to_point as point_to_point
    from coordinator import GroupCoordinator

    real = point_to_point.Channels

    class SlowToBuild(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.05)  # widen the window between the check and the assignment
            super().__init__(*args, **kwargs)

    point_to_point.Channels = SlowToBuild
    name = f"first-use-{int(same_peer)}"
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name=name,
                         timeout=20)
    out: dict[str, Any] = {"errors": [], "got": []}
    try:
        peers = [1, 1] if same_peer else list(range(1, world_size))
        if rank == 0:
            start = threading.Barrier(len(peers))

            def send(k: int, peer: int) -> None:
                try:
                    start.wait()
                    g.isend(torch.full((4,), float(k + 1)), peer).wait()
                except Exception as e:
                    out["errors"].append(f"{type(e).__name__}: {e}")

            threads = [threading.Thread(target=send, args=(k, p)) for k, p in enumerate(peers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        else:
            for _ in range(peers.count(rank)):
                out["got"].append(sorted(set(g.irecv(((4,), torch.float32), 0).wait().tolist())))
        g.barrier()
    finally:
        g.destroy()
        point_to_point.Channels = real
    out["threads_left"] = [t.name for t in threading.enumerate()
                           if t.name.startswith(f"gc-p2p {name}")]
    return out


@pytest.mark.parametrize("world_size,same_peer", [(2, True), (3, False)],
                         ids=["two-sends-to-one-peer", "sends-to-two-peers"])
def test_first_calls_on_two_threads_share_one_set_of_channels(
        dist_pool: Any, world_size: int, same_peer: bool) -> None:
    outs = dist_pool(world_size).run(first_calls_on_two_threads, same_peer, timeout=100)
    assert outs[0]["errors"] == [], outs[0]
    if same_peer:
        assert sorted(outs[1]["got"]) == [[1.0], [2.0]], outs[1]
    else:
        assert [o["got"] for o in outs[1:]] == [[[float(r)]] for r in range(1, world_size)], outs
    for rank, o in enumerate(outs):
        assert o["threads_left"] == [], (rank, o)
