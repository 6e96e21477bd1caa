"""Call patterns of vLLM's own distributed tests and workers, run as written there
(the names and argument forms an engine ported from vLLM uses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.mark.timeout(120)
def test_vllm_worker_patterns(dist_pool) -> None:
    outs = dist_pool(2).run(vllm_patterns, timeout=90)
    assert outs[1]["recv_int_size"] == [64, 1.0], outs
    assert outs[1]["dequeued"] == {"step": 7} and outs[0]["wrote"], outs
    assert outs[1]["dequeued_positional"] == {"step": 8}, outs


def vllm_patterns(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps
    from shm_broadcast import MessageQueue

    g = ps.get_world_group()
    out: dict[str, Any] = {}
    # tests/distributed/test_comm_ops.py: recv(size=64, dtype=...) with an int size.
    if rank == 0:
        g.send(torch.ones(64), 1)
    else:
        got = g.recv(64, dtype=torch.float32)
        out["recv_int_size"] = [got.numel(), float(got.mean())]
    # vLLM's executor: a queue created without waiting (blocking=False), readied
    # later, and a worker's busy loop that waits for its next request indefinitely.
    mq = MessageQueue.create_from_process_group(g.cpu_group, 1 << 16, 4, writer_rank=0,
                                                blocking=False)
    with mq:
        mq.wait_until_ready(30)
        if rank == 0:
            mq.enqueue({"step": 7})
            mq.enqueue({"step": 8})
            out["wrote"] = True
        else:
            out["dequeued"] = mq.dequeue(indefinite=True)
            out["dequeued_positional"] = mq.dequeue(None, True)  # vLLM's (timeout, indefinite)
        g.barrier()
    return out
