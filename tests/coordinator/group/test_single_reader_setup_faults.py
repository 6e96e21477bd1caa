"""``create_single_reader_mq_broadcasters`` when one writer cannot make its queue.

The last rank is on another (simulated) node and its host address is not one of
this host's, so its queue cannot bind: it raises, and its peers, which waited
in the handle exchange until the group's timeout and then blamed other ranks,
now raise ``CollectiveMismatch`` at once, naming it; no queue is left open.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.env_vars import environ


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_writer_that_cannot_make_its_queue_is_named_on_every_rank(dist_pool,
                                                                     world_size: int) -> None:
    outs = dist_pool(world_size).run(one_writer_fails, timeout=60)
    bad = world_size - 1
    for rank, out in enumerate(outs):
        if rank == bad:
            assert out["kind"] == "ValueError" and "GROUPCOORD_HOST_IP" in out["msg"], out
            continue
        assert out["kind"] == "CollectiveMismatch", (rank, out)
        assert out["peers"] == [bad] and f"writer(s) [{bad}]" in out["msg"], (rank, out)
        assert out["took"] < 5.0, (rank, out)
    for rank, out in enumerate(outs):
        assert out["after"] == "made", (rank, out)  # the group is still usable


def one_writer_fails(rank: int, world_size: int) -> dict[str, Any]:
    bad = world_size - 1
    with environ(GROUPCOORD_NODE_ID="far" if rank == bad else "near",
                 GROUPCOORD_HOST_IP="127.0.0.1"):  # the pool's ranks run later tests too
        return _one_writer_fails(rank, world_size, bad)


def _one_writer_fails(rank: int, world_size: int, bad: int) -> dict[str, Any]:
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="srfail",
                         timeout=20.0)
    out: dict[str, Any] = {}
    try:
        if rank == bad:
            os.environ["GROUPCOORD_HOST_IP"] = "192.0.2.77"  # TEST-NET: not this host's
        start = time.monotonic()
        try:
            g.create_single_reader_mq_broadcasters(reader_rank_in_group=0)
            out["kind"] = "returned"
        except Exception as e:  # the parent checks which rank raised what
            out.update(kind=type(e).__name__, msg=str(e),
                       peers=[int(p) for p in getattr(e, "peers", ()) or ()])
        out["took"] = time.monotonic() - start
        os.environ["GROUPCOORD_HOST_IP"] = "127.0.0.1"
        mine, readers = g.create_single_reader_mq_broadcasters(reader_rank_in_group=0,
                                                               blocking=True)
        for q in [mine, *readers]:
            if q is not None:
                q.close()
        out["after"] = "made"
    finally:
        g.destroy()
    return out
