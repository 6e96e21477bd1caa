"""Child-process entry points for the shm_broadcast tests (spawn needs them importable).

Every worker reports through a ``multiprocessing`` queue: ``("ok", ...)`` or
``("error", traceback)``; never raises silently.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from shm_broadcast import MessageQueue, QueueClosedError, SharedSegment, WaitPolicy

OVERFLOW_EVERY = 997
OVERFLOW_BYTES = 40_000  # larger than the 16 KiB chunks used by the ordering test


def expected_message(i: int, with_tensors: bool) -> dict[str, Any]:
    """The ``i``-th message of the ordering tests (deterministic)."""
    import numpy as np

    msg: dict[str, Any] = {
        "i": i,
        "name": f"msg-{i}",
        "pair": (i, -i),
        "ids": list(range(i % 7)),
        "arr": np.arange(i % 4, dtype=np.int16) + i,
    }
    if with_tensors:
        import torch

        msg["t"] = torch.arange(i % 5, dtype=torch.int32) + i
        msg["bf"] = torch.full((2, 2), float(i % 100), dtype=torch.bfloat16)
    if i % OVERFLOW_EVERY == 5:
        msg["big"] = bytes([i % 251]) * OVERFLOW_BYTES
    return msg


def check_message(got: Any, i: int, with_tensors: bool) -> None:
    """Raise AssertionError unless ``got`` equals :func:`expected_message` ``(i)``."""
    import numpy as np

    exp = expected_message(i, with_tensors)
    if not isinstance(got, dict) or set(got) != set(exp):
        raise AssertionError(f"message {i}: keys {sorted(got) if isinstance(got, dict) else got!r}")
    for k, v in exp.items():
        g = got[k]
        if isinstance(v, np.ndarray):
            ok = isinstance(g, np.ndarray) and g.dtype == v.dtype and np.array_equal(g, v)
        elif type(v).__module__.startswith("torch"):
            import torch

            ok = isinstance(g, torch.Tensor) and g.dtype == v.dtype and torch.equal(g, v)
        else:
            ok = type(g) is type(v) and g == v
        if not ok:
            raise AssertionError(f"message {i}: field {k!r} is {g!r}, expected {v!r}")


def ordered_reader(handle: Any, rank: int, n: int, with_tensors: bool, out: Any) -> None:
    """Read ``n`` messages, check each, then expect the writer's shutdown."""
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            for i in range(n):
                check_message(mq.dequeue(timeout=60), i, with_tensors)
            try:
                mq.dequeue(timeout=60)
                after = "another message"
            except QueueClosedError:
                after = "closed"
        out.put(("ok", rank, n, after))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def echo_reader(handle: Any, rank: int, out: Any) -> None:
    """Echo every message back through a single-reader queue (this rank writes)."""
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq, MessageQueue(
            1, 1, [0], max_chunk_bytes=1 << 20, max_chunks=4, name=f"echo-{rank}",
            writer_rank=rank,
        ) as back:
            out.put(("handle", back.export_handle()))
            mq.wait_until_ready(60)
            back.wait_until_ready(60)
            while True:
                obj = mq.dequeue()
                if isinstance(obj, str) and obj == "stop":
                    break
                back.enqueue(obj, timeout=60)
        out.put(("ok", rank))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def blocked_reader(handle: Any, rank: int, out: Any) -> None:
    """Read one message, then block in dequeue(); report how that ended and when."""
    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        mq.wait_until_ready(60)
        first = mq.dequeue(timeout=60)
        out.put(("blocked", rank, first))
        try:
            mq.dequeue()
            out.put(("returned", rank, time.time(), ""))
        except Exception as e:  # the point of the test: which error, and when
            out.put(("raised", rank, time.time(), type(e).__name__, str(e)))
        finally:
            mq.close()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def writer_then_hang(n_reader: int, out: Any) -> None:
    """Create a queue for local readers 1..n, send one message, then sleep (to be killed)."""
    try:
        mq = MessageQueue(n_reader, n_reader, list(range(1, n_reader + 1)),
                          max_chunk_bytes=4096, max_chunks=4, name="doomed-writer")
        out.put(("handle", mq.export_handle()))
        mq.wait_until_ready(60)
        mq.enqueue("first")
        out.put(("sent", os.getpid()))
        time.sleep(600)
    except BaseException:
        out.put(("error", 0, traceback.format_exc()))


