"""One rank's bad arguments to an object or tensor-dict call do not strand its peers.

The rank that passed them raises TypeError/ValueError; its peers raise (a
PeerRejectedError or CollectiveMismatch naming the problem) within the
second, not at the group's timeout, and the group stays in step: the calls
that follow work on every rank. Covered: a bad ``src`` (or a non-list
``obj_list``) on one rank of ``broadcast_object``, ``broadcast_object_list``
and ``broadcast_tensor_dict``, over the CPU communicator and over a group's
message queue (the bad rank being its writer or a reader). A writer's failure
marker that nobody read (its peers went through the communicator, and waited
there until the timeout) does not spoil the queue's later broadcasts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

_TIMEOUT = 20.0  # the group's: a peer left waiting would take this long


def _group(rank: int, world_size: int, name: str, mq: bool) -> Any:
    from coordinator.group.group_coordinator import GroupCoordinator

    return GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name=name,
                            timeout=_TIMEOUT, use_message_queue_broadcaster=mq)


def _broadcast_call(g: Any, op: str, rank: int, bad: bool) -> Any:
    src = g.world_size if bad else 0
    if op == "broadcast_object":
        return g.broadcast_object({"step": 1} if rank == 0 else None, src=src)
    if op == "broadcast_object_list":
        return g.broadcast_object_list([1, 2] if rank == 0 else [None, None], src=src)
    if op == "obj_list-not-a-list":
        return g.broadcast_object_list(5 if bad else ([1, 2] if rank == 0 else [None, None]))
    return g.broadcast_tensor_dict({"x": torch.ones(2)} if rank == 0 else None, src=src)


def _in_step(g: Any, rank: int, world_size: int, i: int, t0: float | None = None) -> list[str]:
    """What is wrong after a failed call that began at ``t0``: it took too long, or a
    broadcast_object and an all_reduce that follow fail (nothing: in step again)."""
    problems = []
    if t0 is not None and time.monotonic() - t0 > _TIMEOUT / 4:
        problems.append(f"the call took {time.monotonic() - t0:.1f} s")
    got = g.broadcast_object({"i": i} if rank == 0 else None, src=0)
    if got != {"i": i}:
        problems.append(f"broadcast_object afterwards gave {got!r}")
    s = g.all_reduce(torch.ones(3))
    if not torch.equal(s, torch.full((3,), float(world_size))):
        problems.append(f"all_reduce afterwards gave {s.tolist()}")
    return problems


def bad_src_rank(rank: int, world_size: int, op: str, mq: bool, bad_rank: int) -> list[str]:
    from coordinator.errors import CollectiveMismatch, PeerRejectedError

    g = _group(rank, world_size, f"bad-{op}-{mq}", mq)
    problems: list[str] = []
    try:
        t0 = time.monotonic()
        try:
            _broadcast_call(g, op, rank, rank == bad_rank)
            raised: BaseException | None = None
        except (TypeError, ValueError, PeerRejectedError, CollectiveMismatch) as e:
            raised = e
        took = time.monotonic() - t0
        if rank == bad_rank and not isinstance(raised, (TypeError, ValueError)):
            problems.append(f"the bad rank raised {raised!r}")
        if took > _TIMEOUT / 4:
            problems.append(f"the call took {took:.1f} s")
        for i in range(2):
            problems += _in_step(g, rank, world_size, i)
    finally:
        g.destroy()
    return problems


_OPS = ["broadcast_object", "broadcast_object_list", "obj_list-not-a-list",
        "broadcast_tensor_dict"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("op", _OPS)
def test_bad_src_on_one_rank_over_the_communicator(dist_pool: Any, op: str,
                                                   world_size: int) -> None:
    results = dist_pool(world_size).run(bad_src_rank, op, False, world_size - 1, timeout=110)
    assert results == [[]] * world_size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_rank", [0, 2], ids=["queue-writer", "queue-reader"])
@pytest.mark.parametrize("op", ["broadcast_object", "broadcast_tensor_dict"])
def test_bad_src_on_one_rank_over_the_queue(dist_pool: Any, op: str, bad_rank: int) -> None:
    results = dist_pool(3).run(bad_src_rank, op, True, bad_rank, timeout=110)
    assert results == [[]] * 3


def unread_marker_rank(rank: int, world_size: int) -> list[str]:
    from coordinator.errors import CommTimeout
    from coordinator.group.group_coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="marker",
                         timeout=3.0, use_message_queue_broadcaster=True)
    problems: list[str] = []
    try:
        try:  # the writer (rank 0) names no rank; the others name rank 1: the communicator
            g.broadcast_object("x" if rank == 1 else None, src=world_size if rank == 0 else 1)
            problems.append("the call returned")
        except ValueError:
            if rank != 0:
                problems.append("a reader raised ValueError")
        except CommTimeout:
            if rank == 0:
                problems.append("the writer timed out")
        # (three: with the marker they fill the queue's ring without waiting for the
        # reader, which is still in its timed-out call)
        got = [g.broadcast_object(f"m{i}" if rank == 0 else None, src=0) for i in range(3)]
        if got != ["m0", "m1", "m2"]:
            problems.append(f"the queue's broadcasts gave {got!r}")
        torch.distributed.barrier()  # the writer stays until the reader is done
    finally:
        g.destroy()
    return problems


@pytest.mark.timeout(120)
def test_unread_failure_marker_does_not_spoil_the_queue(dist_pool: Any) -> None:
    assert dist_pool(2).run(unread_marker_rank, timeout=110) == [[]] * 2


def _bad_value(case: str) -> Any:
    """A value the sending rank cannot encode, for every reason but its type."""
    if case in ("freed-tensor", "shrunk-tensor"):
        t = torch.full((4096,), 7.0)
        t.untyped_storage().resize_(0 if case == "freed-tensor" else 64)
        return [t]
    if case == "nested-tensor":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    return deep


def bad_value_rank(rank: int, world_size: int, op: str, case: str, mq: bool) -> list[str]:
    """Rank 0 sends a value it cannot encode: it raises TypeError/ValueError, the
    others CollectiveMismatch at once, and the group stays in step."""
    from coordinator.errors import CollectiveMismatch

    g = _group(rank, world_size, f"val-{op}-{case}-{mq}", mq)
    problems: list[str] = []
    try:
        t0 = time.monotonic()
        try:
            if op == "broadcast_object":
                g.broadcast_object({"a": _bad_value(case)} if rank == 0 else None, src=0)
            else:
                g.broadcast_tensor_dict({"a": _bad_value(case)} if rank == 0 else None, src=0)
            problems.append(f"rank {rank}: the call returned")
        except CollectiveMismatch:
            if rank == 0:
                problems.append("the sender raised CollectiveMismatch")
        except (TypeError, ValueError) as e:
            if rank != 0:
                problems.append(f"a receiver raised {e!r:.200}")
        problems += _in_step(g, rank, world_size, 1, t0)
    finally:
        g.destroy()
    return problems


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("mq", [False, True], ids=["communicator", "queue"])
@pytest.mark.parametrize("case", ["freed-tensor", "shrunk-tensor", "nested-tensor", "too-deep"])
@pytest.mark.parametrize("op", ["broadcast_object", "broadcast_tensor_dict"])
def test_a_value_the_sender_cannot_encode_is_reported(dist_pool: Any, op: str, case: str,
                                                      mq: bool) -> None:
    assert dist_pool(2).run(bad_value_rank, op, case, mq, timeout=50) == [[], []]


def bad_barrier_timeout_rank(rank: int, world_size: int, bad: Any) -> list[str]:
    """The last rank passes a bad barrier timeout: it raises after taking part (with
    the group's timeout), so the others' barrier completes at once and the group
    stays in step."""
    g = _group(rank, world_size, "bar", False)
    problems: list[str] = []
    try:
        t0 = time.monotonic()
        try:
            g.barrier(timeout=bad if rank == world_size - 1 else None)
            if rank == world_size - 1:
                problems.append("the bad rank's barrier returned")
        except (TypeError, ValueError) as e:
            if rank != world_size - 1 or "timeout" not in str(e):
                problems.append(f"rank {rank} raised {e!r}")
        problems += _in_step(g, rank, world_size, 0, t0)
    finally:
        g.destroy()
    return problems


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [-1, 0, "5", float("nan")], ids=["negative", "zero", "str", "nan"])
def test_a_bad_barrier_timeout_on_one_rank_does_not_strand_the_others(dist_pool: Any,
                                                                       bad: Any) -> None:
    assert dist_pool(3).run(bad_barrier_timeout_rank, bad, timeout=50) == [[]] * 3


def _bad_dict(case: str) -> Any:
    if case == "not-a-dict":
        return [("x", torch.ones(2))]
    if case == "meta-tensor":
        return {"a": torch.ones(2, device="meta")}
    return {"s": torch.eye(3).to_sparse()}


def bad_dict_rank(rank: int, world_size: int, case: str, links: bool,
                  asynchronous: bool = False) -> list[str]:
    """Rank 0 sends a dict it cannot send to rank 1 (on a link or over the CPU
    group): it raises, rank 1 raises naming it at once, and both stay in step."""
    import os

    from coordinator.errors import CollectiveMismatch
    from coordinator.p2p.shm_links import ENABLE_ENV

    kept = os.environ.get(ENABLE_ENV)
    os.environ[ENABLE_ENV] = "1" if links else "0"  # pool workers live on: restored below
    g = _group(rank, world_size, f"bad-dict-{case}-{links}", False)
    problems: list[str] = []
    try:
        t0 = time.monotonic()
        try:
            if rank == 0 and asynchronous:
                g.isend_tensor_dict(_bad_dict(case), 1)
            elif rank == 0:
                g.send_tensor_dict(_bad_dict(case), 1)
            elif rank == 1:
                g.recv_tensor_dict(0)
            if rank in (0, 1):
                problems.append("returned")
        except (TypeError, ValueError) as e:
            if rank == 1 and not (isinstance(e, CollectiveMismatch) and "rank 0" in str(e)):
                problems.append(f"{type(e).__name__}: {e}")
            if rank == 0 and isinstance(e, CollectiveMismatch):
                problems.append(f"the sender raised {e}")
        problems += _in_step(g, rank, world_size, 1, t0)
        if rank == 0:  # the direction still carries dicts
            g.send_tensor_dict({"h": torch.arange(4)}, 1)
        elif rank == 1 and not torch.equal(g.recv_tensor_dict(0)["h"], torch.arange(4)):
            problems.append("the next dict differs")
    finally:
        g.destroy()
        if kept is None:
            os.environ.pop(ENABLE_ENV, None)
        else:
            os.environ[ENABLE_ENV] = kept
    return problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("links", [True, False], ids=["link", "cpu-group"])
@pytest.mark.parametrize("case", ["not-a-dict", "meta-tensor", "sparse-tensor"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["send", "isend"])
def test_a_dict_the_sender_cannot_send_is_reported_to_the_receiver(
        dist_pool: Any, case: str, links: bool, world_size: int, asynchronous: bool) -> None:
    results = dist_pool(world_size).run(bad_dict_rank, case, links, asynchronous, timeout=100)
    assert results == [[]] * world_size, results


def bad_queue_creation_rank(rank: int, world_size: int, case: str) -> list[str]:
    """The last rank passes a bad argument to a collective queue creation."""
    from coordinator.errors import PeerRejectedError

    g = _group(rank, world_size, f"bad-queue-{case}", False)
    bad = rank == world_size - 1
    problems: list[str] = []
    try:
        t0 = time.monotonic()
        try:
            if case == "unknown-option":
                q = g.create_mq_broadcaster(**({"bogus": 1} if bad else {}))
                q.close()
            elif case == "writer-rank":
                g.create_mq_broadcaster(writer_rank=world_size + 3 if bad else 0).close()
            else:
                w, rs = g.create_single_reader_mq_broadcasters(
                    reader_rank_in_group=world_size + 1 if bad else 0)
            problems.append("returned")
        except PeerRejectedError as e:
            if bad or e.rank != world_size - 1:
                problems.append(f"PeerRejectedError naming {e.rank}: {e}")
        except (TypeError, ValueError) as e:
            if not bad:
                problems.append(f"{type(e).__name__}: {e}")
        problems += _in_step(g, rank, world_size, 2, t0)
    finally:
        g.destroy()
    return problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["unknown-option", "writer-rank", "single-reader-rank"])
def test_a_bad_queue_creation_argument_on_one_rank_does_not_strand_the_others(
        dist_pool: Any, case: str, world_size: int) -> None:
    results = dist_pool(world_size).run(bad_queue_creation_rank, case, timeout=100)
    assert results == [[]] * world_size, results


def bad_send_to_a_busy_rank(rank: int, world_size: int, op: str) -> str:
    """Rank 0's send/recv has a bad argument while rank 1 is busy elsewhere (it
    never makes the matching call): rank 0 must still raise its own error."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, False,
                         group_name=f"busy-{op}", timeout=1.0)
    try:
        if rank != 0:
            time.sleep(1.6)
            return "busy"
        t0 = time.monotonic()
        try:
            if op == "send":
                g.send([1.0, 2.0], 1)  # type: ignore[arg-type]
            else:
                g.recv("ab", torch.float32, 1)  # type: ignore[arg-type]
            return "returned"
        except Exception as e:
            return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    finally:
        g.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["send", "recv"])
def test_a_bad_point_to_point_argument_raises_its_own_error_when_the_peer_is_busy(
        dist_pool, op: str) -> None:
    res = dist_pool(2).run(bad_send_to_a_busy_rank, op)[0]
    assert res.startswith("TypeError"), res
