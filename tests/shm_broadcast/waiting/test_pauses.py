"""A paused peer is not a dead one: real processes, real SIGSTOP / SIGCONT.

A reader or a writer stopped for 4 s (longer than the 3 s ZMTP heartbeat that
used to turn such a pause into a disconnect on both sides) must be waited for:

* without a timeout, the other side keeps waiting and every message arrives,
  in order, once the peer is resumed;
* with a timeout, the other side raises ``QueueTimeout`` (never
  ``PeerDiedError``) naming the stopped peer and saying it is stopped, and the
  queue keeps working after ``SIGCONT``.

Both transports: ``tcp`` (a remote reader over loopback) and ``shm`` (a reader
through the shared-memory ring).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from typing import Any

import pytest

from shm_broadcast import MessageQueue, PeerDiedError, QueueTimeout
from tests.processes import stop_process

PAUSE_S = 4.0  # > the old 3 s heartbeat timeout: the shortest pause that proves the point
TIMEOUT_S = 1.0  # the timed cases: a pause of 2 s outlasts it


def _queue(transport: str, name: str) -> MessageQueue:
    if transport == "tcp":
        return MessageQueue(1, 0, connect_ip="127.0.0.1", max_chunks=2, name=name, writer_rank=0)
    return MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=2, name=name, writer_rank=0)


def _resume_later(pid: int, seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    t.start()
    return t


def _resume(pid: int) -> None:
    """SIGCONT ``pid`` if it is still there (a child that finished may be reaped already)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------------- child processes
def reader_main(handle: Any, n: int, out: Any) -> None:
    """Read ``n`` messages without a timeout, checking their order; report."""
    try:
        with MessageQueue.create_from_handle(handle, 1) as mq:
            mq.wait_until_ready(60)
            out.put(("ready", os.getpid()))
            got = [mq.dequeue() for _ in range(n)]
        out.put(("read", got))
    except BaseException as e:
        out.put(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))


def writer_main(transport: str, batches: list[list[int]], go: Any, out: Any) -> None:
    """Send each batch after a ``go`` (the first at once); no timeout anywhere."""
    try:
        with _queue(transport, f"paused-writer-{transport}") as mq:
            out.put(("handle", mq.export_handle()))
            mq.wait_until_ready(60)
            for i, batch in enumerate(batches):
                if i:
                    go.get(timeout=60)
                for x in batch:
                    mq.enqueue(x)
            out.put(("sent", os.getpid()))
            go.get(timeout=60)  # stay until the reader has everything
    except BaseException as e:
        out.put(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))


def _report(procs: Any, want: str, timeout: float = 60) -> tuple:
    msg = procs.get(timeout=timeout)
    assert msg[0] == want, msg
    return msg


# ---------------------------------------------------------------------- reader paused
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=pytest.mark.slow)])
def test_a_stopped_reader_is_waited_for_without_a_timeout(procs, transport: str) -> None:
    n = 40
    mq = _queue(transport, f"paused-reader-{transport}")
    try:
        child = procs.start(reader_main, mq.export_handle(), n)
        mq.wait_until_ready(60)
        _report(procs, "ready")
        for i in range(4):
            mq.enqueue(i)
        stop_process(child.pid)
        timer = _resume_later(child.pid, PAUSE_S)
        t0 = time.monotonic()
        for i in range(4, n):  # blocks on the full ring / window until the reader resumes
            mq.enqueue(i)
        waited = time.monotonic() - t0
        timer.join()
        assert waited >= PAUSE_S - 0.5, f"the writer did not wait for the reader ({waited:.2f}s)"
        assert _report(procs, "read")[1] == list(range(n))
    finally:
        mq.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_stopped_reader_makes_the_writer_time_out_naming_it(procs, transport: str) -> None:
    mq = _queue(transport, f"timed-reader-{transport}")
    n_before = 2 if transport == "shm" else 8  # what the ring / the TCP window holds
    sent = []
    try:
        child = procs.start(reader_main, mq.export_handle(), n_before + 3)
        mq.wait_until_ready(60)
        _report(procs, "ready")
        stop_process(child.pid)
        for i in range(n_before):
            mq.enqueue(i, timeout=TIMEOUT_S)
            sent.append(i)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            mq.enqueue("lost", timeout=TIMEOUT_S)
        elapsed = time.monotonic() - t0
        assert not isinstance(info.value, PeerDiedError)
        assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + 1.0, elapsed
        text = str(info.value)
        assert info.value.peers == (1,) and "reader rank(s) [1]" in text, text
        assert "stopped" in text and str(child.pid) in text, text
        os.kill(child.pid, signal.SIGCONT)
        for i in range(n_before, n_before + 3):  # the queue still works
            mq.enqueue(i, timeout=30)
            sent.append(i)
        assert _report(procs, "read")[1] == sent
    finally:
        _resume(child.pid)
        mq.close()


# ---------------------------------------------------------------------- writer paused
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=pytest.mark.slow)])
def test_a_stopped_writer_is_waited_for_without_a_timeout(procs, transport: str) -> None:
    go = procs.ctx.Queue()
    child = procs.start(writer_main, transport, [[0, 1], [2, 3, 4]], go)
    handle = _report(procs, "handle")[1]
    try:
        with MessageQueue.create_from_handle(handle, 1) as mq:
            mq.wait_until_ready(60)
            got = [mq.dequeue(), mq.dequeue()]
            stop_process(child.pid)
            go.put("send the second batch")  # read by the writer only once it runs again
            timer = _resume_later(child.pid, PAUSE_S)
            t0 = time.monotonic()
            got += [mq.dequeue() for _ in range(3)]
            waited = time.monotonic() - t0
            timer.join()
            assert waited >= PAUSE_S - 0.5, waited
            assert got == [0, 1, 2, 3, 4]
            _report(procs, "sent")
            go.put("done")
    finally:
        _resume(child.pid)
        go.close()
        go.join_thread()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", pytest.param("shm", marks=pytest.mark.slow)])
def test_a_stopped_writer_makes_the_reader_time_out_naming_it(procs, transport: str) -> None:
    go = procs.ctx.Queue()
    child = procs.start(writer_main, transport, [[0], [1, 2]], go)
    handle = _report(procs, "handle")[1]
    try:
        with MessageQueue.create_from_handle(handle, 1) as mq:
            mq.wait_until_ready(60)
            assert mq.dequeue() == 0
            stop_process(child.pid)
            go.put("send the second batch")
            t0 = time.monotonic()
            with pytest.raises(QueueTimeout) as info:
                mq.dequeue(timeout=TIMEOUT_S)
            elapsed = time.monotonic() - t0
            assert not isinstance(info.value, PeerDiedError)
            assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + 1.0, elapsed
            text = str(info.value)
            assert info.value.peers == (0,) and str(child.pid) in text, text  # writer_rank
            assert "stopped" in text, text
            os.kill(child.pid, signal.SIGCONT)
            assert [mq.dequeue(timeout=30), mq.dequeue(timeout=30)] == [1, 2]
            _report(procs, "sent")
            go.put("done")
    finally:
        _resume(child.pid)
        go.close()
        go.join_thread()