def reader_then_hang(handle: Any, rank: int, out: Any) -> None:
    """Connect as a reader, never read, sleep until killed."""
    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        mq.wait_until_ready(60)
        out.put(("ready", rank, os.getpid()))
        time.sleep(600)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def idle_reader(handle: Any, rank: int, out: Any) -> None:
    """Block in dequeue() (parks), report the message's latency, repeat until "stop"."""
    try:
        with MessageQueue.create_from_handle(
            handle, rank, wait_policy=WaitPolicy(spin_s=50e-6, yield_s=0.05)
        ) as mq:
            mq.wait_until_ready(60)
            out.put(("ready", rank, os.getpid()))
            while True:
                msg = mq.dequeue()
                if msg == "stop":
                    break
                out.put(("woke", rank, time.perf_counter() - msg))
        out.put(("ok", rank))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def segment_owner(out: Any) -> None:
    """Create a segment and sleep until killed."""
    try:
        seg = SharedSegment.create("test", 4096)
        out.put(("segment", seg.name))
        time.sleep(600)
    except BaseException:
        out.put(("error", 0, traceback.format_exc()))


def pg_worker(rank: int, world: int, port: int, port2: int, node_ids: list[str | None],
              out: Any) -> None:
    """Join a gloo group and build queues with create_from_process_group.

    Then the same over a coordinator.StatelessProcessGroup (duck-typed group).

    ``node_ids[rank]`` (if not None) becomes GROUPCOORD_NODE_ID, to simulate
    ranks on another node (they become remote, TCP readers).
    """
    try:
        if node_ids[rank] is not None:
            os.environ["GROUPCOORD_NODE_ID"] = node_ids[rank]
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        group = dist.group.WORLD
        report: dict[str, Any] = {}
        try:
            # 1. Broadcaster whose writer is not rank 0; every other rank reads.
            mq = MessageQueue.create_from_process_group(group, 1 << 16, 4, writer_rank=1,
                                                        timeout=60)
            with mq:
                got = [mq.broadcast_object({"step": s, "from": 1} if rank == 1 else None)
                       for s in range(5)]
                report["bcast"] = got
                report["bcast_local"] = list(mq.export_handle().local_reader_ranks) if (
                    rank == 1) else None
            # 2. Results back to a driver: every rank writes to rank 0 through its own queue.
            queues = {}
            for w in range(1, world):
                q = MessageQueue.create_from_process_group(group, 1 << 16, 4, writer_rank=w,
                                                           reader_ranks=[0], timeout=60)
                if q is not None:
                    queues[w] = q
            if rank == 0:
                report["gathered"] = sorted(q.dequeue(timeout=30) for q in queues.values())
            else:
                queues[rank].enqueue(("result", rank), timeout=30)
            report["n_queues"] = len(queues)
            dist.barrier()
            for q in queues.values():
                q.close()
        finally:
            dist.destroy_process_group()
        from coordinator.stateless_group import StatelessProcessGroup

        sg = StatelessProcessGroup.create("127.0.0.1", port2, rank, world, timeout=60)
        with MessageQueue.create_from_process_group(sg, 1 << 16, 4, writer_rank=2,
                                                    timeout=60) as mq:
            report["stateless"] = mq.broadcast_object(("hi", 2) if rank == 2 else None,
                                                      timeout=30)
        sg.barrier()  # rank 0 hosts the store: nobody may still need it when it exits
        out.put(("ok", rank, report))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def jittery_reader(handle: Any, rank: int, n: int, max_gap_s: float, policy: Any,
                   out: Any) -> None:
    """Read ``n`` stamped messages with random pauses; report latencies and parks.

    Message ``i`` is ``(i, t_sent)`` with ``t_sent = time.monotonic()`` on the
    writer (the same clock system-wide on Linux). Pausing 0..``max_gap_s``
    before each dequeue makes the reader park between messages.
    """
    import random

    try:
        rnd = random.Random(1000 + rank)
        with MessageQueue.create_from_handle(handle, rank, wait_policy=policy) as mq:
            mq.wait_until_ready(60)
            before = mq.park_stats()
            worst = 0.0
            slow = []
            for i in range(n):
                time.sleep(rnd.uniform(0.0, max_gap_s))
                seq, t_sent = mq.dequeue(timeout=60)
                lat = time.monotonic() - t_sent
                if seq != i:
                    raise AssertionError(f"reader {rank}: got message {seq}, expected {i}")
                worst = max(worst, lat)
                if lat > 0.5:
                    slow.append((i, round(lat, 3)))
            after = mq.park_stats()
        out.put(("ok", rank, after["parks"] - before["parks"],
                 after["timeouts"] - before["timeouts"], worst, slow))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
