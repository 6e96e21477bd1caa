"""Issue 37: a member of the CPU group floods GroupCoordinator's object paths.

Rank 0 sends a set of 60,000 tuples sharing one hash (tens of seconds to build
on the receiver before the fix) in place of an object, point to point (raw gloo
sends) and as the source of ``broadcast_object`` (through the group's own
signed CPU communicator, with a codec that hands over the crafted bytes), and
a tensor dict whose 60,000 keys share one hash (the receiver builds the dict).
Rank 1 must raise :class:`DecodeError` naming rank 0 within a few seconds, and
the group keeps working.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

N = 60_000
BOUND_S = 5.0


class _Crafted:
    """An ``ObjectCodec`` that sends fixed bytes whatever the object."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def dumps(self, obj: Any) -> bytes:
        return self.data

    def loads(self, data: Any) -> Any:
        raise AssertionError("the attacker only sends")


def _timed(call: Any) -> tuple[str, str, tuple[Any, ...], float]:
    start = time.monotonic()
    try:
        got = call()
        return "returned", repr(got)[:100], (), time.monotonic() - start
    except Exception as e:
        return (type(e).__name__, str(e)[:300], tuple(getattr(e, "peers", ())),
                time.monotonic() - start)


def flooding_peer(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.p2p.link_offer import MAGIC
    from coordinator.wire.object_comm import DICT_META, LINK_OFFER, OBJECT
    from coordinator.wire.tensor_dict_format import VALUE
    from tests.shm_broadcast.codec.flooding import codec_set_frame, colliding_pairs, tuple_key

    world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name="flood", timeout=60)
    out: dict[str, Any] = {}
    try:
        pairs = colliding_pairs(N) if rank == 0 else []
        frame = codec_set_frame([tuple_key(p) for p in pairs]) if rank == 0 else b""
        if rank == 0:
            dist.send(torch.tensor([len(frame), 0, OBJECT], dtype=torch.int64), dst=1,
                      group=world.cpu_group)
            dist.send(torch.frombuffer(bytearray(frame), dtype=torch.uint8), dst=1,
                      group=world.cpu_group)
        else:
            out["recv"] = _timed(lambda: world.recv_object(0))
        world.barrier()
        if rank == 0:
            honest, world.codec = world.codec, _Crafted(frame)
            world.broadcast_object(None, 0)
            world.codec = honest
        else:
            out["bcast"] = _timed(lambda: world.broadcast_object(None, 0))
        if rank == 0:  # no shared-memory link for this direction, then the metadata
            world._objects.send([MAGIC, None], 1, LINK_OFFER)
            world._objects.send([[p, VALUE, 0] for p in pairs], 1, DICT_META)
        else:
            out["tensor-dict"] = _timed(lambda: world.recv_tensor_dict(0))
        out["after"] = world.broadcast_object({"ok": (1, 2)} if rank == 0 else None, 0)
    finally:
        world.destroy()
    return out


@pytest.mark.timeout(120)
def test_attack_a_flooded_object_is_refused_naming_the_sender(dist_pool):
    res = dist_pool(2).run(flooding_peer, timeout=100)
    for op in ("recv", "bcast"):
        kind, text, peers, took = res[1][op]
        assert kind == "DecodeError" and "object from rank 0: " in text, res[1]
        assert "share one hash" in text and peers == (0,) and took < BOUND_S, res[1]
    kind, text, peers, took = res[1]["tensor-dict"]
    assert kind == "DecodeError" and "share one hash" in text and took < BOUND_S, res[1]
    assert "from rank 0: " in text and peers == (0,), res[1]
    assert res[0]["after"] == res[1]["after"] == {"ok": (1, 2)}


def test_refused_metadata_names_the_sender():
    from coordinator.errors import DecodeError
    from coordinator.wire.tensor_dict_format import TENSOR, check_metadata

    bad = [["k", TENSOR, ["cpu", "float32", [-1], 0]]]
    with pytest.raises(DecodeError, match="from rank 3: ") as info:
        check_metadata(bad, "cpu", 3)
    assert info.value.peers == (3,)
    with pytest.raises(DecodeError) as info:
        check_metadata(bad, "cpu")
    assert info.value.peers == () and "from rank" not in str(info.value)
