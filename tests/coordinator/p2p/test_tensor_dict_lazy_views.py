"""Tensor dicts carry the values of lazily negated and odd-strided one-element tensors.

``z.conj().imag`` of one element is contiguous but its bytes hold the negated
values; ``x[3:4:2]`` is contiguous with stride 2. A dict holding them must
arrive with their values, by broadcast and by pipeline send/recv.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _dict(rank: int) -> dict[str, Any]:
    neg = torch.complex(torch.zeros(1), torch.full((1,), -(rank + 2.0))).conj().imag
    odd = torch.full((4,), rank + 5.0).as_strided((1,), (2,))
    return {"neg": neg, "odd": odd, "plain": torch.arange(3.0) + rank}


def _want(rank: int) -> dict[str, list[float]]:
    return {"neg": [rank + 2.0], "odd": [rank + 5.0], "plain": [rank + 0.0, rank + 1.0, rank + 2.0]}


def lazy_dict_rank(rank: int, world_size: int) -> list[str]:
    from coordinator import parallel_state as ps

    world = ps.get_world_group()
    bad: list[str] = []
    got = world.broadcast_tensor_dict(_dict(0) if rank == 0 else None, src=0)
    if {k: v.tolist() for k, v in got.items()} != _want(0):
        bad.append(f"broadcast: {got}")
    if rank == 0:
        world.send_tensor_dict(_dict(0), dst=1)
    elif rank == 1:
        got = world.recv_tensor_dict(src=0)
        if {k: v.tolist() for k, v in got.items()} != _want(0):
            bad.append(f"send/recv: {got}")
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_lazy_views_in_tensor_dicts(dist_pool: Any, world_size: int) -> None:
    assert dist_pool(world_size).run(lazy_dict_rank, timeout=80) == [[]] * world_size
