"""Stamps on the TP broadcaster's messages (coordinator/group/broadcast_stamps.py), in process.

The distributed cases (a reader that skipped a broadcast gets a
CollectiveMismatch at its next one, never the skipped call's data) are in the
fault matrix: tests/faults/test_fault_matrix.py, ``skip`` / ``other-op`` of
``broadcast_object-mq`` and ``broadcast_tensor_dict-mq``.
"""

from __future__ import annotations

import time

import pytest
import torch

from coordinator.errors import CollectiveMismatch, DecodeError, GroupCoordError
from coordinator.group.broadcast_stamps import stamp, unstamp


def test_a_message_of_this_call_is_returned() -> None:
    payload = {"step": 3}
    assert unstamp(stamp(payload, 12, "broadcast_object"), 12, "broadcast_object", "tp:0", 0,
                   20) is payload


@pytest.mark.parametrize("theirs,mine", [(11, 12), (13, 12)], ids=["stale", "ahead"])
def test_a_message_of_another_call_raises_naming_both_calls(theirs: int, mine: int) -> None:
    msg = stamp([1, 2], theirs, "broadcast_object")
    with pytest.raises(CollectiveMismatch) as info:
        unstamp(msg, mine, "broadcast_tensor_dict", "tp:0", 0, 30)
    text = str(info.value)
    assert info.value.peers == (0,)
    for part in ("group 'tp:0'", "op broadcast_tensor_dict", "call #30",
                 "rank 0's broadcast_object", f"collective call {theirs}",
                 f"collective call {mine}"):
        assert part in text, (part, text)


@pytest.mark.parametrize("message", [None, [1, "x"], ["1", "x", 3], [1, 2, 3], {"a": 1}],
                         ids=["none", "short", "str-number", "int-op", "dict"])
def test_a_message_without_a_stamp_is_refused(message: object) -> None:
    with pytest.raises(DecodeError, match="without a call stamp"):
        unstamp(message, 1, "broadcast_object", "tp:0", 0, 1)


# ------------------------------------------------------------ across processes
_BROADCASTS = {
    "tensor_dict": lambda g, r: g.broadcast_tensor_dict(
        {"k": [1, 2], "t": torch.ones(3)} if r == 0 else None, 0),
    "meta_only_dict": lambda g, r: g.broadcast_tensor_dict(
        {"k": [1, 2], "s": "x"} if r == 0 else None, 0),
    "object": lambda g, r: g.broadcast_object({"x": 1} if r == 0 else None, 0),
    "object_list": lambda g, r: g.broadcast_object_list([{"x": 1}] if r == 0 else [None], 0),
}


def other_broadcast(rank: int, world_size: int, queue: bool, source_op: str,
                    reader_op: str) -> list[str]:
    """The source makes ``source_op``, the others ``reader_op``: a receiver never
    returns the source's data as its own call's result."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, queue,
                         group_name="kinds", timeout=10)
    try:
        try:
            _BROADCASTS[source_op if rank == 0 else reader_op](g, rank)
            return ["returned"]
        except GroupCoordError as e:  # a source still sending tensors meets destroy()
            return [type(e).__name__, str(e)]
    finally:
        g.destroy()


_PAIRS = [("tensor_dict", "object"), ("meta_only_dict", "object"), ("object", "meta_only_dict"),
          ("object", "object_list"), ("object_list", "object"), ("meta_only_dict", "object_list")]
# broadcast_object_list never goes through the queue: its pairs run on the CPU group only.
_CASES = [(q, a, b) for q in (True, False) for a, b in _PAIRS
          if not (q and "object_list" in (a, b))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("queue,source_op,reader_op", _CASES, ids=[
    f"{'queue' if q else 'cpu-group'}-{a}-vs-{b}" for q, a, b in _CASES])
def test_a_receiver_of_another_broadcast_raises_naming_both_calls(
        dist_pool, world_size, queue, source_op, reader_op):
    results = dist_pool(world_size).run(other_broadcast, queue, source_op, reader_op, timeout=50)
    for rank in range(1, world_size):
        assert results[rank][0] == "CollectiveMismatch", results
        names = {"tensor_dict": "broadcast_tensor_dict", "meta_only_dict": "broadcast_tensor_dict",
                 "object": "broadcast_object", "object_list": "broadcast_object_list"}
        assert names[source_op] in results[rank][1] and names[reader_op] in results[rank][1]


def late_writer(rank: int, world_size: int) -> list[str]:
    """The queue's writer is late for one broadcast (past the readers' timeout);
    the readers raise there, and the broadcasts after it are right again."""
    from coordinator import GroupCoordinator
    from coordinator.errors import GroupCoordError

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, True,
                         group_name="late-writer", timeout=1.5)
    out = []
    try:
        for step in range(4):
            if rank == 0 and step == 1:  # the readers' next all_reduce waits 0.5 s of 1.5
                time.sleep(2.0)
            try:
                got = g.broadcast_tensor_dict({"step": step} if rank == 0 else None, 0)
                out.append("ok" if got == {"step": step} else f"WRONG {got}")
            except GroupCoordError as e:
                out.append(type(e).__name__)
            total = g.all_reduce(torch.ones(2))
            out.append("ok" if torch.equal(total, torch.full((2,), float(world_size))) else "WRONG")
        return out
    finally:
        g.barrier(timeout=30)
        g.destroy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_readers_that_timed_out_on_a_late_writer_read_the_next_broadcasts(
        dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(late_writer)
    assert outs[0] == ["ok"] * 8, outs
    for o in outs[1:]:
        assert o == ["ok", "ok", "CommTimeout", "ok", "ok", "ok", "ok", "ok"], outs
