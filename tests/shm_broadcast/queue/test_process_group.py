"""The collective constructor builds queues of the class it is given
(shm_broadcast.queue.process_group.create_from_process_group)."""

from __future__ import annotations

from typing import Any

import pytest


def _build_with_a_subclass(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    from shm_broadcast.queue.message_queue import MessageQueue
    from shm_broadcast.queue.process_group import create_from_process_group

    class TaggedQueue(MessageQueue):
        """A queue class of the caller's: every side must come back as one."""

    mq = create_from_process_group(TaggedQueue, dist.group.WORLD, 1 << 16, 4, writer_rank=0,
                                   timeout=60)
    problems: list[str] = []
    try:
        if type(mq) is not TaggedQueue:
            problems.append(f"rank {rank} got a {type(mq).__name__}")
        got = mq.broadcast_object({"from": "writer"} if rank == 0 else None)
        if got != {"from": "writer"}:
            problems.append(f"rank {rank} got {got!r}")
    finally:
        if mq is not None:
            mq.close()
    return problems


@pytest.mark.timeout(120)
def test_every_side_is_made_by_the_given_class(dist_pool: Any) -> None:
    results = dist_pool(2).run(_build_with_a_subclass, timeout=100)
    assert results == [[], []], results
