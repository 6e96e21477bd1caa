"""Collective queue creation when one rank's arguments are bad or ranks disagree
(:mod:`shm_broadcast.ranks.agreement`), with real processes over the world gloo group.

The rank with bad arguments raises its own error; every other rank raises
``PeerRejectedError`` naming it, at once rather than at the group's timeout;
ranks that name different writers or readers all raise ``CollectiveMismatch``.
Afterwards the group builds a queue normally.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

_TIMEOUT = 30.0

# case -> (the arguments rank `bad` passes, the error it raises)
_CASES = {
    "writer-out-of-range": ({"writer_rank": 7}, ValueError),
    "reader-max-chunks-0": ({"max_chunks": 0}, ValueError),
    "chunk-bytes-str": ({"max_chunk_bytes": "64K"}, TypeError),
    "reader-ranks-with-writer": ({"reader_ranks": [0]}, ValueError),
    "bad-wait-policy": ({"wait_policy": "fast"}, TypeError),
    "negative-timeout": ({"timeout": -1}, ValueError),
}


def one_bad_rank(rank: int, world_size: int, case: str, bad: int) -> list[str]:
    import torch.distributed as dist

    from shm_broadcast.errors import PeerRejectedError
    from shm_broadcast.queue.message_queue import MessageQueue

    create_from_process_group = MessageQueue.create_from_process_group

    group = dist.group.WORLD
    args: dict[str, Any] = {"writer_rank": 0, "timeout": _TIMEOUT}
    wrong, error = _CASES[case]
    if rank == bad:
        args.update(wrong)
    problems: list[str] = []
    t0 = time.monotonic()
    try:
        create_from_process_group(group, args.pop("max_chunk_bytes", 1 << 16),
                                  args.pop("max_chunks", 4), **args)
        problems.append("returned")
    except PeerRejectedError as e:
        if rank == bad or e.rank != bad:
            problems.append(f"PeerRejectedError naming rank {e.rank}: {e}")
    except (TypeError, ValueError) as e:
        if rank != bad or type(e) is not error:
            problems.append(f"{type(e).__name__}: {e}")
    if time.monotonic() - t0 > _TIMEOUT / 3:
        problems.append(f"took {time.monotonic() - t0:.1f} s")
    mq = create_from_process_group(group, 1 << 16, 4, writer_rank=0, timeout=_TIMEOUT)
    try:
        got = mq.enqueue({"ok": 1}) if rank == 0 else mq.dequeue()
        if rank and got != {"ok": 1}:
            problems.append(f"the next queue gave {got!r}")
    finally:
        mq.close()
    return problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,bad", [(2, 0), (2, 1), (3, 2)],
                         ids=["ws2-writer", "ws2-reader", "ws3-reader"])
@pytest.mark.parametrize("case", list(_CASES))
def test_one_ranks_bad_arguments_raise_on_every_rank_at_once(
        dist_pool: Any, case: str, world_size: int, bad: int) -> None:
    if case == "writer-out-of-range" and bad == 0:
        bad = 1  # the writer itself naming another writer is the mismatch case below
    results = dist_pool(world_size).run(one_bad_rank, case, bad, timeout=100)
    assert results == [[]] * world_size, results


def other_writer(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from shm_broadcast.errors import CollectiveMismatch, PeerRejectedError
    from shm_broadcast.queue.message_queue import MessageQueue

    create_from_process_group = MessageQueue.create_from_process_group

    try:
        create_from_process_group(dist.group.WORLD, 1 << 16, 4,
                                  writer_rank=1 if rank == world_size - 1 else 0, timeout=_TIMEOUT)
        return ["returned"]
    except PeerRejectedError as e:
        return [f"PeerRejectedError: {e}"]
    except CollectiveMismatch as e:
        return [] if world_size - 1 in e.peers else [f"peers {e.peers}"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_naming_different_writers_all_raise(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(other_writer, timeout=100)
    assert results == [[]] * world_size, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["initialize_model_parallel", "create_from_process_group"])
def test_a_peer_dying_before_the_exchange_is_our_error_naming_the_op(op: str) -> None:
    """gloo's own error (a closed connection, no group, op or rank in it) becomes
    PeerDiedError naming the group and the set-up call, at once."""
    from shm_broadcast.ranks.launcher import spawn_group

    outcomes = spawn_group(dies_before_setup, 2, (op,), timeout=90)
    assert outcomes[1].exitcode == 3, outcomes[1]
    assert outcomes[0].ok, outcomes[0].error
    name, text, seconds = outcomes[0].result
    assert name == "PeerDiedError" and op in text and seconds < 20, outcomes[0].result


def dies_before_setup(rank: int, world_size: int, op: str) -> tuple[str, str, float]:
    import os

    import torch.distributed as dist

    from coordinator import parallel_state as ps
    from shm_broadcast import MessageQueue

    if op == "initialize_model_parallel":
        ps.init_distributed_environment(world_size, rank, "env://", rank, timeout=_TIMEOUT)
    if rank == 1:
        os._exit(3)  # gone before the set-up call's exchange
    t0 = time.monotonic()
    try:
        if op == "initialize_model_parallel":
            ps.initialize_model_parallel(2, 1)
        else:
            MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 16, 4, timeout=_TIMEOUT)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0
