"""Confirmed enqueues: the writer learns that each reader took or refused a message.

Readers are real processes attached through the ring; a reader refuses with
``dequeue(verdict=...)`` and the writer's ``enqueue_confirmed`` returns every
reader's verdict in slot order, or times out naming the readers that did not
come, or raises ``PeerDiedError`` for one that died.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import pytest

from shm_broadcast import MessageQueue, PeerDiedError, QueueTimeout
from shm_broadcast.errors import QueueRoleError


def judging_reader(handle: Any, rank: int, plan: list[str], out: Any) -> None:
    """Read one message per ``plan`` entry: ``take``, ``refuse``, ``raise`` (the
    verdict raises), or ``sleep`` (wait 3 s before reading, then take)."""
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            got = []
            for step in plan:
                if step == "sleep":
                    time.sleep(3)

                def verdict(msg: Any, step: str = step) -> str | None:
                    if step == "raise":
                        raise ValueError(f"rank {rank} cannot use {msg!r}")
                    return f"rank {rank} refuses {msg!r} " + "x" * 3000 if step == "refuse" \
                        else None

                try:
                    got.append(mq.dequeue(timeout=60, verdict=verdict))
                except ValueError as e:
                    got.append(f"raised {e}")
            out.put(("ok", rank, got))
            if plan != ["sleep"]:
                mq.dequeue(timeout=60)  # the writer's last, unconfirmed message
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk_bytes", [1 << 16, 128], ids=["big-chunks", "tiny-chunks"])
def test_each_readers_verdict_reaches_the_writer(procs, chunk_bytes: int) -> None:
    plans = {1: ["take", "refuse", "take", "raise", "take"],
             2: ["refuse", "take", "take", "take", "refuse"]}
    mq = MessageQueue(2, 2, [1, 2], max_chunk_bytes=chunk_bytes, max_chunks=2, name="verdicts")
    try:
        for r, plan in plans.items():
            procs.start(judging_reader, mq.export_handle(), r, plan)
        mq.wait_until_ready(60)
        verdicts = [mq.enqueue_confirmed(i, timeout=30) for i in range(5)]
        mq.enqueue("bye", timeout=30)
        reports = sorted(procs.get(60) for _ in plans)
    finally:
        mq.close()
    text = [[None if v is None else v[:40] for v in row] for row in verdicts]
    # The reasons live outside the chunks: whole (cut to 1 KiB) whatever the chunk size.
    assert text == [[None, "rank 2 refuses 0 xxxxxxxxxxxxxxxxxxxxxxx"],
                    ["rank 1 refuses 1 xxxxxxxxxxxxxxxxxxxxxxx", None],
                    [None, None],
                    ["ValueError: rank 1 cannot use 3", None],
                    [None, "rank 2 refuses 4 xxxxxxxxxxxxxxxxxxxxxxx"]], text
    assert all(v is None or len(v.encode()) <= 1020 for row in verdicts for v in row)
    assert len(verdicts[0][1]) == 1020
    assert reports[0][2] == [0, 1, 2, "raised rank 1 cannot use 3", 4]
    assert reports[1][2] == [0, 1, 2, 3, 4]


@pytest.mark.timeout(120)
def test_a_reader_that_does_not_come_times_out_the_writer_naming_it(procs) -> None:
    mq = MessageQueue(1, 1, [5], max_chunk_bytes=1 << 12, max_chunks=4, name="late")
    try:
        procs.start(judging_reader, mq.export_handle(), 5, ["sleep"])
        mq.wait_until_ready(60)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            mq.enqueue_confirmed("x", timeout=1.0)
        took = time.monotonic() - t0
        assert 0.9 <= took < 2.5, took
        assert info.value.peers == [5] or list(info.value.peers) == [5]
        assert "to take message #0" in str(info.value), str(info.value)
        assert procs.get(60)[2] == ["x"]  # it took the message later, after all
    finally:
        mq.close()


def _stopped_reader(handle: Any, rank: int, out: Any) -> None:
    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        mq.wait_until_ready(60)
        out.put(("ready", os.getpid()))
        time.sleep(60)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_reader_that_dies_ends_the_writers_wait(procs) -> None:
    mq = MessageQueue(1, 1, [1], max_chunk_bytes=1 << 12, max_chunks=4, name="dies")
    try:
        procs.start(_stopped_reader, mq.export_handle(), 1)
        mq.wait_until_ready(60)
        _, pid = procs.get(60)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerDiedError) as info:
            mq.enqueue_confirmed("x", timeout=30)
        assert time.monotonic() - t0 < 5
        assert 1 in info.value.peers
    finally:
        mq.close()


def test_confirmed_enqueue_and_verdicts_check_their_roles_and_arguments(procs) -> None:
    mq = MessageQueue(2, 1, [1], max_chunk_bytes=1 << 12, max_chunks=2, name="remote",
                      connect_ip="127.0.0.1")
    try:
        with pytest.raises(QueueRoleError, match="remote"):
            mq.enqueue_confirmed("x", timeout=1)
        with pytest.raises(QueueRoleError, match="readers"):
            mq.dequeue(verdict=lambda m: None)
    finally:
        mq.close()
    with MessageQueue(1, 1, [1], max_chunk_bytes=1 << 12, max_chunks=2, name="role") as w:
        r = MessageQueue.create_from_handle(w.export_handle(), 1)
        try:
            with pytest.raises(QueueRoleError, match="writer"):
                r.enqueue_confirmed("x")
            with pytest.raises(TypeError, match="verdict"):
                r.dequeue(timeout=0, verdict="refuse")
        finally:
            r.close()


def slow_reader(handle: Any, rank: int, n: int, out: Any) -> None:
    """Take ``n`` array messages, each after a pause, and report whether every one
    arrived whole (another reader refuses them all meanwhile)."""
    import numpy as np

    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            bad = []
            for i in range(n):
                time.sleep(0.02)  # the refusing reader is done with the message first
                msg = mq.dequeue(timeout=60)
                if msg["i"] != i or not np.array_equal(msg["a"], np.arange(4096) + i):
                    bad.append(i)
            out.put(("ok", rank, bad))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def refusing_reader(handle: Any, rank: int, n: int, out: Any) -> None:
    try:
        with MessageQueue.create_from_handle(handle, rank) as mq:
            mq.wait_until_ready(60)
            for _ in range(n):
                mq.dequeue(timeout=60, verdict=lambda m: "no " * 400)
            out.put(("ok", rank, []))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_refusal_never_touches_what_another_reader_still_reads(procs) -> None:
    """Reasons live outside the chunks: a slower reader still gets every payload whole."""
    import numpy as np

    n = 20
    mq = MessageQueue(2, 2, [1, 2], max_chunk_bytes=1 << 16, max_chunks=2, name="overlap")
    try:
        procs.start(refusing_reader, mq.export_handle(), 1, n)
        procs.start(slow_reader, mq.export_handle(), 2, n)
        mq.wait_until_ready(60)
        for i in range(n):
            verdicts = mq.enqueue_confirmed({"i": i, "a": np.arange(4096) + i}, timeout=30)
            assert verdicts[0] is not None and verdicts[0].startswith("no no") and \
                verdicts[1] is None, verdicts
        reports = sorted(procs.get(60) for _ in range(2))
    finally:
        mq.close()
    assert reports == [("ok", 1, []), ("ok", 2, [])], reports
