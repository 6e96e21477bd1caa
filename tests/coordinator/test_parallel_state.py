"""Parallel state: layouts, lifecycle, getters, wrappers, node placement.

The getters-before-init checks run in the test process itself (no
torch.distributed needed); everything else runs on pool ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator import NotInitializedError
from coordinator import parallel_state as ps
from coordinator.group.group_coordinator import GroupCoordinator
from coordinator.group.registry import REGISTRY
from device_comms import ReduceOp
from tests.coordinator.rank_checks import (
    expect_equal,
    expect_raises,
    make,
    ref_reduce,
)

# (tp, pp, dp, pcp, dcp) at world size 4
LAYOUTS = [(2, 2, 1, 1, 1), (4, 1, 1, 1, 1), (1, 4, 1, 1, 1), (2, 1, 2, 1, 1), (1, 2, 2, 1, 1),
           (2, 1, 1, 2, 1), (4, 1, 1, 1, 2), (2, 1, 1, 2, 2), (2, 1, 1, 2, 4),
           (2, 1, 1, 1, 1), (1, 2, 1, 1, 1)]  # the last two: two replicas (external DP)
KINDS = ("tp", "pp", "dp", "pcp", "dcp")


def _expected_groups(tp: int, pp: int, dp: int, pcp: int = 1, dcp: int = 1,
                     world: int | None = None) -> dict[str, list[list[int]]]:
    """Groups of the DP x PP x PCP x TP layout (TP fastest), replicated over
    ``world`` ranks, derived rank by rank: each group holds the ranks of one
    replica that share every other coordinate; DCP groups share everything but
    a run of ``dcp`` consecutive TP coordinates without PCP, and with PCP the PCP
    group (``dcp == pcp``) or the whole TP x PCP block (``dcp == tp * pcp``)."""
    one = tp * pp * dp * pcp
    world = one if world is None else world
    coords = {r: (r // one, r // (tp * pcp * pp) % dp, r // (tp * pcp) % pp, r // tp % pcp,
                  r % tp) for r in range(world)}

    def groups(key) -> list[list[int]]:
        out: dict = {}
        for r, (e, d, p, c, t) in coords.items():
            out.setdefault((e, key(d, p, c, t)), []).append(r)
        return sorted(out.values())

    return {
        "tp": groups(lambda d, p, c, t: (d, p, c)),
        "pp": groups(lambda d, p, c, t: (d, c, t)),
        "dp": groups(lambda d, p, c, t: (p, c, t)),
        "pcp": groups(lambda d, p, c, t: (d, p, t)),
        "dcp": groups(lambda d, p, c, t: (d, p, c, t) if dcp == 1 else
                      (d, p, c, t // dcp) if pcp == 1 else
                      (d, p, t) if dcp == pcp else (d, p)),
        "ep": groups(lambda d, p, c, t: p),
    }


def test_expected_groups_helper_matches_the_documented_example():
    # parallel_state's docstring: TP=2, PP=2 -> TP [0,1],[2,3]; PP [0,2],[1,3].
    want = _expected_groups(2, 2, 1)
    assert (want["tp"], want["pp"], want["dp"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]],
                                                    [[0], [1], [2], [3]])
    # rank_mesh's table: TP=2, PCP=2 -> PCP [0, 2], [1, 3]; DCP=2 spans PCP: [0, 2], [1, 3].
    assert _expected_groups(2, 1, 1, 2, 2)["pcp"] == [[0, 2], [1, 3]]
    assert _expected_groups(2, 1, 1, 2, 2)["dcp"] == [[0, 2], [1, 3]]
    assert _expected_groups(2, 1, 1, 2, 4)["dcp"] == [[0, 1, 2, 3]]
    assert _expected_groups(4, 1, 1, 1, 2)["dcp"] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("layout", [(2, 2, 2, 1, 1, 1), (2, 1, 2, 2, 2, 1), (4, 2, 1, 1, 2, 1),
                                    (3, 2, 2, 2, 6, 1), (6, 1, 1, 2, 2, 1), (1, 3, 1, 2, 1, 1),
                                    (2, 2, 1, 1, 2, 3), (1, 1, 2, 2, 1, 2), (3, 1, 1, 1, 3, 1)],
                         ids=lambda sizes: "tp{}-pp{}-dp{}-pcp{}-dcp{}-ext{}".format(*sizes))
def test_rank_mesh_matches_the_derived_groups(layout):
    from coordinator.parallel.rank_mesh import RankMesh

    tp, pp, dp, pcp, dcp, ext = layout
    world = ext * tp * pp * dp * pcp
    mesh = RankMesh.for_world(world, tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)
    want = _expected_groups(tp, pp, dp, pcp, dcp, world=world)
    assert mesh.ext == ext
    for kind in (*KINDS, "ep"):
        assert sorted(getattr(mesh, f"{kind}_groups")()) == want[kind], kind


@pytest.mark.parametrize("sizes,words", [(dict(tp=4, dcp=3), "divide"), (dict(tp=0), "tp"),
                                         (dict(tp=2, pcp=2, dcp=3), r"valid sizes are \[1, 2, 4\]"),
                                         (dict(tp=3, pcp=2, dcp=3), r"valid sizes are \[1, 2, 6\]"),
                                         (dict(pcp=2.0), "pcp"), (dict(dcp=True), "dcp"),
                                         (dict(tp=4, pp=2), "must divide the world size 12")])
def test_rank_mesh_refuses_bad_sizes(sizes, words):
    from coordinator.parallel.rank_mesh import RankMesh

    with pytest.raises(ValueError, match=words):
        RankMesh.for_world(12, **sizes)


@pytest.mark.timeout(180)
def test_layouts_at_world_size_4(dist_pool):
    results = dist_pool(4).run(run_layouts, LAYOUTS, timeout=150)
    for i, layout in enumerate(LAYOUTS):
        want = _expected_groups(*layout, world=4)
        tp, pp, dp, pcp, dcp = layout
        for rank, per_rank in enumerate(results):
            rec = per_rank[i]
            for kind in KINDS:
                mine = next(g for g in want[kind] if rank in g)
                assert rec[kind] == mine, f"{layout} rank {rank} {kind}: {rec[kind]} != {mine}"
            my_pp = next(g for g in want["pp"] if rank in g)
            my_pcp = next(g for g in want["pcp"] if rank in g)
            my_dcp = next(g for g in want["dcp"] if rank in g)
            assert rec["getters"] == (tp, rank % tp, pp, my_pp.index(rank), pcp,
                                      my_pcp.index(rank), dcp, my_dcp.index(rank)), rec
            assert rec["queues"] == {k: k in ("tp", "dcp") and len(want[k][0]) > 1
                                     for k in KINDS}, (layout, rec["queues"])


@pytest.mark.timeout(120)
def test_destroy_distributed_environment_then_init_again(dist_pool):
    results = dist_pool(2).run(run_reinit_world, timeout=90)
    assert results[0] == results[1]
    assert results[0]["old"] != results[0]["new"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_in_the_same_node_as(dist_pool, world_size):
    results = dist_pool(world_size).run(run_same_node, timeout=90)
    for r in results:
        assert r["plain"] == [True] * world_size
        assert r["torch_group"] == [True] * world_size
        # GROUPCOORD_NODE_ID = node{rank // 2}: ranks 0, 1 on one node, 2, 3 on another
        assert r["split_src0"] == [q // 2 == 0 for q in range(world_size)]
        last = world_size - 1
        assert r["split_srclast"] == [q // 2 == last // 2 for q in range(world_size)]


@pytest.mark.timeout(120)
def test_wrappers_graph_capture_and_patch_tensor_parallel_group(dist_pool):
    assert dist_pool(4).run(run_wrappers, timeout=90) == [["wrappers"]] * 4


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
        ({"backend": "nosuch"}, ValueError, "backend must be one of"),
        ({"backend": 5}, TypeError, "backend must be a str"),
        ({"distributed_init_method": "foo://x"}, ValueError, "distributed_init_method"),
        ({"distributed_init_method": "file:///nonexistent-dir/x", "world_size": 1, "rank": 0},
         ValueError, "not an existing directory"),
        ({"local_rank": -5}, ValueError, "local_rank must be >= 0"),
        ({"allow_pickle": "yes"}, TypeError, "allow_pickle"),
        ({"timeout": 1e300}, ValueError, "timeout must be at most"),
    ],
)
def test_init_distributed_environment_bad_arguments(uninitialised, kwargs, exc, word):
    with pytest.raises(exc) as info:
        ps.init_distributed_environment(**kwargs)
    assert word in str(info.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("rank,size", [("5", "1"), ("-1", "2"), ("0", "zero")])
def test_env_launcher_variables_out_of_range_are_named_at_once(uninitialised, monkeypatch,
                                                              rank: str, size: str) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", size)
    with pytest.raises(ValueError, match="RANK|WORLD_SIZE"):
        ps.init_distributed_environment(timeout=60.0)
    assert not dist.is_initialized()


@pytest.mark.parametrize("value", ["first", "-1", ""])
def test_a_bad_local_rank_variable_is_named_before_any_setup(uninitialised, monkeypatch, value):
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(ValueError, match=f"LOCAL_RANK.*'{value}'"):
        ps.init_distributed_environment(1, 0, "env://")
    assert not dist.is_initialized()


def test_env_rendezvous_store_listens_on_master_addr_only(uninitialised, monkeypatch):
    """torch's own env:// store would listen on every interface: anyone on the
    network could delete or overwrite the world's rendezvous keys."""
    from coordinator.testing import free_port
    from tests.shm_broadcast.ranks.test_tcp_store import listening_on

    port = free_port()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    ps.init_distributed_environment(distributed_init_method="env://", timeout=60.0)
    try:
        assert listening_on(port) == {"127.0.0.1"}
        assert ps.get_world_group().all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_one_rank_with_other_sizes_is_told_to_every_rank(dist_pool, world_size):
    """initialize_model_parallel agrees on its arguments before any group exists:
    a rank whose sizes are wrong raises its ValueError, the others PeerRejectedError
    naming it, at once (not after new_group's timeout); values that differ but are
    each valid are a CollectiveMismatch everywhere."""
    outs = dist_pool(world_size).run(run_disagreeing_sizes, timeout=90)
    for rank, out in enumerate(outs):
        name, seconds = out["bad-size"]
        assert name == ("ValueError" if rank == world_size - 1 else "PeerRejectedError"), out
        assert seconds < 5, out
        name, seconds = out["ep-differs"]
        assert name == "CollectiveMismatch" and seconds < 5, out
        name, seconds = out["ensure-bad-type"]  # ensure_... creating the groups: the same
        assert name == ("TypeError" if rank == world_size - 1 else "PeerRejectedError"), out
        assert seconds < 5, out
        assert out["after"] == world_size, out


