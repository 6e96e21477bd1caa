"""Issue 37: the object exchanges' decoder (``decode_object``, which also reads
the stateless group's store values) against hash flooding, alone and over a
real gloo group.

A peer's set of 60,000 tuples sharing one hash used to take tens of seconds
to build on the receiver; now the receiver raises ``CollectiveMismatch`` (this
module's error for anything malformed from a peer) naming the sender within a
few seconds, and the group keeps working.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shm_broadcast.codec.hash_flooding import MAX_COLLISIONS
from shm_broadcast.codec.wire_format import EXT_MEMORYVIEW
from shm_broadcast.errors import CollectiveMismatch
from shm_broadcast.ranks.group_adapter import decode_object, encode_object, object_group
from tests.shm_broadcast.codec.flooding import (
    ADAPTER_FROZENSET,
    ADAPTER_PAIRS,
    ADAPTER_SET,
    ADAPTER_TUPLE,
    BOUND_S,
    N,
    adapter_frame,
    array_key,
    codec_set_frame,
    colliding_pairs,
    ext_frame,
    native_map_frame,
    nested_frozensets_frame,
    tuple_key,
)


def _frames(pairs: list[tuple[int, int]]) -> dict[str, bytes]:
    """The attacks in the bytes ``decode_object`` reads."""
    tuples = [tuple_key(p, ADAPTER_TUPLE) for p in pairs]
    codec_msg = codec_set_frame([tuple_key(p) for p in pairs])
    return {
        "set": adapter_frame(codec_set_frame(tuples, ADAPTER_SET)),
        "keyed-dict": adapter_frame(codec_set_frame(
            [b"\x92" + t + b"\x00" for t in tuples], ADAPTER_PAIRS)),
        "plain-map": adapter_frame(native_map_frame([array_key(p) for p in pairs])),
        "with-arrays": b"c" + struct.pack("<I", len(codec_msg)) + codec_msg,
    }


@pytest.fixture(scope="module")
def frames() -> dict[str, bytes]:
    return _frames(colliding_pairs(N))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["set", "keyed-dict", "plain-map", "with-arrays"])
def test_attack_colliding_items_are_refused_naming_the_sender(frames, name):
    start = time.monotonic()
    with pytest.raises(CollectiveMismatch, match="rank 3 of group 'g'.*share one hash"):
        decode_object(frames[name], source="rank 3 of group 'g'")
    assert time.monotonic() - start < BOUND_S



@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["own-format", "with-arrays"])
def test_attack_nested_colliding_frozensets_are_refused_naming_the_sender(route):
    # Each frozenset within the bound per container; every level multiplies the
    # cost of comparing them (quadratic in the frame; see docs/security-codec.md).
    if route == "own-format":
        data = adapter_frame(nested_frozensets_frame(4, ADAPTER_TUPLE, ADAPTER_FROZENSET))
    else:
        msg = nested_frozensets_frame(4)
        data = b"c" + struct.pack("<I", len(msg)) + msg
    start = time.monotonic()
    refused = f"rank 3 of group 'g'.*more than {MAX_COLLISIONS}"
    with pytest.raises(CollectiveMismatch, match=refused):
        decode_object(data, source="rank 3 of group 'g'")
    assert time.monotonic() - start < BOUND_S


@pytest.mark.timeout(60)
def test_attack_a_colliding_map_in_a_memoryview_payload_is_refused():
    msg = ext_frame(EXT_MEMORYVIEW, native_map_frame([array_key(p) for p in colliding_pairs(N)]))
    start = time.monotonic()
    with pytest.raises(CollectiveMismatch, match="rank 3 of group 'g'.*memoryview"):
        decode_object(b"c" + struct.pack("<I", len(msg)) + msg, source="rank 3 of group 'g'")
    assert time.monotonic() - start < BOUND_S


def test_ordinary_sets_and_keyed_dicts_still_round_trip():
    value = {"s": {(i, -i) for i in range(3000)}, "d": {(i, str(i)): i for i in range(3000)},
             "f": frozenset(range(100)), "deep": [[[[[[[[{(1, 2): {3}}]]]]]]]]}
    data = encode_object(value)
    assert len(data) > 4096
    assert decode_object(data) == value


# ---------------------------------------------------------------------- on real ranks
def _timed(call: Any) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        got = call()
        return "returned", repr(got)[:100], time.monotonic() - start
    except Exception as e:
        return type(e).__name__, str(e)[:300], time.monotonic() - start


def _flooding_peer(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 sends a colliding set in place of its object through the object
    exchanges (all-gather, then broadcast); rank 1 uses them honestly."""
    world = dist.group.WORLD
    og = object_group(world)
    out: dict[str, Any] = {}
    frame = _frames(colliding_pairs(N))["set"] if rank == 0 else b""
    if rank == 0:  # the all-gather's two steps, with the crafted bytes
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([len(frame)], dtype=torch.int64), group=world)
        width = max(int(s.item()) for s in sizes)
        data = torch.zeros(width, dtype=torch.uint8)
        data[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        dist.all_gather([torch.empty(width, dtype=torch.uint8) for _ in range(world_size)],
                        data, group=world)
    else:
        out["gather"] = _timed(lambda: og.all_gather("honest"))
    dist.barrier(group=world)
    if rank == 0:
        dist.broadcast(torch.tensor([len(frame)], dtype=torch.int64), src=0, group=world)
        dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), src=0, group=world)
    else:
        out["bcast"] = _timed(lambda: og.broadcast(None, src=0))
    dist.barrier(group=world)
    out["after"] = og.all_gather(("still", rank))
    return out


@pytest.mark.timeout(120)
def test_attack_a_peer_flooding_an_object_exchange_is_named_quickly(dist_pool):
    res = dist_pool(2).run(_flooding_peer, timeout=100)
    for op in ("gather", "bcast"):
        kind, text, took = res[1][op]
        assert kind == "CollectiveMismatch" and "rank 0" in text, res[1]
        assert "share one hash" in text and took < BOUND_S, res[1]
    assert res[0]["after"] == res[1]["after"] == [("still", 0), ("still", 1)]

