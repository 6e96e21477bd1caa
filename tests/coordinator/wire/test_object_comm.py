"""Objects through the CPU group in pieces (``coordinator.wire.object_comm``):
point to point, broadcast through the group's communicator and plain gloo
broadcasts over a named group, at sizes around the piece boundary and above
one real piece."""

from __future__ import annotations

from typing import Any

import pytest
import torch

_SMALL_PIECE = 1000


def _payloads() -> list[tuple[str, Any]]:
    """Objects whose encodings are empty-ish, under, at and over a 1000-byte piece."""
    return [
        ("none", None),
        ("bytes-999", b"x" * 999),
        ("bytes-2000", b"y" * 2000),
        ("tensor-5x1001", torch.arange(5 * 1001, dtype=torch.int16).reshape(5, 1001)),
        ("nested", {"a": [torch.ones(700), b"z" * 1500], "b": ("s" * 3000, 7)}),
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def pieces(rank: int, world_size: int, piece: int, big: bool) -> list[str]:
    """Every path moves each payload intact; ``piece`` bytes per piece."""
    import torch.distributed as dist

    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.wire import object_comm

    kept, object_comm.PIECE_BYTES = object_comm.PIECE_BYTES, piece  # pool workers live on
    world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name="pieces", timeout=60)
    named = dist.new_group(list(range(world_size)), backend="gloo")
    cases = _payloads() if not big else [("bytes-70MiB", bytes(range(256)) * (70 << 12))]
    fails: list[str] = []
    try:
        for name, obj in cases:
            src = world_size - 1
            got = world.broadcast_object(obj if rank == src else None, src)
            if not _same(got, obj):
                fails.append(f"broadcast_object {name}")
            lst = [obj if rank == 0 else "stale"]
            world.broadcast_object_list(lst, 0, group=named)
            if not _same(lst[0], obj):
                fails.append(f"broadcast_object_list over a named group {name}")
            peer = (rank + 1) % world_size
            if world_size > 1:  # a ring: even ranks send first
                if rank % 2 == 0:
                    world.send_object(obj, peer)
                    got = world.recv_object((rank - 1) % world_size)
                else:
                    got = world.recv_object((rank - 1) % world_size)
                    world.send_object(obj, peer)
                if not _same(got, obj):
                    fails.append(f"send_object/recv_object {name}")
    finally:
        object_comm.PIECE_BYTES = kept
        dist.destroy_process_group(named)
        world.destroy()
    return fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_objects_cross_piece_boundaries_intact(dist_pool, world_size):
    results = dist_pool(world_size).run(pieces, _SMALL_PIECE, False, timeout=100)
    assert results == [[]] * world_size, results


@pytest.mark.timeout(120)
def test_an_object_larger_than_one_real_piece(dist_pool):
    from coordinator.wire.object_comm import PIECE_BYTES

    results = dist_pool(2).run(pieces, PIECE_BYTES, True, timeout=100)
    assert results == [[], []], results
