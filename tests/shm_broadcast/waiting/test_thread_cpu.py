"""Moving a thread off a CPU (shm_broadcast.waiting.thread_cpu): real affinity calls
on real threads, and a real queue reader whose planned polls find its CPUs busy.

Each affinity test runs in a thread of its own (affinity is per thread), so the
test process's own placement is never touched; those that move a thread check
that its affinity is what it was.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from shm_broadcast import MessageQueue, WaitPolicy
from shm_broadcast.waiting import thread_cpu
from shm_broadcast.waiting.predictive import PredictivePolicy
from shm_broadcast.waiting.thread_cpu import (
    MAX_PAUSE,
    SPREAD_ENV,
    UNDONE_WITHIN,
    CpuHop,
    can_move,
    current_cpu,
    free_cpu_likely,
    move_off,
)

movable = pytest.mark.skipif(
    thread_cpu.sched_getcpu is None or not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2,
    reason="needs sched_getcpu and at least two CPUs this process may run on")


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a fresh thread (its own affinity); its exception re-raised here."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ------------------------------------------------------------------ move_off
@movable
def test_move_off_leaves_the_cpu_and_keeps_the_affinity() -> None:
    def body() -> tuple[int, int, set[int], set[int], bool]:
        before, cpu = os.sched_getaffinity(0), current_cpu()
        moved = move_off({cpu})
        return cpu, current_cpu(), before, os.sched_getaffinity(0), moved

    cpu, now, before, after, moved = in_thread(body)
    assert moved and now != cpu and now in before
    assert after == before


@movable
def test_move_off_within_a_narrowed_affinity_stays_inside_it() -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]

    def body() -> tuple[int, int, set[int]]:
        os.sched_setaffinity(0, {a})  # runs on a now
        os.sched_setaffinity(0, {a, b})
        start = current_cpu()
        move_off({start})
        return start, current_cpu(), os.sched_getaffinity(0)

    start, now, after = in_thread(body)
    assert start == a and now == b
    assert after == {a, b}


@movable
def test_move_off_every_allowed_cpu_changes_nothing() -> None:
    def body() -> tuple[bool, set[int], set[int]]:
        before = os.sched_getaffinity(0)
        return move_off(before), before, os.sched_getaffinity(0)

    moved, before, after = in_thread(body)
    assert moved is False and after == before


@movable
def test_can_move_needs_two_cpus() -> None:
    only = min(os.sched_getaffinity(0))

    def body() -> tuple[bool, bool]:
        two = can_move()
        os.sched_setaffinity(0, {only})
        return two, can_move()

    assert in_thread(body) == (True, False)


# ------------------------------------------------------------------ CpuHop
@movable
def test_cpu_hop_moves_after_a_shared_wait_only() -> None:
    def body() -> list[tuple[int, int]]:
        hop = CpuHop(free_cpu=lambda: True)  # other tests' load must not decide
        assert hop.active
        seen = []
        for shared in (False, True, False, True):
            cpu = current_cpu()
            hop.before_sleep(shared)
            seen.append((cpu, current_cpu()))
        assert hop.moves == 2
        return seen

    seen = in_thread(body)
    assert seen[1][0] != seen[1][1] and seen[3][0] != seen[3][1]


@movable
def test_cpu_hop_pauses_longer_after_each_move_that_did_not_hold() -> None:
    """Every wait shared (no CPU free): the pause before the next move doubles,
    so the moves come at waits 1, 2, 4, 7, 12, 21, 38... (each pause + 1 after
    the last); a move that holds (no shared wait for longer than the pause and
    UNDONE_WITHIN) lets the next move come at once."""
    def body() -> tuple[list[int], int, int]:
        before = os.sched_getaffinity(0)
        hop = CpuHop(free_cpu=lambda: True)
        at = []
        for wait in range(1, 41):
            moves = hop.moves
            hop.before_sleep(True)
            if hop.moves != moves:
                at.append(wait)
        for _ in range(MAX_PAUSE + UNDONE_WITHIN + 1):
            hop.before_sleep(False)
        held = hop.moves
        hop.before_sleep(True)
        hop.before_sleep(True)
        assert os.sched_getaffinity(0) == before
        return at, held, hop.moves

    at, held, after = in_thread(body)
    assert at == [1, 2, 4, 7, 12, 21, 38]
    assert after == held + 2  # the pause was reset: two moves in a row again


@movable
def test_the_pause_stops_growing_at_its_bound() -> None:
    def body() -> list[int]:
        hop = CpuHop(free_cpu=lambda: True)
        at = []
        for wait in range(1, 6 * MAX_PAUSE):
            moves = hop.moves
            hop.before_sleep(True)
            if hop.moves != moves:
                at.append(wait)
        return [b - a for a, b in zip(at, at[1:], strict=False)]

    gaps = in_thread(body)
    assert max(gaps) == MAX_PAUSE + 1 and gaps[-3:] == [MAX_PAUSE + 1] * 3


@pytest.mark.parametrize("value,active", [("0", False), ("off", False), ("1", True)],
                         ids=["0", "off", "1"])
def test_cpu_hop_follows_the_spread_variable(monkeypatch: pytest.MonkeyPatch, value: str,
                                             active: bool) -> None:
    monkeypatch.setenv(SPREAD_ENV, value)
    assert CpuHop().active is (active and can_move())
    assert CpuHop(enabled=False).active is False


def test_cpu_hop_rejects_a_bad_spread_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPREAD_ENV, "sometimes")
    with pytest.raises(ValueError, match=SPREAD_ENV):
        CpuHop()


def test_an_inactive_hop_never_moves() -> None:
    hop = CpuHop(enabled=False)
    for _ in range(3):
        hop.before_sleep(True)
    assert hop.moves == 0


def test_without_sched_getcpu_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thread_cpu, "sched_getcpu", None)  # as on macOS
    assert current_cpu() == -1 and not can_move()
    hop = CpuHop()
    hop.before_sleep(True)
    assert not hop.active and hop.moves == 0


@pytest.mark.parametrize("policy,raises", [
    (WaitPolicy.predictive(), True),
    (WaitPolicy.predictive(leave_shared_cpu=False), False),
    (WaitPolicy(), False),
], ids=["predictive", "predictive-stay", "plain"])
def test_a_bad_spread_variable_is_refused_when_the_queue_is_made(
        monkeypatch: pytest.MonkeyPatch, policy: WaitPolicy, raises: bool) -> None:
    """Checked with the queue's options (on every rank of a group's queue, before
    anything is made), only where the policy's readers would read it."""
    monkeypatch.setenv(SPREAD_ENV, "sometimes")
    if raises:
        with pytest.raises(ValueError, match=SPREAD_ENV):
            MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=2, wait_policy=policy)
        return
    MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=2, wait_policy=policy).close()


