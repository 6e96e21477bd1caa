"""A CUDA group's ``irecv_tensor_dict`` keeps the gloo pair in step when it refuses a dict.

The sender of a ``send_tensor_dict`` with an ``all_gather_group`` sends slices;
an asynchronous receive without a group of that size cannot rebuild them and
raises. It used
to raise at the first sliced tensor, leaving the sender's tensors on the gloo
pair, where the next receive from that rank took them: gloo aborted the
receiver (SIGABRT) because they were longer than that receive's buffer. Now
every piece is received first and the problem reported afterwards.

No GPU here: the gloo part (``CudaP2P._recv_meta``) runs on CPU tensors over a
real two-rank gloo group; the metadata comes from a stand-in object channel
(its own transport is tested elsewhere), the tensors over gloo as the sender
sends them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

PROBE = 0x5EED


def _sliced_dict() -> dict[str, Any]:
    return {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6),
            "b": torch.ones(3, dtype=torch.float32), "n": 7}


def _sender_side_then_probe(rank: int, world_size: int, have: int | None) -> dict[str, Any]:
    import torch.distributed as dist

    from coordinator.p2p.cuda_p2p import CudaP2P
    from coordinator.wire.tensor_dict_format import flatten_tensor_dict

    parts = 2
    meta, payload = flatten_tensor_dict(_sliced_dict(), slicing={"a": True, "b": False},
                                        parts=parts)
    if rank == 0:  # what a blocking send_tensor_dict sends after the metadata, then more
        pieces = [payload[0].reshape(parts, -1)[0], payload[1]]
        for t in pieces:
            dist.send(t.contiguous(), dst=1)
        dist.send(torch.tensor([PROBE], dtype=torch.int64), dst=1)
        return {}
    p2p = CudaP2P.__new__(CudaP2P)
    p2p._group = SimpleNamespace(device=torch.device("cpu"), ranks=[0, 1],
                                 cpu_group=dist.group.WORLD)
    p2p._objects = SimpleNamespace(recv=lambda src, kind: meta)
    got: dict[str, Any] = {}
    gather = None if have is None else SimpleNamespace(world_size=have, rank_in_group=1)
    try:
        received, on_gpu, got["problem"] = p2p._recv_meta(0, gather)
        out = received.out
        got.update(keys=sorted(out), b=out["b"].tolist(), on_gpu=len(on_gpu),
                   sliced=[(k, t.tolist(), shape) for k, t, shape in received.sliced])
    except ValueError as e:  # how the old code refused: before receiving the pieces
        got["problem"] = str(e)
    probe = torch.zeros(1, dtype=torch.int64)
    dist.recv(probe, src=0)  # the next message from rank 0 is the probe, not a leftover
    return {**got, "probe": int(probe)}


@pytest.mark.parametrize("have", [None, 3], ids=["no-group", "group-of-3"])
def test_refused_sliced_dict_leaves_the_pair_in_step(dist_pool: Any, have: int | None) -> None:
    """Old code: the receiver dies of SIGABRT in its next receive."""
    out = dist_pool(2).run(_sender_side_then_probe, have, timeout=60)[1]
    assert "sliced tensor 'a'" in out["problem"]
    assert out["probe"] == PROBE
    assert out["keys"] == ["b", "n"] and out["b"] == [1.0, 1.0, 1.0] and out["on_gpu"] == 0
    assert out["sliced"] == []


def test_a_slice_for_the_receivers_group_is_kept_for_the_rebuild(dist_pool: Any) -> None:
    """With an all_gather_group of the sender's size, the slice is the dict's value and
    listed for the rebuild that the handle's wait() runs."""
    out = dist_pool(2).run(_sender_side_then_probe, 2, timeout=60)[1]
    assert out["problem"] == "" and out["probe"] == PROBE
    assert out["keys"] == ["a", "b", "n"] and out["b"] == [1.0, 1.0, 1.0]
    assert out["sliced"] == [("a", [float(i) for i in range(12)], (4, 6))]
