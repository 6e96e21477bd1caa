"""Stress of the park/doorbell wake-up protocol with real processes.

Readers pause a random 0-5 ms before each dequeue, so they park between
messages; the writer pauses a random 0-5 ms before each enqueue and, with a
one- or two-chunk ring, parks on a full ring too. With ``max_chunks=1`` every
step is lock-step: a wake-up that is lost is not rescued by the next message's
bell, the sleeper only wakes when its bounded poll (``park_poll_s``) expires.

The wait policy makes that visible: ``park_poll_s = liveness_s = 1 s`` while no
side is ever idle for more than a few ms, so any park that ends by timeout
(``MessageQueue.park_stats()["timeouts"]``) is a lost wake-up, and so is any
message that took ``SLOW_S`` or more: a sleeper whose bell was lost wakes only
when its 1 s poll expires. Faster delays are the scheduler's (a loaded
2-core machine can stall a process for half a second) and are not failures.
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

import pytest

from shm_broadcast import MessageQueue, WaitPolicy

# Park almost at once (no spin, 0.2 ms of yielding); polls bounded by 1 s.
POLICY = WaitPolicy(spin_s=0.0, yield_s=0.0002, park_poll_s=1.0, liveness_s=1.0)
MAX_GAP_S = 0.005
SLOW_S = 0.95 * POLICY.park_poll_s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_readers, max_chunks, n_msgs",
                         [(4, 1, 500), pytest.param(3, 2, 500, marks=pytest.mark.slow)],
                         ids=["4-readers-1-chunk", "3-readers-2-chunks"])
def test_no_lost_wakeups_under_random_gaps(procs, n_readers, max_chunks, n_msgs):
    ranks = list(range(1, n_readers + 1))
    mq = MessageQueue(n_readers, n_readers, ranks, max_chunk_bytes=256, max_chunks=max_chunks,
                      name=f"wake-{max_chunks}", wait_policy=POLICY)
    rnd = random.Random(7)
    try:
        for r in ranks:
            procs.start(jittery_reader, mq.export_handle(), r, n_msgs, MAX_GAP_S, POLICY)
        mq.wait_until_ready(50)
        before = mq.park_stats()
        slow_enqueues = []
        for i in range(n_msgs):
            gap = rnd.uniform(0.0, MAX_GAP_S)
            if gap > 0.001:  # some back-to-back messages too
                time.sleep(gap)
            t0 = time.monotonic()
            mq.enqueue((i, t0), timeout=30)
            took = time.monotonic() - t0
            if took >= SLOW_S:
                slow_enqueues.append((i, round(took, 3)))
        after = mq.park_stats()
        reports = sorted(procs.get(timeout=40) for _ in ranks)
    finally:
        mq.close()
    writer_parks = after["parks"] - before["parks"]
    writer_timeouts = after["timeouts"] - before["timeouts"]
    assert [r[:2] for r in reports] == [("ok", r) for r in ranks]
    summary = {r[1]: {"parks": r[2], "timeouts": r[3], "worst_s": round(r[4], 3), "slow": r[5]}
               for r in reports}
    summary["writer"] = {"parks": writer_parks, "timeouts": writer_timeouts,
                         "slow": slow_enqueues}
    # The scenario really exercised both directions of the handshake. On a quiet
    # machine each side parks for ~20-50% of the messages; a side descheduled by
    # other load finds its message (or its free chunk) ready instead, and with two
    # test suites on two cores that fell to 3-4%. A protocol that stopped parking
    # would show 0: the floor is 2%.
    assert all(summary[r]["parks"] >= n_msgs // 50 for r in ranks), summary
    assert writer_parks >= n_msgs // 50, summary
    # ... and no sleeper ever needed its timeout to notice a message or a free chunk.
    assert writer_timeouts == 0 and not slow_enqueues, summary
    assert all(summary[r]["timeouts"] == 0 and not summary[r]["slow"] for r in ranks), summary


# ---------------------------------------------------------------------- child processes
# Spawned by the ``procs`` fixture as ``fn(*args, out_queue)``; each reports through
# the queue (``("ok", ...)`` or ``("error", traceback)``) and never fails silently.
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
                if lat >= SLOW_S:
                    slow.append((i, round(lat, 3)))
            after = mq.park_stats()
        out.put(("ok", rank, after["parks"] - before["parks"],
                 after["timeouts"] - before["timeouts"], worst, slow))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