@pytest.mark.parametrize("value", [1, None, "yes"], ids=["int", "None", "str"])
def test_the_policy_takes_only_a_bool(value: Any) -> None:
    with pytest.raises(TypeError, match="leave_shared_cpu"):
        PredictivePolicy(leave_shared_cpu=value)


# ------------------------------------------- busy CPUs, and a reader beside its writer
PERIOD_S = 0.02


def hog(cpu: int, go: Any, stop: Any, until: float, out: Any) -> None:
    """Once ``go`` is set, keep ``cpu`` busy until ``stop`` (a shared byte, read
    without a lock: the hogs never block on one) turns 1 or ``until``
    (monotonic) passes; niced to 19 so that other tests' processes keep nearly
    all of the CPU."""
    try:
        os.sched_setaffinity(0, {cpu})
        os.nice(19)
        out.put(("hogging", cpu))
        go.wait(60)
        while not stop.value and time.monotonic() < until:
            pass
    except BaseException:
        out.put(("error", -1, traceback.format_exc()))


@movable
@pytest.mark.timeout(60)
def test_no_move_while_every_cpu_is_busy(procs) -> None:
    """A spinning process on every CPU the thread may use: no CPU is likely
    free, and a hop after a shared wait moves nothing."""
    cpus = sorted(os.sched_getaffinity(0))
    go, stop = procs.ctx.Event(), procs.ctx.RawValue("b", 0)
    try:
        for cpu in cpus:
            procs.start(hog, cpu, go, stop, time.monotonic() + 30.0)
        assert {procs.get(timeout=30)[1] for _ in cpus} == set(cpus)
        go.set()
        time.sleep(0.05)  # the hogs are spinning

        def body() -> tuple[bool, int]:
            hop = CpuHop()
            hop.before_sleep(True)
            return free_cpu_likely(), hop.moves

        likely, moves = in_thread(body)
    finally:
        stop.value = 1
    assert likely is False and moves == 0