def run_disagreeing_sizes(rank: int, world_size: int) -> dict[str, Any]:
    import time

    from coordinator import parallel_state as ps

    last = rank == world_size - 1
    out: dict[str, Any] = {}
    for case, args, kw in (("bad-size", (world_size + last, 1), {}),
                           ("ep-differs", (world_size, 1), {"enable_expert_parallel": last}),
                           ("ensure-bad-type", (world_size, "1" if last else 1), {})):
        call = (ps.ensure_model_parallel_initialized if case.startswith("ensure")
                else ps.initialize_model_parallel)
        t0 = time.monotonic()
        try:
            call(*args, **kw)
            out[case] = ("no error", 0.0)
        except Exception as e:
            out[case] = (type(e).__name__, time.monotonic() - t0)
        assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(world_size, 1)
    out["after"] = int(ps.get_tp_group().all_reduce(torch.ones(1)).item())
    ps.destroy_model_parallel()
    return out


@pytest.mark.timeout(120)
def test_tcp_rendezvous_store_listens_on_the_given_host_only(dist_pool):
    got = dist_pool(2).run(run_store_listeners, timeout=90)
    assert got[0] == {"127.0.0.1"}, got


def run_store_listeners(rank: int, world_size: int) -> set[str] | None:
    """On rank 0 (the store's host; the pool used tcp://127.0.0.1:MASTER_PORT):
    the addresses its store listens on."""
    from tests.shm_broadcast.ranks.test_tcp_store import listening_on

    return listening_on(int(os.environ["MASTER_PORT"])) if rank == 0 else None


