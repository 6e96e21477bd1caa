"""Parallel state: layouts, lifecycle, getters, wrappers, node placement.

The getters-before-init checks run in the test process itself (no
torch.distributed needed); everything else runs on pool ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from coordinator import NotInitializedError
from coordinator import parallel_state as ps
from coordinator.group_coordinator import GroupCoordinator
from coordinator.group_registry import REGISTRY
from tests.coordinator import _dist_state as F

LAYOUTS = [(2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]


def _expected_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Groups of the DP x PP x TP layout (TP fastest), derived rank by rank."""
    coords = {r: (r // (tp * pp), (r // tp) % pp, r % tp) for r in range(tp * pp * dp)}

    def groups(key) -> list[list[int]]:
        out: dict = {}
        for r, c in coords.items():
            out.setdefault(key(c), []).append(r)
        return sorted(out.values())

    return {
        "tp": groups(lambda c: (c[0], c[1])),  # same dp, pp
        "pp": groups(lambda c: (c[0], c[2])),  # same dp, tp
        "dp": groups(lambda c: (c[1], c[2])),  # same pp, tp
    }


def test_expected_groups_helper_matches_the_documented_example():
    # parallel_state's docstring: TP=2, PP=2 -> TP [0,1],[2,3]; PP [0,2],[1,3].
    assert _expected_groups(2, 2, 1) == {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]],
                                         "dp": [[0], [1], [2], [3]]}


@pytest.mark.timeout(180)
def test_layouts_at_world_size_4(dist_pool):
    results = dist_pool(4).run(F.run_layouts, LAYOUTS, timeout=150)
    for i, (tp, pp, dp) in enumerate(LAYOUTS):
        want = _expected_groups(tp, pp, dp)
        for rank, per_rank in enumerate(results):
            rec = per_rank[i]
            for kind in ("tp", "pp", "dp"):
                mine = next(g for g in want[kind] if rank in g)
                assert rec[kind] == mine, f"{(tp, pp, dp)} rank {rank} {kind}: {rec[kind]} != {mine}"
            my_pp = next(g for g in want["pp"] if rank in g)
            assert rec["getters"] == (tp, rank % tp, pp, my_pp.index(rank)), rec


@pytest.mark.timeout(120)
def test_destroy_distributed_environment_then_init_again(dist_pool):
    results = dist_pool(2).run(F.run_reinit_world, timeout=90)
    assert results[0] == results[1]
    assert results[0]["old"] != results[0]["new"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_in_the_same_node_as(dist_pool, world_size):
    results = dist_pool(world_size).run(F.run_same_node, timeout=90)
    for r in results:
        assert r["plain"] == [True] * world_size
        assert r["torch_group"] == [True] * world_size
        # GROUPCOORD_NODE_ID = node{rank // 2}: ranks 0, 1 on one node, 2, 3 on another
        assert r["split_src0"] == [q // 2 == 0 for q in range(world_size)]
        last = world_size - 1
        assert r["split_srclast"] == [q // 2 == last // 2 for q in range(world_size)]


@pytest.mark.timeout(120)
def test_wrappers_graph_capture_and_patch_tensor_parallel_group(dist_pool):
    assert dist_pool(4).run(F.run_wrappers, timeout=90) == [["wrappers"]] * 4


# ---------------------------------------------------------------------- in process
@pytest.fixture
def uninitialised():
    if dist.is_initialized() or REGISTRY.world is not None or REGISTRY.tp is not None:
        pytest.skip("this process has a distributed environment (another test set one up)")
    yield


_MP = "initialize_model_parallel"
_GETTERS = {
    "get_world_group": (ps.get_world_group, "init_distributed_environment"),
    "get_tp_group": (ps.get_tp_group, _MP),
    "get_pp_group": (ps.get_pp_group, _MP),
    "get_dp_group": (ps.get_dp_group, _MP),
    "tp_world_size": (ps.get_tensor_model_parallel_world_size, _MP),
    "tp_rank": (ps.get_tensor_model_parallel_rank, _MP),
    "pp_world_size": (ps.get_pipeline_model_parallel_world_size, _MP),
    "pp_rank": (ps.get_pipeline_model_parallel_rank, _MP),
    "tp_all_reduce": (lambda: ps.tensor_model_parallel_all_reduce(torch.ones(1)), _MP),
    "tp_all_gather": (lambda: ps.tensor_model_parallel_all_gather(torch.ones(1)), _MP),
    "tp_reduce_scatter": (lambda: ps.tensor_model_parallel_reduce_scatter(torch.ones(2)), _MP),
    "tp_gather": (lambda: ps.tensor_model_parallel_gather(torch.ones(1)), _MP),
    "broadcast_tensor_dict": (lambda: ps.broadcast_tensor_dict({"a": 1}), _MP),
    "initialize_model_parallel": (lambda: ps.initialize_model_parallel(1, 1),
                                  "init_distributed_environment"),
    "ensure_model_parallel": (lambda: ps.ensure_model_parallel_initialized(1, 1),
                              "init_distributed_environment"),
    "graph_capture": (lambda: ps.graph_capture().__enter__(), _MP),
}


@pytest.mark.parametrize("call,how", list(_GETTERS.values()), ids=list(_GETTERS))
def test_getters_before_init_raise_not_initialized(uninitialised, call, how):
    with pytest.raises(NotInitializedError, match=how) as info:
        call()
    assert isinstance(info.value, RuntimeError)  # the documented builtin mix-in
    assert "call coordinator.parallel_state." in str(info.value)


def test_state_queries_and_teardown_before_init(uninitialised):
    assert not ps.model_parallel_is_initialized()
    ps.destroy_model_parallel()  # no-ops
    ps.destroy_distributed_environment()
    with pytest.raises(NotInitializedError, match="init_distributed_environment"):
        GroupCoordinator([[0]], 0, "gloo", True)


@pytest.mark.parametrize(
    "kwargs,exc,word",
    [
        ({"world_size": "2"}, TypeError, "world_size"),
        ({"rank": 1.0}, TypeError, "rank"),
        ({"local_rank": None}, TypeError, "local_rank"),
        ({"distributed_init_method": "localhost:1234"}, ValueError, "distributed_init_method"),
        ({"distributed_init_method": 5}, TypeError, "distributed_init_method"),
        ({"distributed_init_method": "tcp://127.0.0.1:1", "world_size": 2}, ValueError, "rank"),
        ({"distributed_init_method": "tcp://127.0.0.1:1", "rank": 0}, ValueError, "world_size"),
        ({"distributed_init_method": "tcp://127.0.0.1:1", "world_size": 2, "rank": 2},
         ValueError, "rank must be in [0, 2)"),
        ({"timeout": "soon"}, TypeError, "timeout"),
    ],
)
def test_init_distributed_environment_bad_arguments(uninitialised, kwargs, exc, word):
    with pytest.raises(exc) as info:
        ps.init_distributed_environment(**kwargs)
    assert word in str(info.value)
    assert not dist.is_initialized()

