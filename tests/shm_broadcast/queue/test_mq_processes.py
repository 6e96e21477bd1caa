"""MessageQueue across real processes: ordering, tensors, TCP readers, dead peers, idle CPU."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Any

import numpy as np
import psutil
import pytest

from coordinator.testing import free_port
from shm_broadcast import MessageQueue, PeerDiedError, QueueClosedError, list_segments
from shm_broadcast.lifecycle.segment import SHM_DIR
from tests.shm_broadcast.lifecycle_helpers import wait_gone

KILL_BOUND_S = 2.0


def _send_all(mq: MessageQueue, n: int, with_tensors: bool) -> None:
    for i in range(n):
        mq.enqueue(expected_message(i, with_tensors), timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "n_readers, n_msgs, with_tensors",
    [(1, 2000, False), (2, 2000, False), pytest.param(3, 10_000, True, marks=pytest.mark.slow)],
    ids=["1-reader", "2-readers", "3-readers-10k-tensors"],
)
def test_messages_arrive_complete_and_in_order(procs, capfd, n_readers, n_msgs, with_tensors):
    ranks = list(range(1, n_readers + 1))
    # Small chunks: the ring wraps ~1000 times and every 997th message overflows.
    mq = MessageQueue(n_readers, n_readers, ranks, max_chunk_bytes=16 << 10, max_chunks=8,
                      name="ordered")
    try:
        for r in ranks:
            procs.start(ordered_reader, mq.export_handle(), r, n_msgs, with_tensors)
        mq.wait_until_ready(90)
        _send_all(mq, n_msgs, with_tensors)
    finally:
        mq.close()
    reports = sorted(procs.get(timeout=120) for _ in ranks)
    assert reports == [("ok", r, n_msgs, "closed") for r in ranks]
    procs.reap()
    err = capfd.readouterr().err  # the children share our stderr
    assert "resource_tracker" not in err and "leaked" not in err, err


@pytest.mark.timeout(120)
def test_remote_readers_over_tcp_loopback(procs):
    # Rank 1 reads through shared memory, ranks 2 and 3 over TCP on 127.0.0.1.
    n = 600
    mq = MessageQueue(3, 1, [1], max_chunk_bytes=16 << 10, max_chunks=4,
                      connect_ip="127.0.0.1", name="mixed")
    try:
        h = mq.export_handle()
        assert h.remote_pub.startswith("tcp://127.0.0.1:")
        for r in (1, 2, 3):
            procs.start(ordered_reader, mq.export_handle(r), r, n, False)
        mq.wait_until_ready(90)
        _send_all(mq, n, False)  # includes an overflow message (#5)
    finally:
        mq.close()
    reports = sorted(procs.get(timeout=90) for _ in range(3))
    assert reports == [("ok", r, n, "closed") for r in (1, 2, 3)]


@pytest.mark.timeout(150)
def test_tensors_round_trip_through_processes_and_idle_reader_sleeps(procs):
    import torch

    from tests.shm_broadcast.codec.test_codec import ALL_DTYPES, bits, sample

    mq = MessageQueue(1, 1, [1], max_chunk_bytes=1 << 20, max_chunks=4, name="echo")
    try:
        procs.start(echo_reader, mq.export_handle(), 1)
        _, back_handle = procs.get()
        with MessageQueue.create_from_handle(back_handle, 0) as back:
            mq.wait_until_ready(90)
            back.wait_until_ready(90)
            for dtype in ALL_DTYPES:
                base = sample(dtype, (6, 4))
                sent = {"c": base, "nc": base.t(), "sl": base[1::2, ::3], "z": base[0, 0].clone(),
                        "e": base[:0], "grad": base.float().requires_grad_() if
                        dtype.is_floating_point else base}
                got = back.dequeue(timeout=30) if mq.enqueue(sent, timeout=30) is None else None
                for k, t in sent.items():
                    assert got[k].dtype == t.dtype and got[k].shape == t.shape, (dtype, k)
                    assert torch.equal(bits(got[k]), bits(t)), (dtype, k)
                assert got["grad"].requires_grad == sent["grad"].requires_grad
            arrays = {"a": np.arange(12.0).reshape(3, 4)[:, 1:], "s": np.array(7, np.int8)}
            mq.enqueue(arrays)
            echoed = back.dequeue(timeout=30)
            assert all(np.array_equal(echoed[k], v) and echoed[k].dtype == v.dtype
                       for k, v in arrays.items())
            # 1 MiB payload (one chunk) and 3 MiB (overflow through zmq) survive intact.
            for numel in (1 << 18, 3 << 18):
                big = torch.randn(numel)
                mq.enqueue({"big": big})
                assert torch.equal(back.dequeue(timeout=30)["big"], big)

            # Idle: the reader now waits in dequeue(); it must park (~0% CPU) ...
            reader = psutil.Process(procs.started[0].pid)
            time.sleep(0.3)
            before = reader.cpu_times()
            t0 = time.monotonic()
            time.sleep(2.0)
            cpu = reader.cpu_times()
            used = (cpu.user + cpu.system - before.user - before.system) / (time.monotonic() - t0)
            assert used < 0.05, f"idle reader used {used:.1%} of a core"
            # ... and still wake up for the next message.
            mq.enqueue("after idle")
            assert back.dequeue(timeout=10) == "after idle"
            mq.enqueue("stop")
            assert procs.get()[:2] == ("ok", 1)
    finally:
        mq.close()


@pytest.mark.timeout(120)
def test_killed_writer_makes_blocked_readers_raise_then_cleanup(procs):
    writer = procs.start(writer_then_hang, 2)
    _, handle = procs.get()
    for r in (1, 2):
        procs.start(blocked_reader, handle, r)
    got = sorted(procs.get() for _ in range(3))
    assert got[0][0] == "blocked" and got[1][0] == "blocked" and got[2][0] == "sent"
    time.sleep(0.5)  # the readers are now parked in dequeue()
    t_kill = time.time()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    for _ in range(2):
        kind, rank, t_raise, err, text, peers = procs.get(timeout=30)
        assert (kind, err) == ("raised", "PeerDiedError"), (kind, err, text)
        assert peers == [0], peers  # the writer's rank, as every group error names peers
        assert "died" in text and str(writer.pid) in text and "doomed-writer" in text
        assert t_raise - t_kill < KILL_BOUND_S, t_raise - t_kill
    # The SIGKILLed writer could not unlink its ring; its exit reaper does.
    seg = os.path.join(SHM_DIR, handle.segment)
    assert wait_gone(seg, seg + ".owner") == []
    assert handle.segment not in {s.name for s in list_segments()}


def _enqueue_until_it_raises(mq: MessageQueue, out: list) -> None:
    try:
        for i in range(10_000):
            mq.enqueue(i)  # no timeout: must not hang once the reader is dead
        out.append(("returned", None, time.time()))
    except Exception as e:
        out.append(("raised", e, time.time()))


@pytest.mark.timeout(120)
def test_killed_reader_makes_blocked_writer_raise(procs):
    local = MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=2, name="local-victim")
    remote = MessageQueue(1, 0, connect_ip="127.0.0.1", max_chunks=2, name="remote-victim")
    try:
        p_local = procs.start(reader_then_hang, local.export_handle(), 1)
        p_remote = procs.start(reader_then_hang, remote.export_handle(1), 1)
        local.wait_until_ready(90)
        remote.wait_until_ready(90)
        for _ in range(2):
            procs.get()
        for mq, proc in ((local, p_local), (remote, p_remote)):
            out: list = []
            t = threading.Thread(target=_enqueue_until_it_raises, args=(mq, out))
            t.start()
            time.sleep(0.5)  # the ring (or the remote window) is full: the writer waits
            assert t.is_alive() and not out
            t_kill = time.time()
            os.kill(proc.pid, signal.SIGKILL)
            t.join(10)
            assert out and out[0][0] == "raised", out
            err, t_raise = out[0][1], out[0][2]
            assert isinstance(err, PeerDiedError), repr(err)
            assert err.peers == (1,) and "reader rank 1" in str(err) and str(proc.pid) in str(err)
            assert t_raise - t_kill < KILL_BOUND_S, t_raise - t_kill
    finally:
        local.close()
        remote.close()


@pytest.mark.timeout(180)
def test_create_from_process_group_gloo_and_stateless(procs):
    world = 3
    port, port2 = free_port(), free_port()
    # Rank 2 claims to live on another node: it becomes a remote (TCP) reader of rank 1.
    node_ids = ["node-a", "node-a", "node-b"]
    for r in range(world):
        procs.start(pg_worker, r, world, port, port2, node_ids)
    reports = {m[1]: m[2] for m in (procs.get(timeout=150) for _ in range(world))}
    expected = [{"step": s, "from": 1} for s in range(5)]
    assert all(reports[r]["bcast"] == expected for r in range(world))
    assert reports[1]["bcast_local"] == [0]  # rank 0 local, rank 2 remote
    assert reports[0]["gathered"] == [("result", 1), ("result", 2)]
    assert [reports[r]["n_queues"] for r in range(world)] == [2, 1, 1]
    assert all(reports[r]["stateless"] == ("hi", 2) for r in range(world))


# ---------------------------------------------------------------------- child processes
# Spawned by the ``procs`` fixture as ``fn(*args, out_queue)``; each reports through
# the queue (``("ok", ...)`` or ``("error", traceback)``) and never fails silently.
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
            out.put(("raised", rank, time.time(), type(e).__name__, str(e),
                     list(getattr(e, "peers", None) or [])))
        finally:
            mq.close()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def writer_then_hang(n_reader: int, out: Any) -> None:
    """Create a queue for local readers 1..n, send one message, then sleep (to be killed)."""
    try:
        mq = MessageQueue(n_reader, n_reader, list(range(1, n_reader + 1)),
                          max_chunk_bytes=4096, max_chunks=4, name="doomed-writer",
                          writer_rank=0)
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
        from coordinator.stateless.stateless_group import StatelessProcessGroup

        sg = StatelessProcessGroup.create("127.0.0.1", port2, rank, world, timeout=60)
        with MessageQueue.create_from_process_group(sg, 1 << 16, 4, writer_rank=2,
                                                    timeout=60) as mq:
            report["stateless"] = mq.broadcast_object(("hi", 2) if rank == 2 else None,
                                                      timeout=30)
        sg.barrier()  # rank 0 hosts the store: nobody may still need it when it exits
        out.put(("ok", rank, report))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