# ---------------------------------------------------------------------- on the ranks
_BAD_GROUP_ARGS = {
    "backend-unknown": ({"torch_distributed_backend": "nosuch"}, ValueError,
                        "torch_distributed_backend must be one of"),
    "backend-int": ({"torch_distributed_backend": 5}, TypeError, "torch_distributed_backend"),
    "backend-pair-unknown": ({"torch_distributed_backend": "cpu:gloo,cuda:nosuch"}, ValueError,
                             "torch_distributed_backend"),
    "local-rank-str": ({"local_rank": "0"}, TypeError, "local_rank must be an int"),
    "local-rank-negative": ({"local_rank": -5}, ValueError, "local_rank must be >= 0"),
    "group-name-int": ({"group_name": 5}, TypeError, "group_name"),
    "group-name-empty": ({"group_name": ""}, TypeError, "group_name"),
    "group-ranks-descending": ({"group_ranks": [[1, 0]]}, ValueError, "ascending order"),
}


def bad_group_args(rank: int, world_size: int) -> dict[str, str]:
    """Each bad GroupCoordinator argument: its error, or what happened instead."""
    out = {}
    for case, (kw, exc, words) in _BAD_GROUP_ARGS.items():
        args = {"group_ranks": [list(range(world_size))], "local_rank": rank,
                "torch_distributed_backend": "gloo", "use_device_communicator": True}
        args.update(kw)
        try:
            GroupCoordinator(**args).destroy()
            out[case] = "accepted"
        except (TypeError, ValueError) as e:
            out[case] = "ok" if type(e) is exc and words in str(e) else f"{type(e).__name__}: {e}"
    return out


