"""NumPy integers where a call takes a rank, a dim or sizes (vLLM's calls take
them: a rank read out of an array is an ``np.int64``): every call gives what
the same call with Python ints gives, and a bool or a float is still refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from device_comms import validation
from shm_broadcast import checks

INT_KINDS = ["int64", "int32", "uint8"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", INT_KINDS)
def test_numpy_ints_give_what_ints_give(dist_pool, world_size: int, kind: str) -> None:
    outs = dist_pool(world_size).run(calls_with, kind, timeout=150)
    for rank, (with_numpy, with_ints) in enumerate(outs):
        assert with_numpy == with_ints, f"rank {rank}: {with_numpy} != {with_ints}"
        assert with_numpy["types"] == ["int"], with_numpy["types"]


def calls_with(rank: int, world_size: int, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every call taking a rank/dim/sizes, once with NumPy integers and once with ints."""
    num = getattr(np, kind)
    return _calls(rank, world_size, num), _calls(rank, world_size, int)


def _calls(rank: int, world_size: int, num: Any) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    g = ps.get_world_group()
    root = world_size - 1
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    x = torch.arange(6.0).view(2, 3) + 10 * rank
    out: dict[str, Any] = {}
    out["broadcast"] = g.broadcast(x.clone(), src=num(root)).tolist()
    out["all_gather"] = g.all_gather(x, dim=num(0)).tolist()
    gathered = g.gather(x, dst=num(root), dim=num(1))
    out["gather"] = None if gathered is None else gathered.tolist()
    sizes = [num(1 + (r % 2)) for r in range(world_size)]
    mine = int(sizes[rank])
    out["all_gatherv"] = g.all_gatherv(torch.full((mine, 2), float(rank)), dim=0,
                                       sizes=sizes).tolist()
    whole = torch.arange(float(sum(int(s) for s in sizes) * 2)).view(-1, 2)
    out["reduce_scatterv"] = g.reduce_scatterv(whole, dim=num(0), sizes=sizes).tolist()
    src_in = torch.arange(float(world_size * 2)) if rank == root else None
    out["scatter"] = g.scatter(src_in, src=num(root), dim=num(0)).tolist()
    out["broadcast_object"] = g.broadcast_object({"from": rank} if rank == root else None,
                                                 src=num(root))
    sent = {"t": x, "step": 3} if rank == root else None
    got = g.broadcast_tensor_dict(sent, src=num(root))
    out["broadcast_tensor_dict"] = [got["t"].tolist(), got["step"]]
    # Point to point around the ring: even ranks send first (a ring of 3 has two
    # senders in a row, which the calls' own buffering takes).
    if rank % 2 == 0:
        g.send(x, dst=num(nxt))
        out["recv"] = g.recv(x.shape, x.dtype, src=num(prev)).tolist()
    else:
        out["recv"] = g.recv(x.shape, x.dtype, src=num(prev)).tolist()
        g.send(x, dst=num(nxt))
    handle = g.isend(x + 1, dst=num(nxt))
    out["irecv"] = g.irecv((x.shape, x.dtype), src=num(prev)).wait().tolist()
    handle.wait()
    if rank % 2 == 0:
        g.send_object({"to": nxt}, dst=num(nxt))
        out["recv_object"] = g.recv_object(src=num(prev))
    else:
        out["recv_object"] = g.recv_object(src=num(prev))
        g.send_object({"to": nxt}, dst=num(nxt))
    sending = g.isend_tensor_dict({"h": x * 2}, dst=num(nxt))
    out["irecv_tensor_dict"] = g.irecv_tensor_dict(src=num(prev)).wait()["h"].tolist()
    sending.wait()
    out["types"] = sorted({type(validation.check_rank(num(0), world_size, "src")).__name__,
                           type(validation.norm_dim(num(1), 2)).__name__})
    g.barrier()
    return out


@pytest.mark.parametrize("value", [True, np.bool_(True), 1.0, np.float32(1.0), "1", None,
                                   torch.tensor(1)],
                         ids=["bool", "np.bool_", "float", "np.float32", "str", "None",
                              "tensor"])
@pytest.mark.parametrize("check", ["check_rank", "check_int", "norm_dim"])
def test_non_integers_are_still_refused(check: str, value: Any) -> None:
    call = {"check_rank": lambda v: checks.check_rank(v, 4, "src"),
            "check_int": lambda v: checks.check_int(v, "n"),
            "norm_dim": lambda v: validation.norm_dim(v, 2)}[check]
    with pytest.raises(TypeError, match=type(value).__name__):
        call(value)


@pytest.mark.parametrize("kind", INT_KINDS)
def test_numpy_ranks_out_of_range_are_refused(kind: str) -> None:
    num = getattr(np, kind)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 2\), got 5"):
        checks.check_rank(num(5), 2, "src")
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 2\)"):
        validation.norm_dim(num(2), 2)
