"""Object exchanges of shm_broadcast.ranks.group_adapter: msgpack over gloo, never pickle.

Setup exchanges (node detection, queue handles, the CPU communicator's
workspace) run in real ranks whose ``pickle.loads``/``pickle.Unpickler`` (and
torch's own reference to the unpickler) raise. A peer that sends a huge size,
malformed bytes or a pickle gets a ``CollectiveMismatch`` and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.testing import free_port
from shm_broadcast.errors import CollectiveMismatch
from shm_broadcast.ranks.group_adapter import (
    MAX_DEPTH,
    MAX_OBJECT_BYTES,
    decode_object,
    encode_failure,
    encode_object,
    object_group,
)

SAMPLES: list[Any] = [
    None, True, -(2**63), 2**64 - 1, 1.5, "", "text", b"\x00\xff", [], (), set(), frozenset(),
    {"a": (1, 2), "b": [b"x", {"c": None}]}, {(1, "x"): frozenset({2})}, {1: "one"},
    ("ok", b"handle-bytes"), [("nested", (("tuple",),))],
]


class _CreateFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


# ---------------------------------------------------------------------- in one process
@pytest.mark.parametrize("obj", SAMPLES, ids=range(len(SAMPLES)))
def test_every_carried_type_round_trips_exactly(obj: Any) -> None:
    back = decode_object(encode_object(obj))
    assert back == obj and type(back) is type(obj)


@pytest.mark.parametrize("obj, named", [
    (_CreateFile("/x"), "_CreateFile"), (1 + 2j, "complex"),
    ([{"k": object()}], "builtins.object"), ({"t": torch.zeros(2), "c": 1j}, "complex"),
])
def test_uncarried_types_name_the_type_and_the_opt_in(obj: Any, named: str) -> None:
    with pytest.raises(TypeError, match=named) as e:
        encode_object(obj)
    assert "allow_pickle=True" in str(e.value)


def test_tensors_arrays_and_big_ints_travel_in_the_queue_format() -> None:
    import numpy as np

    obj = {"t": torch.arange(6).reshape(2, 3).t(), "bf": torch.ones(2, dtype=torch.bfloat16),
           "a": np.arange(4, dtype=np.int16), "big": 2**64, "k": ("x", [1.5, None])}
    data = encode_object(obj)
    back = decode_object(data)
    assert back["t"].equal(obj["t"]) and back["bf"].dtype == torch.bfloat16
    assert back["a"].dtype == np.int16 and back["a"].tolist() == [0, 1, 2, 3]
    assert back["big"] == 2**64 and back["k"] == ("x", [1.5, None])
    # Truncated or lying bytes are refused, never read past their end.
    for bad in (data[:3], data[:20], data[:1] + b"\xff\xff\xff\x7f" + data[5:]):
        with pytest.raises(CollectiveMismatch, match="malformed"):
            decode_object(bad)


def test_depth_and_size_limits() -> None:
    deep: list = []
    cur = deep
    for _ in range(MAX_DEPTH + 1):
        cur.append([])
        cur = cur[0]
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels"):
        encode_object(deep)
    with pytest.raises(ValueError, match="more than"):
        encode_object(b"x" * (MAX_OBJECT_BYTES + 1))
    with pytest.raises(CollectiveMismatch, match="outside"):
        decode_object(b"")


def test_pickled_or_failed_payloads_are_refused_unread(tmp_path) -> None:
    marker = tmp_path / "pwned"
    evil = b"p" + pickle.dumps(_CreateFile(str(marker)))
    with pytest.raises(CollectiveMismatch, match="was not unpickled"):
        decode_object(evil)
    assert not marker.exists()
    with pytest.raises(CollectiveMismatch, match="could not produce its object: why"):
        decode_object(encode_failure("why"))
    assert decode_object(encode_object(1 + 2j, allow_pickle=True), allow_pickle=True) == 1 + 2j


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=20), st.binary(max_size=20))
_hashables = st.recursive(_scalars, lambda c: st.tuples(c, c) | st.frozensets(c, max_size=3),
                          max_leaves=6)
_objects = st.recursive(
    _hashables,
    lambda c: (st.lists(c, max_size=4) | st.tuples(c, c) | st.sets(_hashables, max_size=3)
               | st.dictionaries(st.text(max_size=5), c, max_size=3)
               | st.dictionaries(_hashables, c, max_size=3)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_objects)
def test_round_trip_is_exact_for_generated_objects(obj: Any) -> None:
    back = decode_object(encode_object(obj))
    assert back == obj and _same_types(back, obj)


def _same_types(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (equal) have the same container and scalar types throughout."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        keys = {type(k): k for k in a}
        return all(type(k) in keys for k in b) and all(_same_types(a[k], b[k]) for k in a)
    return True


@pytest.mark.parametrize("n", [pytest.param(20_000, id="short"),
                               pytest.param(100_000, id="100k", marks=pytest.mark.slow)])
def test_malformed_bytes_raise_only_collective_mismatch(n: int) -> None:
    rng = random.Random(n)
    seeds = [encode_object(o) for o in SAMPLES] + [b"m\xdd\xff\xff\xff\xff", b"m\xc7\xff\x01"]
    for _ in range(n):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.6 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op < 0.8:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
            elif data:
                del data[rng.randrange(len(data)):]
        with contextlib.suppress(CollectiveMismatch):
            decode_object(bytes(data))


# ---------------------------------------------------------------------- on real ranks
def test_setup_exchanges_work_with_pickle_loads_disabled(dist_pool) -> None:
    res = dist_pool(3).run(_rank_without_pickle, free_port(), timeout=120)
    for r in res:
        assert r["old_path"].startswith("RuntimeError: pickle is disabled"), r["old_path"]
        assert r["bcast"] == {"src": 0, "t": (1, 2), "s": {3}}
        assert r["gather"] == [("rank", i) for i in range(3)]
        assert r["same_node"] == [True, True, True]
        assert r["mq"] == {"step": 1, "ids": [1, 2, 3]}
        assert r["cpu_allreduce"] == [3.0, 3.0]
        assert r["stateless_gather"] == [(i, b"x") for i in range(3)]
        assert r["stateless_mq"] == {"over": "stateless"}


def test_peer_payloads_are_checked_before_use(dist_pool, tmp_path) -> None:
    marker = str(tmp_path / "pwned")
    res = dist_pool(2).run(_rank_hostile_peer, marker, timeout=120)
    r = res[1]
    assert "announced an object of 1099511627776 bytes" in r["huge"], r
    assert "announced an object of -5 bytes" in r["negative"], r
    assert "malformed" in r["garbage"], r
    assert "was not unpickled" in r["pickle"], r
    assert r["after"] == ("still", "working")
    assert not os.path.exists(marker)


def test_a_source_that_cannot_encode_fails_every_rank(dist_pool) -> None:
    res = dist_pool(2).run(_rank_unencodable, timeout=120)
    assert res[0]["bcast"].startswith("TypeError") and "complex" in res[0]["bcast"]
    assert res[1]["bcast"].startswith("CollectiveMismatch") and "rank 0" in res[1]["bcast"]
    assert res[0]["gather"].startswith("CollectiveMismatch") and "rank 1" in res[0]["gather"]
    assert res[1]["gather"].startswith("TypeError")
    assert res[0]["after"] == res[1]["after"] == [0, 1]


# ---------------------------------------------------------------------- rank functions
def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("pickle is disabled in this rank")


class _NoUnpickler:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse()


def _without_pickle(fn: Callable[[], dict]) -> dict:
    """Run ``fn`` with every unpickling entry point (pickle's and torch's) raising."""
    import torch.distributed.distributed_c10d as c10d

    saved = (pickle.loads, pickle.load, pickle.Unpickler, c10d._unpickler)
    pickle.loads, pickle.load = _refuse, _refuse  # type: ignore[assignment]
    pickle.Unpickler = c10d._unpickler = _NoUnpickler  # type: ignore[misc,assignment]
    try:
        return fn()
    finally:
        pickle.loads, pickle.load, pickle.Unpickler, c10d._unpickler = saved  # type: ignore[misc]


def _rank_without_pickle(rank: int, world_size: int, port: int) -> dict:
    return _without_pickle(lambda: _exchanges(rank, world_size, port))


def _exchanges(rank: int, world_size: int, port: int) -> dict:
    from coordinator.stateless.stateless_group import StatelessProcessGroup
    from device_comms.cpu.communicator import CpuCommunicator
    from shm_broadcast.queue.message_queue import MessageQueue
    from shm_broadcast.ranks.topology import in_the_same_node_as

    create_from_process_group = MessageQueue.create_from_process_group

    out: dict[str, Any] = {}
    world = dist.group.WORLD
    try:  # torch's own object collective unpickles: it must fail here
        dist.all_gather_object([None] * world_size, rank, group=world)
        out["old_path"] = "worked"
    except RuntimeError as e:
        out["old_path"] = _err(e)
    og = object_group(world)
    out["bcast"] = og.broadcast({"src": 0, "t": (1, 2), "s": {3}} if rank == 0 else None, src=0)
    out["gather"] = og.all_gather(("rank", rank))
    out["same_node"] = in_the_same_node_as(world, source_rank=0)
    mq = create_from_process_group(world, 1 << 16, 4, writer_rank=0, timeout=30)
    out["mq"] = _queue_round(mq, rank, {"step": 1, "ids": [1, 2, 3]})
    comm = CpuCommunicator(world, torch.device("cpu"), unique_name="nopickle")
    try:
        out["cpu_allreduce"] = comm.all_reduce(torch.ones(2)).tolist()
    finally:
        comm.destroy()
    sg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, timeout=30, name="np")
    out["stateless_gather"] = object_group(sg).all_gather((rank, b"x"))
    mq = create_from_process_group(sg, 1 << 16, 4, writer_rank=0, timeout=30)
    out["stateless_mq"] = _queue_round(mq, rank, {"over": "stateless"})
    sg.barrier()
    sg.close()
    return out


def _queue_round(mq: Any, rank: int, obj: Any) -> Any:
    try:
        if rank == 0:
            mq.enqueue(obj, timeout=30)
            return obj
        return mq.dequeue(timeout=30)
    finally:
        mq.close()


def _rank_hostile_peer(rank: int, world_size: int, marker: str) -> dict:
    """Rank 0 plays a hostile gloo peer with raw tensor broadcasts; rank 1 is honest."""
    world = dist.group.WORLD
    og = object_group(world)
    evil = b"p" + pickle.dumps(_CreateFile(marker))
    out: dict[str, Any] = {}
    for what, size, body in (("huge", 2**40, None), ("negative", -5, None),
                             ("garbage", 6, b"m\xdd\xff\xff\xff\xff"), ("pickle", len(evil), evil)):
        if rank == 0:
            dist.broadcast(torch.tensor([size], dtype=torch.int64), src=0, group=world)
            if body is not None:
                dist.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8), src=0,
                               group=world)
        else:
            try:
                out[what] = repr(og.broadcast(None, src=0))
            except CollectiveMismatch as e:
                out[what] = _err(e)
        dist.barrier(group=world)
    out["after"] = og.broadcast(("still", "working") if rank == 0 else None, src=0)
    return out


def _rank_unencodable(rank: int, world_size: int) -> dict:
    og = object_group(dist.group.WORLD)
    out: dict[str, Any] = {}
    try:
        out["bcast"] = repr(og.broadcast(1 + 2j if rank == 0 else None, src=0))
    except (TypeError, CollectiveMismatch) as e:
        out["bcast"] = _err(e)
    try:
        out["gather"] = repr(og.all_gather(object() if rank == 1 else rank))
    except (TypeError, CollectiveMismatch) as e:
        out["gather"] = _err(e)
    out["after"] = og.all_gather(rank)
    return out