def unbuilt_backends(rank: int, world_size: int) -> dict[str, str]:
    """Each backend torch knows, when this build lacks it: the error it gives."""
    checks = {"nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available,
              "ucc": dist.is_ucc_available}
    out = {}
    for name, built in checks.items():
        if built():  # nothing to refuse (NCCL in a CUDA build); not made here without GPUs
            out[name] = "ok"
            continue
        try:
            GroupCoordinator([list(range(world_size))], rank, name, True).destroy()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = "ok" if "lacks" in str(e) else f"ValueError: {e}"
    return out


def test_a_backend_this_torch_lacks_is_a_value_error(dist_pool):
    for got in dist_pool(2).run(unbuilt_backends, timeout=60):
        assert got == {"nccl": "ok", "mpi": "ok", "ucc": "ok"}, got


def test_group_coordinator_bad_arguments_name_them(dist_pool):
    for got in dist_pool(2).run(bad_group_args, timeout=60):
        assert got == dict.fromkeys(_BAD_GROUP_ARGS, "ok"), got


# ---------------------------------------------------------------------- parallel state
def run_layouts(rank: int, world_size: int,
                configs: list[tuple[int, int, int, int, int]]) -> list[dict]:
    """Initialise, inspect, use and destroy model parallelism for each
    (tp, pp, dp, pcp, dcp)."""
    from coordinator import NotInitializedError
    from coordinator import parallel_state as ps

    out = []
    for tp, pp, dp, pcp, dcp in configs:
        assert not ps.model_parallel_is_initialized()
        cp = {"prefill_context_model_parallel_size": pcp,
              "decode_context_model_parallel_size": dcp}
        ps.initialize_model_parallel(tp, pp, dp, **cp)
        assert ps.model_parallel_is_initialized()
        groups = {"tp": ps.get_tp_group(), "pp": ps.get_pp_group(), "dp": ps.get_dp_group(),
                  "pcp": ps.get_pcp_group(), "dcp": ps.get_dcp_group()}
        assert ps.get_context_model_parallel_group() is groups["dcp"]
        assert ps.get_all_model_groups() == list(groups.values())
        rec: dict[str, Any] = {k: list(g.ranks) for k, g in groups.items()}
        rec["getters"] = (
            ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
            ps.get_prefill_context_model_parallel_world_size(),
            ps.get_prefill_context_model_parallel_rank(),
            ps.get_decode_context_model_parallel_world_size(),
            ps.get_decode_context_model_parallel_rank(),
        )
        # Each group really connects the ranks it lists.
        for k, g in groups.items():
            got = g.all_reduce(torch.tensor([rank], dtype=torch.int64))
            assert got.item() == sum(g.ranks), f"{(tp, pp, dp)} {k}: {got.item()} != sum{g.ranks}"
            gathered = g.all_gather(torch.tensor([rank]), 0)
            assert gathered.tolist() == list(g.ranks), f"{k}: gathered {gathered.tolist()}"
            assert g.use_device_communicator is True, k
        # As vLLM's, the TP and DCP groups of more than one rank broadcast through a
        # message queue, the others through their CPU group.
        rec["queues"] = {k: g.mq_broadcaster is not None for k, g in groups.items()}
        sent = {"step": tp * 10 + dcp, "ids": torch.arange(4)}
        got = groups["dcp"].broadcast_tensor_dict(
            sent if groups["dcp"].rank_in_group == 0 else None)
        assert got["step"] == sent["step"] and torch.equal(got["ids"], sent["ids"]), got
        # ensure_...: a no-op with the same sizes, an error with others.
        ps.ensure_model_parallel_initialized(tp, pp, dp, **cp)
        ps.ensure_model_parallel_initialized(tp, pp, **cp)  # no DP size (vLLM's workers): any
        assert ps.get_tp_group() is groups["tp"], "ensure_model_parallel_initialized rebuilt groups"
        other = (pp, tp, dp) if tp != pp else (tp * dp, pp, 1) if dp > 1 else (1, pp * tp, 1)
        expect_raises("ensure/other-sizes", ValueError,
                      lambda: ps.ensure_model_parallel_initialized(*other, **cp),
                      "destroy_model_parallel")
        if pcp > 1 or dcp > 1:  # the context-parallel sizes count too
            expect_raises("ensure/other-cp-sizes", ValueError,
                          lambda: ps.ensure_model_parallel_initialized(tp, pp, dp),
                          "destroy_model_parallel", "pcp, dcp")
        for bad, word in (((float(tp), pp), "tensor_model_parallel_size"),
                          ((tp, pp, dp, 5), "backend"),
                          ((True, pp), "tensor_model_parallel_size")):
            expect_raises(f"ensure/bad-{word}", TypeError,
                          lambda: ps.ensure_model_parallel_initialized(*bad), word)
        expect_raises("ensure/bad-ep", TypeError,
                      lambda: ps.ensure_model_parallel_initialized(
                          tp, pp, dp, enable_expert_parallel="no"), "enable_expert_parallel")
        expect_raises("init-twice", RuntimeError,
                      lambda: ps.initialize_model_parallel(tp, pp, dp, **cp), "already")
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
        expect_raises("after-destroy", NotInitializedError, ps.get_tp_group,
                      "initialize_model_parallel")
        out.append(rec)
    ps.destroy_model_parallel()  # no-op when absent
    # ensure_... initialises when nothing exists.
    ps.ensure_model_parallel_initialized(world_size, 1)
    assert ps.get_tensor_model_parallel_world_size() == world_size
    ps.destroy_model_parallel()
    # Sizes whose product does not divide the world size, or are not positive ints.
    for args, exc, words in (
        ((3, 1, 1), ValueError, ("world size", str(world_size))),
        ((world_size, 2, 1), ValueError, ("world size",)),
        ((0, 1, 1), ValueError, ("tensor_model_parallel_size",)),
        ((1, -1, 1), ValueError, ("pipeline_model_parallel_size",)),
        (("2", 1, 1), TypeError, ("tensor_model_parallel_size",)),
        ((1, 1, 2.0), TypeError, ("data_parallel_size",)),
        ((world_size, 1, 1, {"prefill_context_model_parallel_size": 2}), ValueError,
         ("world size", "prefill context")),  # PCP multiplies the world size
        ((world_size, 1, 1, {"decode_context_model_parallel_size": 3}), ValueError, ("divide",)),
        ((world_size, 1, 1, {"prefill_context_model_parallel_size": 0}), ValueError,
         ("prefill_context_model_parallel_size",)),
        ((world_size, 1, 1, {"decode_context_model_parallel_size": "2"}), TypeError,
         ("decode_context_model_parallel_size",)),
    ):
        kw = args[-1] if isinstance(args[-1], dict) else {}
        pos = args[:-1] if kw else args
        expect_raises(f"sizes{args}", exc, lambda: ps.initialize_model_parallel(*pos, **kw), *words)
        assert not ps.model_parallel_is_initialized()
    return out


