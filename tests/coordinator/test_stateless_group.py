"""StatelessProcessGroup over real TCPStores in real processes."""

from __future__ import annotations

import re

import pytest

from coordinator import StatelessProcessGroup
from coordinator.testing import free_port
from tests.coordinator import _stateless_fns as fns


@pytest.mark.parametrize("world_size", [2, 3])
def test_stateless_group_collectives(dist_pool, world_size: int) -> None:
    res = dist_pool(world_size).run(fns.exercise, free_port(), free_port(), timeout=90)
    for rank, r in enumerate(res):
        prev = (rank - 1) % world_size
        assert r["ring0"] == {"from": prev, "i": 0}
        assert r["ring1"] == {"from": prev, "i": 1}
        assert r["bcast"] == [f"x{s}" for s in range(world_size)]
        assert r["gather"] == [10 * i for i in range(world_size)]
        assert r["same_node"] == [True] * world_size
        assert r["world_unchanged"]
        if rank < 2:
            assert r["b_gather"] == [("b", 0), ("b", 1)]
    # Everything read was deleted; only barrier bookkeeping of the last barrier may remain.
    assert res[0]["keys_left"] <= world_size + 2


def test_stateless_barrier_timeout_names_missing_rank(dist_pool) -> None:
    res = dist_pool(3).run(fns.barrier_timeout, free_port(), timeout=90)
    for r in res[:2]:
        assert r["elapsed"] is not None and r["elapsed"] < 6.0
        assert r["is_timeout"]
        missing = re.search(r"rank\(s\) \[([0-9, ]*)\]", r["msg"])
        assert missing is not None, r["msg"]
        assert 2 in [int(x) for x in missing.group(1).split(",")], r["msg"]  # late ones may join it
        assert "barrier" in r["msg"] and "'t'" in r["msg"]


def test_stateless_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 0)
    with pytest.raises(ValueError, match="rank"):
        StatelessProcessGroup.create("127.0.0.1", free_port(), 3, 2)
    with pytest.raises(ValueError, match="port"):
        StatelessProcessGroup.create("127.0.0.1", 70000, 0, 1)
    g = StatelessProcessGroup.create("127.0.0.1", free_port(), 0, 2, timeout=5)
    with pytest.raises(ValueError, match="dst"):
        g.send_obj(1, dst=0)
    with pytest.raises(ValueError, match="src"):
        g.broadcast_obj(1, src=5)
    with pytest.raises(TypeError, match="dst"):
        g.send_obj(1, dst="1")  # type: ignore[arg-type]
    g.close()
