"""CpuCommunicator: every shared-memory op against a reference, on 2, 3 and 4 real ranks."""

from __future__ import annotations

import pytest
import torch

from coordinator.testing import run_distributed
from device_comms import CpuCommunicator, ReduceOp, select_device_communicator
from shm_broadcast.launcher import spawn_group
from tests.device_comms import _cpu_fns as fns
from tests.device_comms._cpu_cases import FLOATS, INTS, Case, build_cases, expected, make_input


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_registered_above_torch() -> None:
    assert select_device_communicator("cpu") is CpuCommunicator
    assert CpuCommunicator.priority > 0 and CpuCommunicator.device_types == {"cpu"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_op_matches_reference(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(fns.all_cases)
    cases = build_cases(world_size)
    for rank, out in enumerate(outs):
        assert out["mode"] == "shm"
        assert out["leftover"] == [], "workspace name must be unlinked once every rank attached"
        assert out["mapped_before"] and not out["mapped_after"], "destroy() must unmap"
        assert all(v > 0 for v in out["calls"].values()), out["calls"]
        total = world_size * (world_size + 1) / 2
        for r in out["extras"]["grad"]:
            assert not r.requires_grad and r.tolist() == [total] * 4
        for r in out["extras"]["noncontig"]:
            assert torch.equal(r, torch.arange(12.0).reshape(3, 4).t() * total)
        assert out["extras"]["str_op"].tolist() == [1.0, 1.0]
        assert "AVG" in out["extras"]["bad_op"]
    failures = []
    for key in ("results", "results_big", "results_pieces"):
        for c in cases:
            if key == "results_pieces" and c.kind not in ("all_reduce", "reduce"):
                continue
            got = [out[key][c.idx] for out in outs]
            for rank in range(world_size):
                want = expected(c, world_size, rank)
                if not _same(got[rank], want):
                    failures.append(f"{key} {c} rank {rank}: got {got[rank]!r}, want {want!r}")
            # Results that every rank receives are bitwise identical across ranks.
            if c.kind in ("all_reduce", "all_gather", "all_gatherv", "broadcast"):
                assert all(_same(g, got[0]) for g in got), f"ranks disagree on {c}"
    assert not failures, f"{len(failures)} mismatches, first: {failures[:3]}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_world_group_uses_shm(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(fns.world_group_comm)
    total = world_size * (world_size + 1) / 2
    for out in outs:
        assert out["type"] == "CpuCommunicator" and out["mode"] == "shm"
        assert out["sum"] == [total] * 5


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_calls_raise_on_every_rank(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(fns.mismatch)
    for out in outs:
        size_err, dtype_err, op_err = out["errors"]
        assert size_err and "size-key=10" in size_err and "size-key=11" in size_err
        assert dtype_err and "torch.int32" in dtype_err and "torch.float32" in dtype_err
        assert op_err and "op=MAX" in op_err and "op=SUM" in op_err
        assert "group 't'" in size_err
        assert out["after"] == [float(world_size)] * 3  # still usable afterwards


def test_fallback_to_gloo(dist_pool) -> None:
    outs = dist_pool(2).run(fns.fallbacks)
    for out in outs:
        for label in ("disabled", "own_nodes"):
            o = out[label]
            assert o["mode"] == "gloo" and o["reason"], o
            assert o["calls"] == 0
            assert o["sum"] == [3.0 * i for i in range(6)]
            assert o["gather"] == [0, 1]
        assert "rank(s) [0]" in out["disabled"]["reason"]


def test_bad_arguments(dist_pool) -> None:
    msgs = dist_pool(2).run(fns.bad_arguments)[0]
    assert msgs[0].startswith("ValueError") and "workspace_bytes" in msgs[0]
    assert msgs[1].startswith("TypeError") and "workspace_bytes" in msgs[1]
    assert msgs[2].startswith("TypeError") and "use_shm" in msgs[2]
    assert msgs[3].startswith("ValueError") and "timeout" in msgs[3]
    assert msgs[4].startswith("TypeError") and "node_id" in msgs[4]
    assert msgs[5].startswith("ValueError") and "oneshot_bytes" in msgs[5]
    assert "GROUPCOORD_CPU_SHM_BYTES" in msgs[6] and "'lots'" in msgs[6]


def test_timeout_and_destroyed_peer(dist_pool) -> None:
    out = dist_pool(2).run(fns.timeout_and_close)[0]
    elapsed, msg, is_timeout = out["timeout"]
    assert is_timeout and 0.5 <= elapsed < 2.0
    assert "group 't'" in msg and "all_reduce" in msg and "[1]" in msg
    assert "unusable" in out["after_timeout"]
    elapsed, msg = out["closed"]
    assert elapsed < 2.0 and "rank 1" in msg and "destroyed" in msg


@pytest.mark.timeout(120)
def test_killed_peer_is_reported_within_2s() -> None:
    # Rank 0 owns the workspace segment: its death must not leave it behind
    # (the autouse leak check verifies /dev/shm after the test).
    outs = spawn_group(fns.killed_peer, 3, (0,), timeout=90)
    assert outs[0].exitcode == -9 and not outs[0].ok
    for o in outs[1:]:
        assert o.ok, o.error
        res = o.result
        assert res["error"] is not None, "survivor did not notice the dead peer"
        assert res["elapsed"] < 2.0, res
        assert "rank 0" in res["error"] and "died" in res["error"] and "all_reduce" in res["error"]
        assert "group 't'" in res["error"]


def _hier_expected(case: Case, nodes: list[int], n: int) -> torch.Tensor:
    """Reduce inside each node in rank order, then across nodes in node order."""
    from device_comms import reduce_local

    inner = ReduceOp.SUM if case.op is ReduceOp.AVG else case.op
    partials = []
    for node in sorted(set(nodes)):
        xs = [make_input(case, r) for r in range(n) if nodes[r] == node]
        partials.append(reduce_local(xs, inner) if len(xs) > 1 else xs[0].clone())
    total = reduce_local(partials, inner)
    if case.op is ReduceOp.AVG:
        total.div_(n)
    return total


@pytest.mark.timeout(180)
def test_hierarchical_all_reduce() -> None:
    env = [{"GROUPCOORD_NODE_ID": k} for k in ("a", "a", "b", "b")]
    layouts = [None, ["x", "y", "x", "x"]]  # env: {0,1}{2,3}; argument: {0,2,3}{1}
    outs = run_distributed(fns.hierarchical, 4, layouts, env=env, timeout=150)
    for li, want_nodes in enumerate(([0, 0, 1, 1], [0, 1, 0, 0])):
        per_rank = [o[li] for o in outs]
        idx = 0
        for rank, o in enumerate(per_rank):
            assert o["mode"] == "hierarchical" and o["nodes"] == want_nodes
            assert o["hier_calls"] == len(o["results"])
            assert o["engine"] == (want_nodes.count(want_nodes[rank]) > 1)
            if o["engine"]:
                assert o["intra_shm"] == 2 * o["hier_calls"]  # reduce + broadcast per call
            assert o["other_op"] == [0, 1, 2, 3]
        for dtype in FLOATS + INTS:
            ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN) if dtype in FLOATS else (
                ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR)
            for op in ops:
                for shape in ((1,), (7, 3), (20011,)):
                    case = Case(idx, "all_reduce", dtype, shape, op=op)
                    got = [o["results"][idx] for o in per_rank]
                    want = _hier_expected(case, want_nodes, 4)
                    assert all(_same(g, got[0]) for g in got), f"ranks disagree on {case}"
                    assert _same(got[0], want), f"{case}: got {got[0]}, want {want}"
                    idx += 1