def run_reinit_world(rank: int, world_size: int) -> dict[str, Any]:
    """destroy_distributed_environment, then init again in the same processes."""
    import torch.distributed as dist

    from coordinator import NotInitializedError
    from coordinator import parallel_state as ps
    from coordinator.testing import free_port

    old = ps.get_world_group()
    port = old.broadcast_object(free_port() if rank == 0 else None, 0)
    ps.initialize_model_parallel(world_size, 1)
    ps.destroy_distributed_environment()
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    expect_raises("world-after-destroy", NotInitializedError, ps.get_world_group,
                  "init_distributed_environment")
    ps.destroy_distributed_environment()  # idempotent
    # Under tcp:// a stray LOCAL_RANK is not this launch's: the global rank is used.
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "5"
    try:
        g = ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}",
                                            timeout=60.0)
    finally:
        if saved is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = saved
    # The pool's ranks live on in this world: their environment names its store
    # (test_tcp_rendezvous_store_listens_on_the_given_host_only reads it).
    os.environ["MASTER_PORT"] = str(port)
    assert g is not old and g is ps.get_world_group() and g.world_size == world_size
    assert g.local_rank == rank, g.local_rank
    assert g.unique_name != old.unique_name
    total = g.all_reduce(torch.tensor([rank + 1.0])).item()
    assert total == world_size * (world_size + 1) / 2
    # Already initialised: returns the same group; another world size is an error.
    assert ps.init_distributed_environment() is g
    expect_raises("init/other-size", ValueError,
                  lambda: ps.init_distributed_environment(world_size + 1), "world_size")
    # The existing world is handed back only for what it is.
    expect_raises("init/other-rank", ValueError,
                  lambda: ps.init_distributed_environment(rank=(rank + 1) % world_size), "rank=")
    expect_raises("init/other-local-rank", ValueError,
                  lambda: ps.init_distributed_environment(local_rank=rank + 1), "local_rank=")
    expect_raises("init/pickle", ValueError,
                  lambda: ps.init_distributed_environment(allow_pickle=True), "allow_pickle=")
    assert ps.init_distributed_environment(world_size, rank, local_rank=rank) is g
    ps.initialize_model_parallel(1, world_size)
    assert ps.get_pipeline_model_parallel_world_size() == world_size
    assert ps.get_pipeline_model_parallel_rank() == rank
    return {"old": old.unique_name, "new": g.unique_name}


