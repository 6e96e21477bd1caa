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
    # A NumPy peer on one side, an int peer or an asynchronous call on the other (a
    # blocking call with a NumPy peer took gloo while its partner took the link: both
    # waited until the group's timeout).
    if rank % 2 == 0:
        g.send(x + 2, dst=num(nxt))
        out["irecv_of_send"] = g.irecv((x.shape, x.dtype), src=prev).wait().tolist()
    else:
        out["irecv_of_send"] = g.irecv((x.shape, x.dtype), src=prev).wait().tolist()
        g.send(x + 2, dst=num(nxt))
    handle = g.isend(x + 3, dst=nxt)
    out["recv_of_isend"] = g.recv(x.shape, x.dtype, src=num(prev)).tolist()
    handle.wait()
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["int64", "int32"])
def test_a_queue_made_with_numpy_ints_works(kind: str) -> None:
    """Every int a queue takes (sizes, ranks) as a NumPy integer: the handle
    encodes, a reader attaches, a message goes through."""
    from shm_broadcast import Handle, MessageQueue

    num = getattr(np, kind)
    w = MessageQueue(num(1), num(1), [num(1)], max_chunk_bytes=num(1 << 16),
                     max_chunks=num(4), writer_rank=num(0))
    try:
        handle = w.export_handle(num(1))
        assert Handle.from_bytes(handle.to_bytes()) == handle
        r = MessageQueue.create_from_handle(handle, num(1))
        try:
            w.wait_until_ready(30)
            r.wait_until_ready(30)
            w.enqueue({"step": 1})
            assert r.dequeue(timeout=10) == {"step": 1}
        finally:
            r.close()
    finally:
        w.close()


@pytest.mark.timeout(120)
def test_group_queues_made_with_numpy_ints(dist_pool) -> None:
    outs = dist_pool(2).run(group_queues_with_numpy_ints, timeout=90)
    assert outs == [[{"n": 1}, {"n": 2}]] * 2, outs


def group_queues_with_numpy_ints(rank: int, world_size: int) -> list[Any]:
    import torch.distributed as dist

    from coordinator import parallel_state as ps
    from shm_broadcast import MessageQueue

    got = []
    mq = MessageQueue.create_from_process_group(
        dist.group.WORLD, np.int64(1 << 16), np.int64(4), writer_rank=np.int64(0),
        reader_ranks=[np.int64(1)])
    with mq:
        got.append(mq.broadcast_object({"n": 1} if rank == 0 else None))
    g = ps.get_world_group()
    bq = g.create_mq_broadcaster(np.int64(0), max_chunk_bytes=np.int64(1 << 16),
                                 max_chunks=np.int32(4))
    with bq:
        got.append(bq.broadcast_object({"n": 2} if rank == 0 else None))
    g.barrier()
    return got


@pytest.mark.timeout(120)
def test_a_stateless_group_made_with_numpy_ints(dist_pool) -> None:
    from coordinator.testing import free_port

    outs = dist_pool(2).run(stateless_with_numpy_ints, free_port(), timeout=90)
    assert outs == [[0, 1]] * 2, outs


def stateless_with_numpy_ints(rank: int, world_size: int, port: int) -> list[int]:
    from coordinator import StatelessProcessGroup

    g = StatelessProcessGroup.create("127.0.0.1", np.int64(port), np.int64(rank),
                                     np.int64(world_size), timeout=30, name="np",
                                     data_expiration_seconds=np.int32(3600))
    try:
        assert type(g.rank) is int and type(g.world_size) is int
        return g.all_gather_obj(g.rank)
    finally:
        g.barrier()
        g.close()
