"""A group's CPU calls keep to the CPU whatever torch's default device is.

Under ``with torch.device(...)`` (or ``torch.set_default_device``) every
tensor a CPU transport allocates without naming a device would land on that
device, and a ``memmove`` of host bytes to its address would crash the
process. Each call below runs twice (the second time on its fast path) under
the ``meta`` device, which every torch build has, on CPU tensors made
outside it: object and tensor-dict broadcasts, objects and tensor dicts point
to point, and the tensor collectives; results are CPU tensors with the
sender's values.
"""

from __future__ import annotations

import pytest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=pytest.mark.distributed(world_size=2, timeout=100)),
    pytest.param(3, marks=pytest.mark.distributed(world_size=3, timeout=100)),
])
def test_group_calls_ignore_the_default_device(rank: int, world_size: int, group) -> None:
    import torch

    x = torch.arange(6.0 * world_size) + rank
    sent = {"ids": torch.arange(5), "h": torch.ones(2, 3) * 7, "step": 3}
    everyone = sum(torch.arange(6.0 * world_size) + r for r in range(world_size))
    for _ in range(2):
        with torch.device("meta"):
            obj = group.broadcast_object(sent if rank == 0 else None, 0)
            tdict = group.broadcast_tensor_dict(sent if rank == 0 else None, 0)
            if rank == 0:
                group.send_object(sent, 1)
                group.send_tensor_dict(sent, 1)
                got_obj = got_dict = sent
            elif rank == 1:
                got_obj = group.recv_object(0)
                got_dict = group.recv_tensor_dict(0)
            else:
                got_obj = got_dict = sent
            reduced = group.all_reduce(x)
            gathered = group.all_gather(x, 0)
            scattered = group.reduce_scatter(x, 0)
        for what, value in (("broadcast_object", obj), ("broadcast_tensor_dict", tdict),
                            ("recv_object", got_obj), ("recv_tensor_dict", got_dict)):
            for key in ("ids", "h"):
                assert value[key].device.type == "cpu", (what, key, value[key].device)
                assert torch.equal(value[key], sent[key]), (what, key)
            assert value["step"] == 3, what
        assert reduced.device.type == "cpu" and torch.equal(reduced, everyone)
        assert gathered.device.type == "cpu" and torch.equal(
            gathered, torch.cat([torch.arange(6.0 * world_size) + r for r in range(world_size)]))
        assert scattered.device.type == "cpu" and torch.equal(
            scattered, everyone.chunk(world_size)[rank])
