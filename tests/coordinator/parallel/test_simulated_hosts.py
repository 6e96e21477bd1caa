"""An engine spread over two simulated hosts (``GROUPCOORD_NODE_ID`` per rank).

Real processes on one machine, but every layer treats the two halves of the
world as different nodes: message-queue readers on the other half connect over
TCP, the CPU communicator runs its hierarchical all-reduce, pipeline hops cross
the "hosts" over gloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coordinator import parallel_state as ps
from coordinator.testing import run_distributed
from device_comms import ReduceOp


def _hosts(world_size: int) -> list[dict[str, str]]:
    return [{"GROUPCOORD_NODE_ID": f"host{r * 2 // world_size}"} for r in range(world_size)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_group_across_two_hosts(world_size):
    res = run_distributed(whole_world_tp, world_size, env=_hosts(world_size), timeout=150)
    local = [r * 2 // world_size == 0 for r in range(world_size)]
    for rank, r in enumerate(res):
        assert r["same_node"] == local
        expected = "writer" if rank == 0 else ("shm" if local[rank] else "tcp")
        assert r["transport"] == expected, (rank, r["transport"])
        # One rank per host leaves nothing to share memory with: plain gloo.
        assert r["comm_mode"] == ("hierarchical" if world_size > 2 else "gloo")
        assert r["handle_secret"] is None  # each remote reader made its own keypair
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
    res = run_distributed(tp_within_pp_across, 4, env=_hosts(4), timeout=150)
    for r in res:
        assert r["tp_same_node"] == [True, True]
        assert r["pp_same_node"] == [True, False]
        assert r["tp_comm_mode"] == "shm"
        assert r["pp_ok"] and r["tp_all_reduce_ok"]


# ---------------------------------------------------------------------- on the ranks
def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _metadata(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "req_ids": [f"r{step}-{i}" for i in range(step % 5 + 1)],
        "positions": torch.arange(step, step + 7, dtype=torch.int64),
        "block_table": torch.arange(12, dtype=torch.int32).view(3, 4) + step,
        "temperature": torch.full((3,), 0.5 + step, dtype=torch.bfloat16),
        "flags": (True, None, step),
    }


def whole_world_tp(rank: int, world_size: int) -> dict[str, Any]:
    """TP over every rank (both hosts): queue readers, collectives, result queues."""
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = ps.get_tp_group()
    out: dict[str, Any] = {
        "same_node": ps.in_the_same_node_as(tp, source_rank=0),
        "transport": tp.mq_broadcaster.transport if tp.mq_broadcaster is not None else None,
        "comm_mode": getattr(tp.device_communicator, "mode", None),
        # The TP queue's handle went over gloo: it must hold public keys only.
        "handle_secret": (tp.mq_broadcaster.export_handle().curve_client_secret
                          if rank == 0 and tp.mq_broadcaster is not None else None),
    }
    ok = True
    for step in range(12):
        sent = _metadata(step)
        got = tp.broadcast_tensor_dict(sent if tp.rank_in_group == 0 else None)
        ok &= got["req_ids"] == sent["req_ids"] and got["flags"] == sent["flags"]
        for k in ("positions", "block_table", "temperature"):
            ok &= torch.equal(got[k], sent[k]) and got[k].dtype == sent[k].dtype
    out["metadata_ok"] = bool(ok)

    # Collectives across the two hosts: exact against a rank-ordered reference.
    xs = [_input(r, (5, 33), torch.float32, 1) for r in range(world_size)]
    ref = xs[0].clone()
    for x in xs[1:]:
        ref += x
    red = tp.all_reduce(xs[rank])
    out["all_reduce_err"] = float((red - ref).abs().max())
    out["all_reduce_bits"] = red.view(torch.int32).sum().item()
    ints = [_input(r, (17,), torch.int64, 2) for r in range(world_size)]
    out["all_reduce_max_ok"] = torch.equal(
        tp.all_reduce(ints[rank], ReduceOp.MAX), torch.stack(ints).amax(0))
    gathered = tp.all_gather(xs[rank], dim=0)
    out["all_gather_ok"] = torch.equal(gathered, torch.cat(xs, 0))
    big = [_input(r, (world_size * 3, 8), torch.int32, 3) for r in range(world_size)]
    rs = tp.reduce_scatter(big[rank], dim=0)
    out["reduce_scatter_ok"] = torch.equal(rs, torch.stack(big).sum(0)[rank * 3 : rank * 3 + 3])
    obj = tp.broadcast_object({"from": "last", "ids": (1, 2)} if rank == world_size - 1 else None,
                              src=world_size - 1)
    out["object_ok"] = obj == {"from": "last", "ids": (1, 2)}

    # Results back to the driver: every rank writes to rank 0, across hosts too.
    writer, readers = tp.create_single_reader_mq_broadcasters(reader_rank_in_group=0,
                                                              blocking=True)
    try:
        if rank == 0:
            got_back = {r: q.dequeue(timeout=30) for r, q in enumerate(readers) if q is not None}
            out["results_ok"] = got_back == {r: {"rank": r, "tokens": [r] * 3}
                                             for r in range(1, world_size)}
            out["result_transports"] = {r: q.transport for r, q in enumerate(readers)
                                        if q is not None}
        else:
            writer.enqueue({"rank": rank, "tokens": [rank] * 3})
    finally:
        for q in [writer, *readers]:
            if q is not None:
                q.close()
    tp.barrier()
    return out


def tp_within_pp_across(rank: int, world_size: int) -> dict[str, Any]:
    """TP inside each host, PP across hosts: tensor dicts hop from host0 to host1."""
    half = world_size // 2
    ps.initialize_model_parallel(tensor_model_parallel_size=half, pipeline_model_parallel_size=2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    out: dict[str, Any] = {
        "tp_same_node": ps.in_the_same_node_as(tp, 0),
        "pp_same_node": ps.in_the_same_node_as(pp, 0),
        "tp_comm_mode": getattr(tp.device_communicator, "mode", None),
    }
    hidden = _input(rank % half, (4, 16), torch.float32, 4)
    if pp.is_first_rank:
        pp.send_tensor_dict({"hidden": hidden, "residual": hidden * 2, "step": 3})
        out["pp_ok"] = True
    else:
        got = pp.recv_tensor_dict()
        out["pp_ok"] = (got["step"] == 3 and torch.equal(got["hidden"], hidden)
                        and torch.equal(got["residual"], hidden * 2))
    xs = [_input(r, (9,), torch.float32, 5) for r in range(half)]
    ref = xs[0].clone()
    for x in xs[1:]:
        ref += x
    out["tp_all_reduce_ok"] = torch.equal(tp.all_reduce(xs[tp.rank_in_group]), ref)
    return out
