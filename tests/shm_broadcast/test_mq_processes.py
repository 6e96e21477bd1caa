"""MessageQueue across real processes: ordering, tensors, TCP readers, dead peers, idle CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from shm_broadcast import MessageQueue, PeerDiedError, list_segments
from coordinator.testing import free_port
from shm_broadcast.segment import SHM_DIR

from . import workers

KILL_BOUND_S = 2.0


def _send_all(mq: MessageQueue, n: int, with_tensors: bool) -> None:
    for i in range(n):
        mq.enqueue(workers.expected_message(i, with_tensors), timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "n_readers, n_msgs, with_tensors",
    [(1, 2000, False), (2, 2000, False), (3, 10_000, True)],
    ids=["1-reader", "2-readers", "3-readers-10k-tensors"],
)
def test_messages_arrive_complete_and_in_order(procs, capfd, n_readers, n_msgs, with_tensors):
    ranks = list(range(1, n_readers + 1))
    # Small chunks: the ring wraps ~1000 times and every 997th message overflows.
    mq = MessageQueue(n_readers, n_readers, ranks, max_chunk_bytes=16 << 10, max_chunks=8,
                      name="ordered")
    try:
        for r in ranks:
            procs.start(workers.ordered_reader, mq.export_handle(), r, n_msgs, with_tensors)
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
            procs.start(workers.ordered_reader, h, r, n, False)
        mq.wait_until_ready(90)
        _send_all(mq, n, False)  # includes an overflow message (#5)
    finally:
        mq.close()
    reports = sorted(procs.get(timeout=90) for _ in range(3))
    assert reports == [("ok", r, n, "closed") for r in (1, 2, 3)]


@pytest.mark.timeout(150)
def test_tensors_round_trip_through_processes_and_idle_reader_sleeps(procs):
    import torch

    from .test_codec import ALL_DTYPES, bits, sample

    mq = MessageQueue(1, 1, [1], max_chunk_bytes=1 << 20, max_chunks=4, name="echo")
    try:
        procs.start(workers.echo_reader, mq.export_handle(), 1)
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
            time.sleep(5.0)
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
    writer = procs.start(workers.writer_then_hang, 2)
    _, handle = procs.get()
    for r in (1, 2):
        procs.start(workers.blocked_reader, handle, r)
    got = sorted(procs.get() for _ in range(3))
    assert got[0][0] == "blocked" and got[1][0] == "blocked" and got[2][0] == "sent"
    time.sleep(0.5)  # the readers are now parked in dequeue()
    t_kill = time.time()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(10)
    for _ in range(2):
        kind, rank, t_raise, err, text = procs.get(timeout=30)
        assert (kind, err) == ("raised", "PeerDiedError"), (kind, err, text)
        assert "died" in text and str(writer.pid) in text and "doomed-writer" in text
        assert t_raise - t_kill < KILL_BOUND_S, t_raise - t_kill
    # The SIGKILLed writer could not unlink its ring; `groupcoord cleanup --yes` does.
    seg = handle.segment
    assert os.path.exists(os.path.join(SHM_DIR, seg))
    out = subprocess.run([sys.executable, "-m", "shm_broadcast.cli", "cleanup", "--yes"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and seg in out.stdout, out.stdout + out.stderr
    assert seg not in {s.name for s in list_segments()}


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
        p_local = procs.start(workers.reader_then_hang, local.export_handle(), 1)
        p_remote = procs.start(workers.reader_then_hang, remote.export_handle(), 1)
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
        procs.start(workers.pg_worker, r, world, port, port2, node_ids)
    reports = {m[1]: m[2] for m in (procs.get(timeout=150) for _ in range(world))}
    expected = [{"step": s, "from": 1} for s in range(5)]
    assert all(reports[r]["bcast"] == expected for r in range(world))
    assert reports[1]["bcast_local"] == [0]  # rank 0 local, rank 2 remote
    assert reports[0]["gathered"] == [("result", 1), ("result", 2)]
    assert [reports[r]["n_queues"] for r in range(world)] == [2, 1, 1]
    assert all(reports[r]["stateless"] == ("hi", 2) for r in range(world))
