"""A queue names its laggards (shm_broadcast.queue.laggards): a wait that lasts past
``warn_interval`` is logged with who holds it up, and the writer's per-reader lag
is readable from ``lag_stats()``.

Writer and readers are real queue sides in this process (same ring, same
sockets as across processes); a reader that "stops reading" is simply not
asked to. Intervals are a tenth of a second and checks run every 20 ms, so
each test takes well under a second.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from shm_broadcast import MessageQueue, QueueRoleError, QueueTimeout, ShmRingBuffer, WaitPolicy
from shm_broadcast.queue.laggards import WaitWarnings
from shm_broadcast.queue.options import (
    DEFAULT_WARN_INTERVAL,
    WARN_INTERVAL_ENV,
    check_warn_interval,
)

WARN = 0.1  # warn_interval of these queues
FAST = WaitPolicy(liveness_s=0.02)  # the checks that warn run this often


def make_queue(n_local: int, n_remote: int = 0, **kw):
    """Writer (rank 0) plus readers (local ranks 1..n_local, remote after), connected."""
    local = list(range(1, n_local + 1))
    remote = list(range(n_local + 1, n_local + n_remote + 1))
    w = MessageQueue(n_local + n_remote, n_local, local, writer_rank=0, wait_policy=FAST,
                     warn_interval=WARN, connect_ip="127.0.0.1" if n_remote else None, **kw)
    readers: list[MessageQueue] = []
    try:
        readers = [MessageQueue.create_from_handle(w.export_handle(r), r, wait_policy=FAST,
                                                   warn_interval=WARN)
                   for r in local + remote]
        w.wait_until_ready(30)
        for r in readers:
            r.wait_until_ready(30)
    except BaseException:
        for q in [w, *readers]:
            q.close()
        raise
    return w, readers


@pytest.fixture
def queues():
    made: list[MessageQueue] = []

    def make(*args, **kw):
        w, readers = make_queue(*args, **kw)
        made.extend([w, *readers])
        return w, readers

    yield make
    for q in reversed(made):
        q.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "shm_broadcast.queue" and r.levelno == logging.WARNING]


def test_wait_warnings_fall_due_once_per_interval():
    w = WaitWarnings(2.0)
    assert not w.due(100.0)  # no wait started
    w.start(100.0)
    assert w.began == 100.0
    assert not w.due(101.9) and w.due(102.0) and not w.due(103.9) and w.due(104.5)
    assert not w.due(106.4) and w.due(106.5)  # an interval after the last warning
    w.stop()
    assert not w.due(1e9)


@pytest.mark.timeout(30)
def test_ring_counts_each_readers_unread_messages():
    ring = ShmRingBuffer.create(2, 256, 3)
    try:
        assert ring.unread_counts() == [0, 0]  # nothing written
        for chunk in (0, 1, 2):  # messages #0..#2
            ring.begin_write(chunk)
            ring.publish(chunk)
        ring.mark_read(0, 0)  # reader 0 read #0; reader 1 nothing
        assert ring.unread_counts() == [2, 3]
        ring.mark_read(1, 0)
        ring.mark_read(0, 1)
        ring.begin_write(0)  # #3 into the freed chunk 0
        ring.publish(0)
        assert ring.unread_counts() == [2, 3]  # reader 0: #2, #3; reader 1: #1..#3
    finally:
        ring.close()


@pytest.mark.timeout(60)
def test_writer_names_the_local_reader_behind_and_its_outstanding_messages(queues, caplog):
    w, (r1, r2, r3) = queues(3, max_chunks=2, name="lag")
    for i in range(2):
        w.enqueue(i)
        assert r1.dequeue(timeout=5) == i and r3.dequeue(timeout=5) == i
    assert r2.dequeue(timeout=5) == 0  # rank 2 stops after message 0
    w.enqueue(2)  # chunk 0 is free: no wait
    assert r1.dequeue(timeout=5) == 2 and r3.dequeue(timeout=5) == 2
    caplog.set_level(logging.WARNING, logger="shm_broadcast.queue")
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout):
        w.enqueue(3, timeout=0.25)  # chunk 1 still holds #1, unread by rank 2
    waited = time.monotonic() - t0
    said = warnings_of(caplog)
    assert 1 <= len(said) <= waited / WARN + 1, said  # once per interval, not per check
    for text in said:
        assert text.startswith("queue 'lag': the writer (rank 0) has waited "), text
        assert "room for message #3 (ring of 2 chunks full)" in text, text
        assert "local reader 1 (rank 2) with 2 messages unread" in text, text
        assert "rank 1" not in text and "rank 3" not in text, text
    # The same figures on demand, for every reader.
    assert w.lag_stats() == {"written": 3, "readers": [
        {"reader": 0, "rank": 1, "remote": False, "outstanding": 0},
        {"reader": 1, "rank": 2, "remote": False, "outstanding": 2},
        {"reader": 2, "rank": 3, "remote": False, "outstanding": 0}]}
    assert [r2.dequeue(timeout=5) for _ in range(2)] == [1, 2]
    assert [e["outstanding"] for e in w.lag_stats()["readers"]] == [0, 0, 0]
    with pytest.raises(QueueRoleError):
        r1.lag_stats()


@pytest.mark.timeout(60)
def test_writer_names_the_remote_reader_a_window_behind(queues, caplog):
    w, (local, remote) = queues(1, 1, max_chunks=2, name="win")
    window = max(8, 2 * 2)  # the writer's remote_window for 2 chunks
    for i in range(window):
        w.enqueue(i)
        assert local.dequeue(timeout=5) == i  # the remote reader reads nothing
    caplog.set_level(logging.WARNING, logger="shm_broadcast.queue")
    with pytest.raises(QueueTimeout):
        w.enqueue(window, timeout=0.25)
    said = warnings_of(caplog)
    assert said, "no warning"
    for text in said:
        assert f"room for message #{window} ({window} messages unacknowledged)" in text, text
        assert f"remote reader rank 2 with {window} messages unacknowledged" in text, text
        assert "local reader" not in text, text
    stats = w.lag_stats()
    assert stats["written"] == window
    assert stats["readers"] == [
        {"reader": 0, "rank": 1, "remote": False, "outstanding": 0},
        {"reader": None, "rank": 2, "remote": True, "outstanding": window}]
    assert [remote.dequeue(timeout=5) for _ in range(window)] == list(range(window))
    end = time.monotonic() + 5  # its acks travel to the writer
    while w.lag_stats()["readers"][1]["outstanding"] and time.monotonic() < end:
        time.sleep(0.01)
    assert w.lag_stats()["readers"][1]["outstanding"] == 0


_SINCE = re.compile(r"has waited ([\d.]+) s for message #1 from the writer rank 0 \(pid \d+"
                    r"[^)]*\), which is alive; its last message \(#0\) arrived ([\d.]+) s ago")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_remote", [0, 1], ids=["local", "remote"])
def test_reader_names_the_writer_and_the_age_of_its_last_message(queues, caplog, n_remote):
    w, (r,) = queues(1 - n_remote, n_remote, name="idle")
    caplog.set_level(logging.WARNING, logger="shm_broadcast.queue")
    with pytest.raises(QueueTimeout):
        r.dequeue(timeout=0.2)
    said = warnings_of(caplog)
    assert said, "no warning"
    assert all("for message #0 from the writer rank 0 (pid " in t
               and "no message yet since it connected " in t for t in said), said
    # Message #0 arrives while the reader waits (the case a remote reader times exactly).
    sender = threading.Timer(0.05, w.enqueue, ("a",))
    sender.start()
    try:
        assert r.dequeue(timeout=5) == "a"
    finally:
        sender.join()
    caplog.clear()
    with pytest.raises(QueueTimeout):
        r.dequeue(timeout=0.2)
    said = warnings_of(caplog)
    assert said, "no warning"
    for text in said:
        found = _SINCE.search(text)
        assert found, text
        waited, ago = map(float, found.groups())
        assert waited >= WARN * 0.9 and ago >= waited, text


@pytest.mark.timeout(60)
def test_remote_reader_without_the_arrival_time_gives_a_lower_bound(queues, caplog):
    w, (r,) = queues(0, 1, name="bound")
    w.enqueue("a")
    end = time.monotonic() + 5
    while not r.poll() and time.monotonic() < end:  # there before it is asked for
        time.sleep(0.01)
    assert r.dequeue(timeout=0) == "a"
    caplog.set_level(logging.WARNING, logger="shm_broadcast.queue")
    with pytest.raises(QueueTimeout):
        r.dequeue(timeout=0.2)
    said = warnings_of(caplog)
    assert said and all("its last message (#0) arrived before this wait began, at least "
                        in t for t in said), said


def test_warn_interval_default_environment_and_argument(monkeypatch):
    monkeypatch.delenv(WARN_INTERVAL_ENV, raising=False)
    assert check_warn_interval(None) == DEFAULT_WARN_INTERVAL == 10.0
    monkeypatch.setenv(WARN_INTERVAL_ENV, "2.5")
    assert check_warn_interval(None) == 2.5
    assert check_warn_interval(0.3) == 0.3  # the argument wins
    monkeypatch.setenv(WARN_INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match=WARN_INTERVAL_ENV):
        check_warn_interval(None)
    monkeypatch.setenv(WARN_INTERVAL_ENV, "0")
    with pytest.raises(ValueError, match=WARN_INTERVAL_ENV):
        MessageQueue(1, 1)


@pytest.mark.parametrize("value,error", [
    ("10", TypeError), (True, TypeError), ([1], TypeError),
    (0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
])
def test_bad_warn_interval_names_the_argument(value, error):
    with pytest.raises(error, match="warn_interval"):
        MessageQueue(1, 1, warn_interval=value)


@pytest.mark.timeout(60)
def test_a_reader_checks_its_warn_interval_too(queues):
    w, _ = queues(1, name="check")
    with pytest.raises(ValueError, match="warn_interval"):
        MessageQueue.create_from_handle(w.export_handle(), 1, warn_interval=0)