def run_same_node(rank: int, world_size: int) -> dict[str, Any]:
    """in_the_same_node_as: all True on one machine; GROUPCOORD_NODE_ID splits nodes."""
    from coordinator import parallel_state as ps

    world = ps.get_world_group()
    out: dict[str, Any] = {"plain": ps.in_the_same_node_as(world),
                           "torch_group": ps.in_the_same_node_as(world.cpu_group, world_size - 1)}
    # Refused before any exchange, on every rank alike.
    expect_raises("same-node/str", TypeError, lambda: ps.in_the_same_node_as(world, "0"),
                  "source_rank")
    expect_raises("same-node/bool", TypeError, lambda: ps.in_the_same_node_as(world, True),
                  "source_rank")
    expect_raises("same-node/range", ValueError,
                  lambda: ps.in_the_same_node_as(world, world_size), "source_rank")
    os.environ["GROUPCOORD_NODE_ID"] = f"node{rank // 2}"
    try:
        out["split_src0"] = ps.in_the_same_node_as(world, 0)
        out["split_srclast"] = ps.in_the_same_node_as(world, source_rank=world_size - 1)
    finally:
        del os.environ["GROUPCOORD_NODE_ID"]
    return out


def run_wrappers(rank: int, world_size: int) -> list[str]:
    """tensor_model_parallel_* wrappers, graph_capture and patch_tensor_parallel_group."""
    from coordinator import GraphCaptureContext
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    tp = ps.get_tp_group()
    t = tp.rank_in_group
    assert (ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank()) == (2, rank % 2)
    assert (ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank()) == (2, rank // 2)

    def inputs(tag: str, shape: tuple[int, ...],
               dt: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [make(r, shape, dt, tag) for r in tp.ranks]

    xs = inputs("w-ar", (3, 4))
    expect_equal("wrap/all_reduce", ps.tensor_model_parallel_all_reduce(xs[t]),
                 ref_reduce(xs, ReduceOp.SUM))
    xs = inputs("w-ar-max", (3,), torch.int64)
    expect_equal("wrap/all_reduce/max", ps.tensor_model_parallel_all_reduce(xs[t], ReduceOp.MAX),
                 ref_reduce(xs, ReduceOp.MAX))
    xs = inputs("w-ag", (2, 3, 2), torch.bfloat16)
    expect_equal("wrap/all_gather", ps.tensor_model_parallel_all_gather(xs[t]), torch.cat(xs, -1))
    expect_equal("wrap/all_gather/0", ps.tensor_model_parallel_all_gather(xs[t], 0),
                 torch.cat(xs, 0))
    xs = inputs("w-rs", (2, 4))
    expect_equal("wrap/reduce_scatter", ps.tensor_model_parallel_reduce_scatter(xs[t]),
                 ref_reduce(xs, ReduceOp.SUM).chunk(2, -1)[t])
    expect_equal("wrap/reduce_scatter/0", ps.tensor_model_parallel_reduce_scatter(xs[t], 0),
                 ref_reduce(xs, ReduceOp.SUM).chunk(2, 0)[t])
    xs = inputs("w-g", (2, 3))
    for dst in (0, 1):
        got = ps.tensor_model_parallel_gather(xs[t], dst, 0)
        if t == dst:
            expect_equal("wrap/gather", got, torch.cat(xs, 0))
        else:
            assert got is None
    got = ps.tensor_model_parallel_gather(xs[t])  # defaults dst=0, dim=-1
    if t == 0:
        expect_equal("wrap/gather/defaults", got, torch.cat(xs, -1))
    with ps.graph_capture() as ctx:
        assert isinstance(ctx, GraphCaptureContext) and ctx.stream is None
        with tp.graph_capture(ctx) as inner:
            assert inner is ctx
    # patch_tensor_parallel_group: the wrappers follow the patched group, then revert.
    world = ps.get_world_group()
    with ps.patch_tensor_parallel_group(world) as patched:
        assert patched is world and ps.get_tp_group() is world
        assert ps.get_tensor_model_parallel_world_size() == world_size
        assert ps.get_tensor_model_parallel_rank() == rank
        total = ps.tensor_model_parallel_all_reduce(torch.tensor([1.0])).item()
        assert total == world_size, total
    assert ps.get_tp_group() is tp
    try:
        with ps.patch_tensor_parallel_group(world):
            raise KeyError("inside")
    except KeyError:
        pass
    assert ps.get_tp_group() is tp, "patch_tensor_parallel_group must restore after an exception"
    expect_raises("patch/type", TypeError,
                  lambda: ps.patch_tensor_parallel_group(world.cpu_group).__enter__(), "group")
    return ["wrappers"]


@pytest.mark.parametrize("device,error", [("nonsense", ValueError), (3.5, TypeError),
                                          (["cpu"], TypeError)])
def test_graph_capture_names_a_bad_device(device: object, error: type) -> None:
    with pytest.raises(error, match="device"), ps.graph_capture(device):  # type: ignore[arg-type]
        pass


def test_single_process_helpers_before_any_initialisation() -> None:
    """vLLM's single-process shortcuts: first ranks, and a dict broadcast to nobody."""
    import torch.distributed as dist

    if dist.is_initialized() or ps.model_parallel_is_initialized():
        pytest.skip("this process already belongs to a group")
    assert ps.is_global_first_rank() and ps.is_local_first_rank()
    d = {"x": 1}
    assert ps.broadcast_tensor_dict(d) is d
    ps.cleanup_dist_env_and_memory()  # nothing to tear down: no error


def first_ranks(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    out = (ps.is_global_first_rank(), ps.is_local_first_rank(), ps.model_parallel_is_initialized())
    return out


def test_first_ranks_across_processes(dist_pool) -> None:
    outs = dist_pool(3).run(first_ranks)
    assert [o[0] for o in outs] == [True, False, False], outs
    assert all(o[2] for o in outs), outs