def stepped_reader(handle: Any, leave: bool, cpu: int, out: Any) -> None:
    """Start on ``cpu`` (free to run on any), then dequeue with a predictive
    policy that always polls its windows; at each ``"report"`` message report the
    counters and the affinity before and now, until ``"stop"``."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})  # runs on cpu now ...
        os.sched_setaffinity(0, before)  # ... and may run anywhere again
        policy = WaitPolicy(park_poll_s=1.0, liveness_s=1.0, predict=PredictivePolicy(
            min_samples=3, explore_every=0, leave_shared_cpu=leave))
        with MessageQueue.create_from_handle(handle, 1, wait_policy=policy) as mq:
            mq.wait_until_ready(60)
            while (got := mq.dequeue(timeout=30)) != "stop":
                if got == "report":
                    out.put(("ok", 1, mq.park_stats(), before, os.sched_getaffinity(0)))
    except BaseException:
        out.put(("error", 1, traceback.format_exc()))


def pinned_writer(mq: MessageQueue, cpu: int, n: int) -> None:
    """Enqueue ``n`` messages every PERIOD_S, then ``"report"``, from this thread
    pinned to ``cpu``."""
    os.sched_setaffinity(0, {cpu})
    t = time.monotonic()
    for i in range(n):
        delay = t + i * PERIOD_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        mq.enqueue(i, timeout=30)
    mq.enqueue("report", timeout=30)


@movable
@pytest.mark.timeout(120)
@pytest.mark.parametrize("leave", [True, False], ids=["leaves", "stays"])
def test_a_reader_beside_its_writer_moves_only_when_asked(procs, leave: bool) -> None:
    """The writer's thread is pinned to one CPU and the reader starts there, so
    its polls find the CPU taken by the writer (blocks of 40 steps until one
    did). After such a poll it moves, or finds no CPU free (a busy machine),
    when the policy says so, and never otherwise; its affinity ends as it
    began."""
    cpu = min(os.sched_getaffinity(0))
    mq = MessageQueue(1, 1, [1], max_chunk_bytes=4096, max_chunks=4, name="hop-beside")
    try:
        procs.start(stepped_reader, mq.export_handle(), leave, cpu)
        mq.wait_until_ready(60)
        for _ in range(6):
            in_thread(lambda: pinned_writer(mq, cpu, 40))
            _, _, stats, before, after = procs.get(timeout=60)
            if stats["contended"]:
                break
        mq.enqueue("stop", timeout=30)
    finally:
        mq.close()
    detail = str(stats)
    assert after == before, detail
    if not stats["contended"]:
        pytest.skip(f"no poll found the writer on the reader's CPU in 240 steps: {detail}")
    tried = stats["cpu_moves"] + stats["cpu_moves_no_free_cpu"]
    if leave:
        assert tried >= 1 and stats["cpu_moves"] <= stats["contended"], detail
    else:
        assert tried == 0, detail
