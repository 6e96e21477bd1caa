"""Predictive waiting (shm_broadcast.waiting.predictive): the predictor's plans, and real
queues between processes under periodic traffic whose pattern then breaks.

The process tests use a long period (0.5 s) so that the wrong outcomes are
unmistakable on a loaded machine: a reader whose planned sleep missed the
writer's bell would wake only when the sleep ends, most of a period later; a
message found only by the liveness timeout would take ``park_poll_s`` (1 s).
Legitimate delays (a bell's kernel wake-up, a descheduled process) are far
below the bounds asserted. ``park_stats()`` shows which path each wait took.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from typing import Any

import psutil
import pytest

from shm_broadcast import MessageQueue, QueueClosedError, QueueTimeout, WaitPolicy
from shm_broadcast.queue.ring_buffer import CHUNK_HEADER
from shm_broadcast.queue.transport import WIRE
from shm_broadcast.waiting.predictive import STAMP_OFFSET, ArrivalPredictor, PredictivePolicy

#: Bounded parks (1 s) and rare liveness checks: a lost bell would show as ~1 s.
#: Three calibration samples (instead of four) make the tests learn a step sooner.
POLICY = WaitPolicy(park_poll_s=1.0, liveness_s=1.0, predict=PredictivePolicy(min_samples=3))
PERIOD_S = 0.5


# ----------------------------------------------------------------- the policy
@pytest.mark.parametrize("field,value,exc", [
    ("history", 1, ValueError), ("history", 2.5, TypeError), ("min_samples", 0, ValueError),
    ("min_samples", 99, ValueError), ("low_quantile", 0.95, ValueError),
    ("high_quantile", 1.5, ValueError), ("lead_s", -1e-6, ValueError),
    ("max_window_s", 0.0, ValueError), ("min_sleep_s", math.nan, ValueError),
    ("fallback_yield_s", -1.0, ValueError), ("yield_contended_s", "0", ValueError),
    ("explore_every", -1, ValueError), ("explore_every", 1.5, TypeError),
    ("park_penalty_s", math.inf, ValueError),
    ("lead_s", True, ValueError),
], ids=lambda v: str(v))
def test_policy_rejects_bad_knobs_naming_them(field: str, value: Any, exc: type) -> None:
    with pytest.raises(exc, match=field):
        PredictivePolicy(**{field: value})


def test_wait_policy_takes_only_a_predictive_policy() -> None:
    with pytest.raises(TypeError, match="predict"):
        WaitPolicy(predict={"lead_s": 0.001})  # type: ignore[arg-type]
    assert WaitPolicy.predictive(lead_s=0.0002).predict == PredictivePolicy(lead_s=0.0002)
    assert WaitPolicy().predict is None


def test_the_stamp_fits_in_the_chunk_header_after_the_wire_fields() -> None:
    assert WIRE.size == STAMP_OFFSET and STAMP_OFFSET + 8 <= CHUNK_HEADER


# -------------------------------------------------------------- the predictor
def _feed(pred: ArrivalPredictor, stamps: list[float], wait_lag: float = 0.0005) -> None:
    """Messages published at ``stamps``; the reader starts waiting ``wait_lag`` after each."""
    now = stamps[0] - 0.1
    for t in stamps:
        pred.plan(now)
        pred.observe(t, now)
        now = t + wait_lag


@pytest.mark.parametrize("period", [0.002, 0.01, 0.5], ids=["2ms", "10ms", "500ms"])
def test_periodic_publishes_give_a_tight_window_around_the_next(period: float) -> None:
    pred = ArrivalPredictor(PredictivePolicy())
    stamps = [100.0 + i * period + (3e-5 if i % 3 == 0 else 0.0) for i in range(20)]
    _feed(pred, stamps)
    now = stamps[-1] + 0.0005
    plan = pred.plan(now)
    nxt = stamps[-1] + period
    assert plan is not None
    assert plan.poll_until - max(plan.sleep_until, now) < 0.001  # a narrow poll
    assert plan.sleep_until <= nxt <= plan.poll_until
    assert pred.stats["on_time"] >= 10 and pred.stats["late"] == 0


def test_a_late_step_does_not_shift_the_grid() -> None:
    pred = ArrivalPredictor(PredictivePolicy())
    stamps = [10.0 + i * 0.01 for i in range(20)]
    stamps[15] += 0.004  # one step 4 ms late; the writer's clock is unchanged
    _feed(pred, stamps)
    plan = pred.plan(stamps[-1] + 0.0005)
    assert plan is not None and plan.sleep_until <= stamps[-1] + 0.01 <= plan.poll_until
    assert pred.stats["late"] >= 1


@pytest.mark.parametrize("late_index", [3, 5], ids=["early-in-history", "last-before-plan"])
def test_one_outlier_among_few_samples_keeps_the_plan(late_index: int) -> None:
    pred = ArrivalPredictor(PredictivePolicy(min_samples=3))
    stamps = [50.0 + 0.5 * i for i in range(8)]
    stamps[late_index] += 0.2  # a writer descheduled for 0.2 s once
    _feed(pred, stamps)
    plan = pred.plan(stamps[-1] + 0.001)
    assert plan is not None and plan.sleep_until <= stamps[-1] + 0.5 <= plan.poll_until
    assert plan.poll_until - plan.sleep_until < 0.01


def _feed_with_lag(pred: ArrivalPredictor, stamps: list[float], lag_of: dict[int, float]) -> list:
    """Like _feed, but the reader sees each message ``lag_of[mode]`` after it."""
    from shm_broadcast.waiting.predictive import PARK_MODE

    modes = []
    now = stamps[0] - 0.1
    for t in stamps:
        plan = pred.plan(now)
        mode = None if plan is None else (
            PARK_MODE if plan.poll_until <= max(now, plan.sleep_until) else 0)
        modes.append(mode)
        pred.observe(t, now, t + lag_of[mode] if mode is not None else None)
        now = t + 0.0005
    return modes


@pytest.mark.parametrize("poll_lag,park_lag,expect", [
    (5e-6, 300e-6, "poll"), (400e-6, 60e-6, "park"), (60e-6, 50e-6, "poll"),
], ids=["poll-faster", "park-faster", "park-not-worth-the-bell"])
def test_the_mode_with_the_lower_lag_wins_and_the_other_is_explored(
        poll_lag: float, park_lag: float, expect: str) -> None:
    from shm_broadcast.waiting.predictive import PARK_MODE

    pred = ArrivalPredictor(PredictivePolicy(explore_every=8))
    stamps = [20.0 + 0.01 * i for i in range(80)]
    modes = _feed_with_lag(pred, stamps, {0: poll_lag, PARK_MODE: park_lag})
    tail = [m for m in modes[-32:] if m is not None]
    want = 0 if expect == "poll" else PARK_MODE
    assert tail.count(want) >= 26 and tail.count(1 - want) >= 2, modes  # exploring
    assert pred.stats["mode_poll"] + pred.stats["mode_park"] == pred.stats["planned"]


def test_irregular_gaps_poll_no_longer_than_the_plain_initial_yield() -> None:
    policy = PredictivePolicy()
    pred = ArrivalPredictor(policy)
    gaps = [0.001, 0.03, 0.004, 0.02, 0.0005, 0.04, 0.002, 0.025] * 3
    stamps = [5.0]
    for g in gaps:
        stamps.append(stamps[-1] + g)
    _feed(pred, stamps)
    now = stamps[-1] + 0.0005
    plan = pred.plan(now)
    # The window is cut to max_window_s and followed by a park (no fallback yield).
    assert plan is not None and plan.fallback_yield_s == 0.0
    assert plan.poll_until - max(now, plan.sleep_until) <= policy.max_window_s + 1e-9


def test_nothing_is_planned_before_enough_samples_or_when_overdue() -> None:
    pred = ArrivalPredictor(PredictivePolicy(min_samples=4))
    assert pred.plan(1.0) is None
    _feed(pred, [1.0 + 0.01 * i for i in range(3)])
    assert pred.plan(1.025) is None  # 2 intervals, no calibrated errors yet
    _feed(pred, [1.03 + 0.01 * i for i in range(10)])
    assert pred.plan(1.12 + 0.0005) is not None
    assert pred.plan(1.12 + 0.05) is None  # the next one is long overdue


def test_absurd_stamps_reset_the_predictor() -> None:
    pred = ArrivalPredictor(PredictivePolicy())
    _feed(pred, [1.0 + 0.01 * i for i in range(12)])
    assert pred.plan(1.1105) is not None
    pred.observe(math.inf, 1.1105)
    pred.observe(1e9, None)  # a writer whose clock jumped: forget, start over
    assert pred.plan(1e9 + 0.0005) is None and pred.period is None


# -------------------------------------------------------- real queues, processes
def periodic_reader(handle: Any, rank: int, n: int, timeout_s: float, out: Any) -> None:
    """Dequeue ``n`` stamped messages ``(i, t_sent)``; report latencies and stats."""
    try:
        with MessageQueue.create_from_handle(handle, rank, wait_policy=POLICY) as mq:
            mq.wait_until_ready(60)
            lat = []
            for i in range(n):
                seq, t_sent = mq.dequeue(timeout=timeout_s)
                lat.append(time.monotonic() - t_sent)
                if seq != i:
                    raise AssertionError(f"reader {rank}: got message {seq}, expected {i}")
                if seq == 0:
                    out.put(("started", rank))
            out.put(("ok", rank, lat, mq.park_stats()))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def _send(mq: MessageQueue, i: int) -> None:
    mq.enqueue((i, time.monotonic()), timeout=30)


def _sleep_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n_readers", [pytest.param(1, marks=pytest.mark.slow), 3],
                         ids=["1-reader", "3-readers"])
def test_an_early_message_rings_the_planned_sleep_awake(procs, n_readers: int) -> None:
    """Learn a 0.5 s period, then publish 0.05 s after the last message: every
    reader is in a planned sleep until ~0.5 s and must be woken by the bell."""
    ranks = list(range(1, n_readers + 1))
    n_periodic, extra = 8, 2
    mq = MessageQueue(n_readers, n_readers, ranks, max_chunk_bytes=4096, max_chunks=4,
                      name="pred-early")
    try:
        for r in ranks:
            procs.start(periodic_reader, mq.export_handle(), r, n_periodic + extra, 30.0)
        mq.wait_until_ready(60)
        t = time.monotonic()
        for i in range(n_periodic):
            _sleep_until(t + i * PERIOD_S)
            _send(mq, i)
        _sleep_until(t + (n_periodic - 1) * PERIOD_S + 0.05)
        _send(mq, n_periodic)                       # early: 0.05 s instead of 0.5 s
        _sleep_until(t + (n_periodic + 1) * PERIOD_S)
        _send(mq, n_periodic + 1)                   # back on the clock
        reports = [procs.get(timeout=60) for _ in range(2 * n_readers)]
    finally:
        mq.close()
    done = sorted((r for r in reports if r[0] == "ok"), key=lambda r: r[1])
    assert [r[1] for r in done] == ranks
    for _, rank, lat, stats in done:
        detail = (rank, str(stats), [round(x, 4) for x in lat])
        # The predictor engaged: periodic messages were planned and slept for.
        assert stats["planned"] >= 2 and stats["sleeps"] >= 2, detail
        # The early message cut a planned sleep short through the doorbell ...
        assert stats["sleeps_rung"] >= 1, detail
        # ... so it took a wake-up, not the rest of the sleep (~0.4 s) or a park bound (1 s).
        assert lat[n_periodic] < 0.3, detail
        assert max(lat) < 0.6, detail


@pytest.mark.timeout(90)
def test_late_messages_and_a_pause_fall_back_and_stay_bounded(procs) -> None:
    """After a learnt period: one message 0.3 s late, a 1.5 s pause (the reader's
    CPU stays near zero), then a burst; no message waits for a timeout."""
    mq = MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=4, name="pred-late")
    n = 16
    try:
        p = procs.start(periodic_reader, mq.export_handle(), 1, n, 30.0)
        mq.wait_until_ready(60)
        t = time.monotonic()
        for i in range(10):
            _sleep_until(t + i * PERIOD_S)
            _send(mq, i)
        _sleep_until(t + 10 * PERIOD_S + 0.3)       # 0.3 s after its slot
        _send(mq, 10)
        proc = psutil.Process(p.pid)
        time.sleep(0.3)                              # past any window and fallback
        cpu0, w0 = proc.cpu_times(), time.monotonic()
        time.sleep(1.5)                              # quiet: the reader must be parked
        cpu1, w1 = proc.cpu_times(), time.monotonic()
        _send(mq, 11)
        for i in range(12, n):                       # a burst, back to back
            _send(mq, i)
        reports = [procs.get(timeout=60) for _ in range(2)]
        _, _, lat, stats = next(r for r in reports if r[0] == "ok")
    finally:
        mq.close()
    idle_cpu = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (w1 - w0)
    assert idle_cpu < 0.05, idle_cpu
    # The late message fell to the fallback, which parks: found by a bell, never
    # by a park's 1 s bound (that would be a lost wake-up).
    assert stats["late"] >= 1, str(stats)
    assert max(lat) < 0.6, ([round(x, 3) for x in lat], str(stats))


def sleeping_reader(handle: Any, out: Any) -> None:
    """Learn the period, then wait in a planned sleep for a message that never
    comes: first with a timeout, then until another thread shuts the queue down."""
    try:
        with MessageQueue.create_from_handle(handle, 1, wait_policy=POLICY) as mq:
            mq.wait_until_ready(60)
            for _ in range(9):
                mq.dequeue(timeout=30)
            before = mq.park_stats()["sleeps"]
            t0 = time.monotonic()
            try:
                mq.dequeue(timeout=0.3)  # next message due in ~0.5 s: never sent
                timed_out = None
            except QueueTimeout as e:
                timed_out = (time.monotonic() - t0, str(e), mq.park_stats()["sleeps"] - before)
            stopper = threading.Timer(0.2, mq.shutdown)
            stopper.start()
            t0 = time.monotonic()
            try:
                mq.dequeue()
                closed = None
            except QueueClosedError:
                closed = time.monotonic() - t0
            stopper.join()
            out.put(("ok", 1, timed_out, closed, mq.park_stats()))
    except BaseException:
        out.put(("error", 1, traceback.format_exc()))


@pytest.mark.timeout(60)
def test_a_planned_sleep_keeps_timeouts_and_shutdown(procs) -> None:
    mq = MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=4, name="pred-stop")
    try:
        procs.start(sleeping_reader, mq.export_handle())
        mq.wait_until_ready(60)
        t = time.monotonic()
        for i in range(9):
            _sleep_until(t + i * PERIOD_S)
            _send(mq, i)
        _, _, timed_out, closed, stats = procs.get(timeout=40)
    finally:
        mq.close()
    # The timeout ended a planned sleep (due ~0.5 s, deadline 0.3 s) on time ...
    assert timed_out is not None and 0.25 < timed_out[0] < 1.2, timed_out
    assert "pred-stop" in timed_out[1] and "timed out" in timed_out[1]
    assert timed_out[2] >= 1, (timed_out, str(stats))
    # ... and a shutdown from another thread woke one (its sleep would last ~1 s).
    assert closed is not None and closed < 0.9, closed
