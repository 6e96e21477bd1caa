"""An engine spread over two simulated hosts (``GROUPCOORD_NODE_ID`` per rank).

Real processes on one machine, but every layer treats the two halves of the
world as different nodes: message-queue readers on the other half connect over
TCP, the CPU communicator runs its hierarchical all-reduce, pipeline hops cross
the "hosts" over gloo.
"""

from __future__ import annotations

import pytest

from coordinator.testing import run_distributed
from tests.coordinator import _sim_hosts_fns as F


def _hosts(world_size: int) -> list[dict[str, str]]:
    return [{"GROUPCOORD_NODE_ID": f"host{r * 2 // world_size}"} for r in range(world_size)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_group_across_two_hosts(world_size):
    res = run_distributed(F.whole_world_tp, world_size, env=_hosts(world_size), timeout=150)
    local = [r * 2 // world_size == 0 for r in range(world_size)]
    for rank, r in enumerate(res):
        assert r["same_node"] == local
        expected = "writer" if rank == 0 else ("shm" if local[rank] else "tcp")
        assert r["transport"] == expected, (rank, r["transport"])
        # One rank per host leaves nothing to share memory with: plain gloo.
        assert r["comm_mode"] == ("hierarchical" if world_size > 2 else "gloo")
        assert r["metadata_ok"]
        assert r["all_reduce_err"] < 1e-5
        assert r["all_reduce_max_ok"] and r["all_gather_ok"] and r["reduce_scatter_ok"]
        assert r["object_ok"]
    # Every rank holds the very same all-reduce result, bit for bit.
    assert len({r["all_reduce_bits"] for r in res}) == 1
    assert res[0]["results_ok"]
    assert res[0]["result_transports"] == {
        r: ("shm" if local[r] else "tcp") for r in range(1, world_size)}


@pytest.mark.timeout(180)
def test_pipeline_across_hosts_tensor_parallel_within():
    res = run_distributed(F.tp_within_pp_across, 4, env=_hosts(4), timeout=150)
    for r in res:
        assert r["tp_same_node"] == [True, True]
        assert r["pp_same_node"] == [True, False]
        assert r["tp_comm_mode"] == "shm"
        assert r["pp_ok"] and r["tp_all_reduce_ok"]
