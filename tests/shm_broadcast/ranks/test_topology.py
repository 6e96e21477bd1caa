"""Node detection (shm_broadcast.ranks.topology) against a source that sends a malformed record.

The source rank of ``in_the_same_node_as`` announces ``(segment name, magic,
node id)``; the other ranks attach the named segment. A record that is not
one (another shape, a name that is not one of our segments, magic of another
length, a huge node id) must make every rank raise ``DecodeError`` naming the
source, and nothing may be attached by a name the peer chose.
"""

from __future__ import annotations

from typing import Any

import pytest

from shm_broadcast.errors import DecodeError
from shm_broadcast.ranks.agreement import agree
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.ranks.topology import in_the_same_node_as

BAD_RECORDS = {
    "not-a-tuple": "gc_node_1_ab",
    "two-fields": ("gc_node_1_ab", b"x" * 16),
    "foreign-name": ("../../etc/passwd", b"x" * 16, None),
    "other-prefix": ("psm_deadbeef", b"x" * 16, None),
    "name-then-newline": ("gc_node_1_ab\n", b"x" * 16, None),
    "short-magic": ("gc_node_1_ab", b"x" * 3, None),
    "huge-node-id": (None, b"x" * 16, "n" * 100_000),
    "name-and-node-id": ("gc_node_1_ab", b"x" * 16, "nodeA"),
    "magic-not-bytes": (None, "x" * 16, "nodeA"),
}


def _malformed_source(rank: int, world_size: int, record_id: str) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    if rank == 0:  # the attacker speaks the protocol with a record of its own making
        og = object_group(group)
        agree(og, None, "in_the_same_node_as", "attacker", 0)  # the agreement step
        og.broadcast(BAD_RECORDS[record_id], src=0, op="in_the_same_node_as")
        flags = og.all_gather(True, op="in_the_same_node_as")
        in_the_same_node_as(group, source_rank=1)
        return {"flags": [repr(f) for f in flags]}
    try:
        in_the_same_node_as(group, source_rank=0)
    except DecodeError as e:
        error: dict[str, Any] | None = {"type": type(e).__name__, "msg": str(e)}
    else:
        error = None
    again = in_the_same_node_as(group, source_rank=1)  # the group is still usable
    return {"error": error, "again": again}


def _lying_verdict(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    if rank == world_size - 1:  # answers with something that is not a bool
        og = object_group(group)
        agree(og, None, "in_the_same_node_as", "attacker", 0)  # the agreement step
        og.broadcast(None, src=0, op="in_the_same_node_as")
        og.all_gather(["yes"], op="in_the_same_node_as")
        return {}
    try:
        in_the_same_node_as(group, source_rank=0)
    except DecodeError as e:
        return {"msg": str(e)}
    return {"msg": None}


#: The records every default run sends; the others run with ``-m slow``.
_CI_RECORDS = ("foreign-name", "huge-node-id", "two-fields")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [3])
@pytest.mark.parametrize("record_id", [
    r if r in _CI_RECORDS else pytest.param(r, marks=pytest.mark.slow)
    for r in sorted(BAD_RECORDS)])
def test_malformed_source_record_raises_on_every_rank(dist_pool: Any, world_size: int,
                                                      record_id: str) -> None:
    outs = dist_pool(world_size).run(_malformed_source, record_id, timeout=30)
    assert outs[0]["flags"][0] == "True"
    assert all(f == "'unreadable'" for f in outs[0]["flags"][1:])
    for r in range(1, world_size):
        error = outs[r]["error"]
        assert error is not None and error["type"] == "DecodeError", outs[r]
        assert "source rank 0" in error["msg"] and "malformed" in error["msg"]
        assert all(outs[r]["again"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_verdict_that_is_not_a_bool_raises_naming_its_rank(dist_pool: Any,
                                                           world_size: int) -> None:
    outs = dist_pool(world_size).run(_lying_verdict, timeout=30)
    liar = world_size - 1
    for r in range(liar):
        assert outs[r]["msg"] is not None and f"rank(s) [{liar}]" in outs[r]["msg"], outs[r]


# ---------------------------------------------------------------------- agreement, probe faults
def _disagreeing_sources(rank: int, world_size: int, how: str) -> str:
    import time

    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    last = rank == world_size - 1
    source: Any = 0
    if last:
        source = world_size + 5 if how == "bad" else 1
    start = time.monotonic()
    try:
        in_the_same_node_as(group, source_rank=source, name="probe")
        outcome = "returned"
    except Exception as e:  # the parent checks which rank raised what
        outcome = f"{type(e).__name__}: {e}"
    assert time.monotonic() - start < 10, outcome
    in_the_same_node_as(group, source_rank=0)  # still usable
    return outcome


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["bad", "other"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_on_the_source_all_raise_at_once(dist_pool: Any, world_size: int,
                                                             how: str) -> None:
    """A bad ``source_rank`` on the last rank: it raised alone, the others waited in
    the probe's broadcast until the timeout; another valid one: every rank did."""
    outs = dist_pool(world_size).run(_disagreeing_sources, how, timeout=45)
    for rank, out in enumerate(outs):
        if how == "bad" and rank == world_size - 1:
            assert out.startswith("ValueError") and "source_rank" in out, out
        elif how == "bad":
            assert out.startswith("PeerRejectedError") and f"rank {world_size - 1}" in out, out
        else:
            assert out.startswith("CollectiveMismatch") and "'probe'" in out, (rank, out)


def _source_without_shared_memory(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shm_broadcast.lifecycle.segment as segment
    from device_comms.cpu.communicator import CpuCommunicator

    free = segment.shm_free_bytes
    if rank == 0:  # this host's /dev/shm is full, as the probe's source sees it
        segment.shm_free_bytes = lambda: 0
    out: dict[str, Any] = {}
    try:
        try:
            in_the_same_node_as(dist.group.WORLD, source_rank=0, name="full")
            out["probe"] = "returned"
        except Exception as e:  # the parent checks which rank raised what
            out["probe"] = f"{type(e).__name__}: {e}"
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="full")
        try:
            out["mode"], out["why"] = comm.mode, comm.fallback_reason
            out["sum"] = comm.all_reduce(torch.ones(2)).tolist()
        finally:
            comm.destroy()
    finally:
        segment.shm_free_bytes = free
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_source_that_cannot_make_its_segment_fails_every_rank_and_the_group_uses_gloo(
        dist_pool: Any, world_size: int) -> None:
    """The probe's source could not create its segment: it raised alone and the others
    waited until the timeout, so a CPU communicator never reached its gloo fallback."""
    outs = dist_pool(world_size).run(_source_without_shared_memory, timeout=45)
    for rank, out in enumerate(outs):
        want = "ShmSpaceError" if rank == 0 else "SegmentError"
        assert out["probe"].startswith(want), (rank, out)
        assert rank == 0 or "the source (rank 0) could not create its probe segment" in out["probe"]
        assert out["mode"] == "gloo" and "node probe" in out["why"], (rank, out)
        assert out["sum"] == [float(world_size)] * 2, (rank, out)
