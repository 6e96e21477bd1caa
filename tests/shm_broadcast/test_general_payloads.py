"""MessageQueue on general payloads and configurations, with real reader processes.

Every received object must equal the sent one with its type (a tuple stays a
tuple), tensors bit-exact with dtype and shape, and never alias the ring or
the sender's memory.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from shm_broadcast import (
    MessageQueue, QueueClosedError, QueueRoleError, QueueTimeout, list_segments,
)
from shm_broadcast.codec import Codec

from . import _payload_fns as pf


def _send_payloads(mq: MessageQueue, mcb: int) -> None:
    for _name, obj in pf.payloads(mcb):
        mq.enqueue(obj, timeout=60)
    t = torch.zeros(4)
    mq.enqueue(t, timeout=60)
    t.fill_(1.0)  # the first copy is already on its way; it must not change
    mq.enqueue(t, timeout=60)


@pytest.mark.timeout(60)
def test_every_payload_kind_round_trips_exactly(procs):
    # Queue A: 2 local readers + 1 remote (TCP), writer rank 7, 4 KiB chunks, 2 of them:
    # many payloads overflow through zmq, interleaved with ring messages.
    # Queue B: the same 3 readers all local, 128-byte chunks and max_chunks=1.
    qa = MessageQueue(3, 2, [1, 2], max_chunk_bytes=4096, max_chunks=2,
                      connect_ip="127.0.0.1", name="payloads-a", writer_rank=7)
    qb = MessageQueue(3, 3, [3, 1, 2], max_chunk_bytes=128, max_chunks=1, name="payloads-b")
    try:
        handles = [qa.export_handle(), qb.export_handle()]
        for r in (1, 2, 3):
            procs.start(pf.payload_reader, handles, r, [4096, 128])
        qa.wait_until_ready(50)
        _send_payloads(qa, 4096)
        qa.close()
        qb.wait_until_ready(50)
        _send_payloads(qb, 128)
        qb.close()
        reports = sorted(procs.get(timeout=50) for _ in range(3))
    finally:
        qa.close()
        qb.close()
    assert [(k, r) for k, r, _ in reports] == [("ok", 1), ("ok", 2), ("ok", 3)]
    for _, rank, errors in reports:
        assert errors == [], f"reader rank {rank}: {errors}"


def test_chunk_boundary_is_exact():
    # The sizes the sweep uses really sit on both sides of the ring/overflow boundary.
    for mcb in (128, 4096):
        exact, over = pf.boundary_sizes(mcb)
        c = Codec()
        assert 32 + len(c.encode(b"\x07" * exact).msg) == mcb
        assert 32 + len(c.encode(b"\x07" * over).msg) == mcb + 1


@pytest.mark.timeout(60)
def test_six_local_readers_with_scattered_ranks(procs):
    ranks = [9, 2, 5, 7, 1, 4]
    n = 150
    mq = MessageQueue(6, 6, ranks, max_chunk_bytes=1024, max_chunks=3, name="six",
                      writer_rank=3)
    try:
        for r in ranks:
            procs.start(pf.numpy_reader, mq.export_handle(), r, n)
        mq.wait_until_ready(50)
        for i in range(n):
            assert mq.broadcast_object(pf.numpy_message(i), timeout=30) is not None
    finally:
        mq.close()
    reports = sorted(procs.get(timeout=40) for _ in ranks)
    assert reports == [("ok", r, [], True) for r in sorted(ranks)]


def _queue_with_readers(n_local: int, n_remote: int, **kw) -> tuple[MessageQueue, list]:
    local = list(range(1, n_local + 1))
    remote = list(range(n_local + 1, n_local + n_remote + 1))
    w = MessageQueue(n_local + n_remote, n_local, local,
                     connect_ip="127.0.0.1" if n_remote else None, **kw)
    readers = [MessageQueue.create_from_handle(w.export_handle(), r) for r in local + remote]
    w.wait_until_ready(20)
    for r in readers:
        r.wait_until_ready(20)
    return w, readers


def _our_segments() -> set[str]:
    return {s.name for s in list_segments() if f"_{os.getpid()}_" in s.name}


@pytest.mark.timeout(60)
def test_open_close_cycles_leak_nothing():
    proc = psutil.Process()
    # One warm-up cycle: first use loads libraries and creates lazily made objects.
    w, rs = _queue_with_readers(2, 1, max_chunk_bytes=1024, max_chunks=2)
    for q in [w, *rs]:
        q.close()
    fds, threads, segs = proc.num_fds(), proc.num_threads(), _our_segments()
    for i in range(15):
        w, rs = _queue_with_readers(2, 1, max_chunk_bytes=1024, max_chunks=2, name=f"cycle{i}")
        w.enqueue({"i": i, "big": b"x" * 3000})  # overflow path too
        assert [r.dequeue(timeout=10) for r in rs] == [{"i": i, "big": b"x" * 3000}] * 3
        for q in [*rs, w] if i % 2 else [w, *rs]:
            q.close()
    time.sleep(0.1)
    assert _our_segments() == segs
    assert proc.num_fds() <= fds, "file descriptors leaked"
    assert proc.num_threads() <= threads, "threads (zmq contexts) leaked"


@pytest.mark.timeout(60)
def test_closed_queue_and_wrong_role_raise_clear_errors():
    w, (r, rr) = _queue_with_readers(1, 1, max_chunk_bytes=1024, max_chunks=1, name="roles")
    try:
        with pytest.raises(QueueRoleError, match="enqueue.*reader rank 1"):
            r.enqueue("x")
        with pytest.raises(QueueRoleError, match="enqueue.*reader rank 2"):
            rr.enqueue("x")
        with pytest.raises(QueueRoleError, match="dequeue"):
            w.dequeue()
        with pytest.raises(QueueRoleError):
            r.export_handle()
        # timeout=0: a non-blocking dequeue, and an enqueue into a full one-chunk ring.
        with pytest.raises(QueueTimeout):
            r.dequeue(timeout=0)
        w.enqueue(("first",), timeout=0)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout, match="reader rank"):
            w.enqueue("second", timeout=0)
        assert time.monotonic() - t0 < 0.5
        assert r.dequeue(timeout=0) == ("first",)
        assert rr.dequeue(timeout=5) == ("first",)
        w.enqueue("second", timeout=0)
        assert r.broadcast_object(timeout=5) == "second" == rr.broadcast_object(timeout=5)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            w.enqueue("x", timeout=-1)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            r.dequeue(timeout="soon")
    finally:
        for q in (r, rr, w):
            q.close()
    for q, op in ((w, lambda: w.enqueue(1)), (r, lambda: r.dequeue(timeout=0)),
                  (rr, lambda: rr.dequeue(timeout=0)), (r, lambda: r.wait_until_ready(1))):
        with pytest.raises(QueueClosedError, match="roles"):
            op()
    assert w.closed and r.closed and not r.poll()


@pytest.mark.timeout(30)
def test_nesting_too_deep_raises_value_error_and_queue_stays_usable():
    w, (r,) = _queue_with_readers(1, 0, max_chunk_bytes=1 << 16, max_chunks=2, name="deep")
    try:
        deep: object = 0
        for _ in range(5000):
            deep = [deep]
        with pytest.raises(ValueError, match="nested too deeply"):
            w.enqueue(deep, timeout=5)
        w.enqueue("after", timeout=5)
        assert r.dequeue(timeout=5) == "after"
    finally:
        r.close()
        w.close()


@pytest.mark.timeout(30)
def test_memoryview_and_received_arrays_are_private():
    w, (r,) = _queue_with_readers(1, 0, max_chunk_bytes=1 << 16, max_chunks=2, name="private")
    try:
        a = np.arange(8, dtype=np.int64)
        w.enqueue({"a": a, "mv": memoryview(a), "rw": memoryview(bytearray(b"rw"))})
        a[:] = -1
        got = r.dequeue(timeout=5)
        assert got["a"].tolist() == list(range(8)) and got["a"].flags.writeable
        assert type(got["mv"]) is memoryview and got["mv"].tolist() == list(range(8))
        assert got["rw"].readonly is False and bytes(got["rw"]) == b"rw"
        got["a"][:] = 5
        w.enqueue("next")
        assert r.dequeue(timeout=5) == "next" and got["a"].tolist() == [5] * 8
    finally:
        r.close()
        w.close()


def _shutdown_soon(mq: MessageQueue) -> None:
    time.sleep(0.2)
    mq.shutdown()


@pytest.mark.timeout(30)
def test_dequeue_order_with_overflow_interleaved_and_slow_start():
    # The reader starts reading only after the writer filled the ring with a mix of
    # overflow and ring messages: order must still be the send order.
    w, (r, rr) = _queue_with_readers(1, 1, max_chunk_bytes=256, max_chunks=4, name="mix")
    try:
        msgs = [("big", i, b"y" * 400) if i % 2 else ("small", i) for i in range(4)]
        for m in msgs:
            w.enqueue(m, timeout=5)
        assert [r.dequeue(timeout=5) for _ in msgs] == msgs
        assert [rr.dequeue(timeout=5) for _ in msgs] == msgs
        threading.Thread(target=_shutdown_soon, args=(r,), daemon=True).start()
        with pytest.raises(QueueClosedError):
            r.dequeue()
    finally:
        for q in (r, rr, w):
            q.close()
