"""The watchdog of device calls, on CPU through a stand-in device communicator.

The stand-in (:class:`StandIn`) serves CPU tensors like a device: its
``all_reduce`` "enqueues" this rank's contribution in the job's store, and
the work completes when every rank's contribution is there; the call waits
for that (polling, as a host waits on a device stream, with no timeout of its
own), and its marks report started/completed from that condition. It is
registered in the pool ranks' registry and forced by name, as a transport is.

On four ranks with a 1.5 s group timeout, rank 2 skips an ``all_reduce``:
the others' call raises ``CommTimeout`` naming rank 2 within the timeout plus
a second, each of them dumped, and the group's next call raises
``BrokenCommunicator`` saying why. With ``GROUPCOORD_WATCHDOG_ABORT=0`` (and a
1 s timeout) rank 2 arrives late instead, once the others' watchdogs reported
it: they only dumped and logged, and the call completes. The watchdog thread,
the progress board and the bisection run alone in this process too; CUDA
marks run where a GPU is visible.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import stat
import threading
import time
from time import monotonic, monotonic_ns
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.trace import watchdog as wd
from coordinator.trace.progress import ProgressBoard, progress_key
from coordinator.trace.recorder import FlightRecorder, reset_recorder
from device_comms import DeviceCommunicator, ReduceOp
from shm_broadcast.errors import CommTimeout

TIMEOUT_S = 1.5
LATE_TIMEOUT_S = 1.0  # the late rank's scenario waits it out: a shorter one
NAME = "watchdog-standin"
_TOKEN = "GROUPCOORD_TEST_STANDIN_TOKEN"  # keys of one test run in the job's store
_SAFETY_S = 20.0  # the stand-in's work never waits longer (a failing test ends)


# ---------------------------------------------------------------------- the stand-in
class StandInMarks:
    """Started/completed of one stand-in call, set by the call as its work moves."""

    def __init__(self) -> None:
        self.started: int | None = None
        self.completed: int | None = None

    def finish(self) -> None:
        """The call returned or raised: its work ended (the stand-in's call waits
        for its work), also when it failed or never started."""
        if self.completed is None:
            self.completed = monotonic_ns()

    def started_ns(self) -> int | None:
        return self.started

    def completed_ns(self) -> int | None:
        return self.completed

    def replays(self) -> int | None:
        return None


class StandIn(DeviceCommunicator):
    """A device stand-in on CPU tensors (see the module docstring); all_reduce only."""

    name = NAME
    device_types = frozenset({"cpu"})
    priority = -1000  # never chosen by device: only by name
    provides_device_marks = True

    def __init__(self, cpu_group: Any, device: torch.device, device_group: Any = None,
                 unique_name: str = "", *, timeout: float | None = None) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, timeout=timeout)
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"standin/{os.environ[_TOKEN]}/{unique_name}"
        self.work = 0
        self.next_marks: StandInMarks | None = None
        self.stopped = threading.Event()

    def device_marks(self) -> StandInMarks:
        self.next_marks = StandInMarks()
        return self.next_marks

    def _all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        marks, self.next_marks = self.next_marks or StandInMarks(), None
        self.work += 1
        keys = [f"{self.prefix}/{self.work}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank_in_group], t.numpy().tobytes())  # enqueued
        marks.started = monotonic_ns()
        deadline = monotonic() + _SAFETY_S
        while not self.store.check(keys):  # the host waits for the "device"
            if self.stopped.is_set():
                raise RuntimeError("stand-in: the work was aborted")
            if monotonic() > deadline:
                raise RuntimeError(f"stand-in: no completion in {_SAFETY_S}s (test safety cap)")
            time.sleep(0.005)
        parts = [torch.frombuffer(bytearray(v), dtype=t.dtype).view(t.shape)
                 for v in self.store.multi_get(keys)]
        marks.completed = monotonic_ns()
        return torch.stack(parts).sum(0)

    def _abort(self) -> None:
        self.stopped.set()

    def _unsupported(self, *args: Any) -> Any:
        raise NotImplementedError("the stand-in serves all_reduce only")

    _all_gather = _all_gatherv = _reduce_scatter = _reduce_scatterv = _unsupported
    _gather = _reduce = _broadcast = _scatter = _all_to_all = _send = _recv = _unsupported


# ---------------------------------------------------------------------- on the ranks
def _group(rank: int, world_size: int, token: str, dump_dir: str,
           timeout: float = TIMEOUT_S) -> tuple[Any, Any]:
    from coordinator import GroupCoordinator
    from device_comms import register_device_communicator

    os.environ[_TOKEN] = token
    register_device_communicator(NAME, StandIn, override=True)
    old = reset_recorder(FlightRecorder(64, dump_prefix=os.path.join(dump_dir, "rank_")))
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="wd",
                         device_communicator=NAME, timeout=timeout)
    assert isinstance(g.comm, StandIn) and wd.watchdog().running
    return g, old


def _tear_down(g: Any, old: Any) -> dict[str, Any]:
    from coordinator.parallel_state import get_world_group
    from device_comms import unregister_device_communicator

    get_world_group().barrier(timeout=30)  # the late or skipping rank leaves with the others
    g.destroy()
    reset_recorder(old)
    unregister_device_communicator(NAME)
    os.environ.pop(_TOKEN, None)
    os.environ.pop(wd.ENV_ABORT, None)
    threads = [t.name for t in threading.enumerate() if t.name == "groupcoord-watchdog"]
    return {"running": wd.watchdog().running, "threads": threads}


def _read_dump(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = pickle.load(f)
    return {"mode": stat.S_IMODE(os.stat(path).st_mode), "reason": data["groupcoord"]["reason"],
            "entries": [(e["process_group"][0], e["collective_seq_id"], e["state"])
                        for e in data["entries"]]}


def stuck_call(rank: int, world_size: int, token: str, dump_dir: str) -> dict[str, Any]:
    """Rank 2 skips the second all_reduce; the others' watchdogs abort it."""
    from device_comms.errors import BrokenCommunicator

    g, old = _group(rank, world_size, token, dump_dir)
    out: dict[str, Any] = {}
    try:
        x = torch.ones(4)
        out["first"] = g.all_reduce(x).tolist()
        if rank != 2:
            t0 = monotonic()
            try:
                g.all_reduce(x)
            except CommTimeout as e:
                out["error"] = {"text": str(e), "peers": list(e.peers),
                                "elapsed": monotonic() - t0, "call": getattr(e, "call", None)}
            try:
                g.all_reduce(x)
            except BrokenCommunicator as e:
                out["next"] = {"text": str(e), "peers": list(e.peers)}
            path = os.path.join(dump_dir, f"rank_{rank}")
            out["dump"] = _read_dump(path) if os.path.exists(path) else None
            out["name"] = g.unique_name
    finally:
        out.update(_tear_down(g, old))
    return out


def late_rank(rank: int, world_size: int, token: str, dump_dir: str) -> dict[str, Any]:
    """Rank 2 comes to the second all_reduce only once the others' watchdogs reported
    it (they say so in the store); the watchdog only dumps and logs."""
    os.environ[wd.ENV_ABORT] = "0"
    store = dist.distributed_c10d._get_default_store()
    told = [f"standin/{token}/reported/{r}" for r in range(world_size) if r != 2]
    records: list[str] = []

    def seen(record: logging.LogRecord) -> None:
        records.append(record.getMessage())
        store.set(f"standin/{token}/reported/{rank}", b"1")

    handler = logging.Handler()
    handler.emit = seen  # type: ignore[method-assign]
    logger = logging.getLogger(wd.__name__)
    logger.addHandler(handler)
    g, old = _group(rank, world_size, token, dump_dir, LATE_TIMEOUT_S)
    out: dict[str, Any] = {}
    try:
        x = torch.ones(4)
        g.all_reduce(x)
        t0 = monotonic()
        if rank == 2:
            deadline = t0 + 10 * LATE_TIMEOUT_S
            while not store.check(told) and monotonic() < deadline:
                time.sleep(0.01)
        out["second"] = g.all_reduce(x).tolist()
        out["waited"] = monotonic() - t0
        out["third"] = g.all_reduce(x).tolist()  # the group is not broken
        out["broken"] = g.comm.broken
        path = os.path.join(dump_dir, f"rank_{rank}")
        out["dump"] = _read_dump(path) if os.path.exists(path) else None
    finally:
        logger.removeHandler(handler)
        out.update(_tear_down(g, old))
    out["logged"] = records
    return out


def abort_directly(rank: int, world_size: int, token: str, dump_dir: str) -> dict[str, Any]:
    """DeviceCommunicator.abort alone: argument check, first reason kept, what calls raise."""
    from device_comms.errors import BrokenCommunicator, CommunicatorClosed

    g, old = _group(rank, world_size, token, dump_dir)
    out: dict[str, Any] = {}
    comm = g.comm
    try:
        g.all_reduce(torch.ones(2))
        try:
            comm.abort("not an exception")  # type: ignore[arg-type]
        except TypeError as e:
            out["type_error"] = str(e)
        comm.abort(CommTimeout("first reason", peers=[3]))
        comm.abort(CommTimeout("second reason", peers=[1]))
        out["broken"] = str(comm.broken)
        out["closed_after_abort"] = comm.closed
        try:
            comm.all_reduce(torch.ones(2))
        except BrokenCommunicator as e:
            out["next"] = {"text": str(e), "peers": list(e.peers)}
    finally:
        out.update(_tear_down(g, old))
    out["closed"] = comm.closed
    try:
        comm.all_reduce(torch.ones(2))
    except CommunicatorClosed as e:
        out["after_destroy"] = type(e).__name__
    comm.abort(CommTimeout("after destroy"))  # nothing to break any more
    out["broken_after_destroy"] = str(comm.broken)
    return out


# ---------------------------------------------------------------------- the tests
def _run(dist_pool: Any, fn: Any, tmp_path: Any) -> list[dict[str, Any]]:
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    return dist_pool(4).run(fn, token, str(tmp_path), timeout=60)


@pytest.mark.timeout(90)
def test_abort_breaks_the_communicator_until_destroy(dist_pool: Any, tmp_path: Any) -> None:
    for r in _run(dist_pool, abort_directly, tmp_path):
        assert "error must be an exception" in r["type_error"], r
        assert r["broken"] == "first reason" and not r["closed_after_abort"], r
        assert "was aborted" in r["next"]["text"] and "first reason" in r["next"]["text"], r
        assert r["next"]["peers"] == [3]
        assert r["closed"] and r["after_destroy"] == "ClosedError", r
        assert r["broken_after_destroy"] == "first reason", r


@pytest.mark.timeout(90)
def test_stuck_call_raises_comm_timeout_naming_the_rank_behind(dist_pool: Any,
                                                               tmp_path: Any) -> None:
    results = _run(dist_pool, stuck_call, tmp_path)
    for rank, r in enumerate(results):
        assert r["first"] == [4.0] * 4, r
        assert not r["running"] and not r["threads"], r  # the thread stopped with the group
        if rank == 2:
            assert "error" not in r
            continue
        err = r["error"]
        assert err["peers"] == [2], err
        assert TIMEOUT_S <= err["elapsed"] <= TIMEOUT_S + 1.0, err["elapsed"]
        assert "rank(s) [2] have not reached collective #2" in err["text"], err["text"]
        assert "call #2" in err["text"] and "aborted" in err["text"], err["text"]
        assert err["call"] == 2
        nxt = r["next"]
        assert "was aborted" in nxt["text"] and "rank(s) [2]" in nxt["text"], nxt
        assert nxt["peers"] == [2]
        dump = r["dump"]
        assert dump is not None and dump["mode"] == 0o600, dump
        assert dump["reason"].startswith("watchdog: ") and "rank(s) [2]" in dump["reason"]
        stuck = [e for e in dump["entries"] if e[0] == r["name"] and e[1] == 2]
        assert stuck and all(state == "started" for _, _, state in stuck), dump["entries"]


@pytest.mark.timeout(90)
def test_without_abort_it_dumps_and_logs_and_the_call_completes(dist_pool: Any,
                                                                tmp_path: Any) -> None:
    results = _run(dist_pool, late_rank, tmp_path)
    for rank, r in enumerate(results):
        assert r["second"] == [4.0] * 4 and r["third"] == [4.0] * 4, r
        assert r["broken"] is None and not r["running"] and not r["threads"], r
        if rank == 2:
            assert r["dump"] is None and r["logged"] == [], r
            continue
        assert LATE_TIMEOUT_S <= r["waited"] <= LATE_TIMEOUT_S + 1.0, r["waited"]
        assert len(r["logged"]) == 1, r["logged"]  # reported once
        text = r["logged"][0]
        assert "rank(s) [2] have not reached collective #2" in text, text
        assert "aborted" not in text, text
        assert r["dump"] is not None and "rank(s) [2]" in r["dump"]["reason"], r["dump"]


# ---------------------------------------------------------------------- the parts alone
class _Done:
    """Marks completed from the start (the watchdog counts its queries)."""

    def __init__(self, done: bool, asked: list[int]) -> None:
        self.done, self.asked = done, asked

    def completed_ns(self) -> int | None:
        self.asked.append(1)
        return 1 if self.done else None


class _Counts:
    collectives = 0
    p2p_calls = 0


def test_settle_drops_the_completed_calls_by_bisection() -> None:
    asked: list[int] = []
    pending: collections.deque[wd.Pending] = collections.deque()
    for i in range(1000):
        pending.append(wd.Pending(i + 1, i + 1, 0, _Done(i < 700, asked)))
    oldest = wd._settle(pending)
    assert oldest is not None and oldest.seq == 701 and len(pending) == 300
    assert len(asked) <= 12  # log2(1000) + the newest
    for p in pending:
        p.marks.done = True
    assert wd._settle(pending) is None and not pending


def test_behind_names_who_has_not_issued_the_call() -> None:
    assert wd._behind(5, 0, [(5, 4), (5, 4), (4, 4), (5, 4)])[0] == [2]
    assert wd._behind(5, 0, [(5, 4), None, (5, 4)])[0] == [1]
    names, why = wd._behind(5, 1, [(5, 5), (5, 4), (5, 4)])
    assert names == [2] and "every rank issued collective #5" in why


def test_progress_board_throttles_writes_and_reads_what_it_can() -> None:
    store = dist.HashStore()
    board = ProgressBoard(store, interval_s=10.0)
    key = progress_key("7", 0)
    assert board.publish(key, 1, 0, now_ns=0)
    assert not board.publish(key, 1, 0, now_ns=20 * 10**9)  # unchanged: no write
    assert not board.publish(key, 2, 1, now_ns=10**9)  # changed, but too soon
    assert board.publish(key, 2, 1, now_ns=11 * 10**9)
    store.set(progress_key("7", 2), b"garbage")
    assert board.read([key, progress_key("7", 1), progress_key("7", 2)]) == [(2, 1), None, None]
    board.forget(key)
    assert board.read([key]) == [None]


class _Comm:
    provides_device_marks = False

    def __init__(self) -> None:
        self.aborted: list[BaseException] = []

    def device_marks(self) -> None:
        return None

    def abort(self, error: BaseException) -> None:
        self.aborted.append(error)


def test_thread_fires_once_aborts_and_stops_with_the_last_group(tmp_path: Any) -> None:
    old = reset_recorder(FlightRecorder(8, dump_prefix=str(tmp_path / "rank_")))
    dog = wd.Watchdog()
    counts = _Counts()
    comm, idle = _Comm(), _Comm()
    asked: list[int] = []
    try:
        log = wd.MarkLog(lambda: _Done(False, asked), counts)
        stuck = wd.GroupWatch(dog, "stuck:0", [0, 1, 2], 0, 0.2, comm, "x", counts, log, True)
        other = wd.GroupWatch(dog, "idle:0", [0, 1], 1, 5.0, idle, "y", counts,
                              wd.MarkLog(lambda: _Done(True, asked), counts), True)
        dog.add(stuck)
        dog.add(other)
        counts.collectives = 3
        log()  # collective #3 is issued and never completes
        deadline = monotonic() + 5.0
        while not comm.aborted and monotonic() < deadline:
            time.sleep(0.02)
        assert len(comm.aborted) == 1 and not idle.aborted
        err = comm.aborted[0]
        assert isinstance(err, CommTimeout) and list(err.peers) == [1, 2]  # nobody published
        assert "group 'stuck:0' (rank 0 of 3)" in str(err) and "collective #3" in str(err)
        assert "published no progress" in str(err) and os.path.exists(tmp_path / "rank_0")
        time.sleep(0.3)
        assert len(comm.aborted) == 1  # aborted groups are not watched any more
        stuck.close()
        assert dog.running
        other.close()
        assert not dog.running
        other.close()  # idempotent
    finally:
        reset_recorder(old)
    assert not [t for t in threading.enumerate() if t.name == "groupcoord-watchdog"]


# ---------------------------------------------------------------------- review fixes
def test_two_threads_drain_the_removed_keys_once_each() -> None:
    store = dist.HashStore()
    board = ProgressBoard(store)
    dog = wd.Watchdog()
    keys = [progress_key("9", r) for r in range(2000)]
    for k in keys:
        store.set(k, b"1 1")
    dog._gone.extend(keys)
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            dog._forget_gone(board)
        except BaseException as e:  # an IndexError when both saw one key left
            errors.append(e)

    threads = [threading.Thread(target=drain) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not dog._gone and store.num_keys() == 0
    dog._gone.extend(keys)
    dog._forget_gone(None)  # no store: nothing is published, nothing kept
    assert not dog._gone


def test_a_key_removed_as_the_thread_stops_is_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    monkeypatch.setattr(ProgressBoard, "of_default_store",
                        classmethod(lambda cls, timeout_s=2.0: cls(store)))
    dog = wd.Watchdog()
    counts = _Counts()
    watch = wd.GroupWatch(dog, "gone:0", [0, 1], 0, 5.0, _Comm(), "z", counts,
                          wd.MarkLog(lambda: _Done(True, []), counts), True)
    dog.add(watch)
    deadline = monotonic() + 5.0
    while not store.check([watch.keys[0]]) and monotonic() < deadline:
        time.sleep(0.01)  # the thread published this rank's progress
    assert store.check([watch.keys[0]])
    watch.close()  # the last group: the thread stops, after deleting the key
    assert not dog.running and not store.check([watch.keys[0]]) and not dog._gone


class _AbortTimesOut(_Comm):
    def abort(self, error: BaseException) -> None:
        super().abort(error)
        raise CommTimeout("releasing the NCCL communicator did not finish within 10s")


def test_an_abort_that_times_out_still_counts_as_aborted(tmp_path: Any) -> None:
    old = reset_recorder(FlightRecorder(8, dump_prefix=str(tmp_path / "rank_")))
    try:
        dog, counts, comm = wd.Watchdog(), _Counts(), _AbortTimesOut()
        watch = wd.GroupWatch(dog, "nccl:0", [0, 1], 0, 0.1, comm, "n", counts,
                              wd.MarkLog(lambda: _Done(False, []), counts), True)
        assert dog._fire(watch, wd.Pending(1, 1, 0, _Done(False, [])), None) is True
        notes = getattr(comm.aborted[0], "__notes__", [])
        assert any("the abort did not finish (CommTimeout" in n for n in notes), notes
    finally:
        reset_recorder(old)


@pytest.mark.parametrize("var", [wd.ENV_WATCHDOG, wd.ENV_ABORT])
def test_bad_watchdog_settings_raise_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                         var: str) -> None:
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ValueError, match=var):
        wd.settings_from_env()
    monkeypatch.setenv(var, "0")
    assert wd.settings_from_env() == (var != wd.ENV_WATCHDOG, var != wd.ENV_ABORT)


def test_a_busy_counter_read_reports_unknown_at_once() -> None:
    from coordinator.trace.cuda_marks import CudaMarker

    marker = CudaMarker(torch.device("cuda", 0), count_replays=False)  # touches no GPU
    assert marker._counters is None and marker.counts() is None
    marker._counters = torch.zeros(4, dtype=torch.int64)  # a block, and a read in progress
    with marker._lock:
        t0 = monotonic()
        assert marker.counts() is None and monotonic() - t0 < 0.01  # as a signal's dump


def bad_settings_leave_nothing(rank: int, world_size: int) -> list[tuple[str, str, bool]]:
    """A bad setting raises before the group makes a process group."""
    from torch.distributed import distributed_c10d as c10d

    from coordinator import GroupCoordinator

    out = []
    for var, value in ((wd.ENV_WATCHDOG, "maybe"), (wd.ENV_ABORT, "2"),
                       ("GROUPCOORD_TRACE_SIGNAL", "SIGKILL")):
        before = len(c10d._world.pg_map)
        os.environ[var] = value
        try:
            GroupCoordinator([[0]], rank, "gloo", True, group_name="bad-env")
            out.append((var, "created", False))
        except ValueError as e:
            out.append((var, str(e), len(c10d._world.pg_map) == before))
        finally:
            os.environ.pop(var)
    return out


def test_a_bad_setting_raises_before_the_group_makes_anything(dist_pool: Any) -> None:
    for var, text, nothing_made in dist_pool(1).run(bad_settings_leave_nothing, timeout=30)[0]:
        assert var in text and nothing_made, (var, text)


def marks_by_setting(rank: int, world_size: int, token: str, dump_dir: str
                     ) -> list[tuple[bool, str, bool]]:
    """Whether the group marks its device calls, what its calls record, whether it is
    watched: recorder on/off x watchdog on/off."""
    from coordinator import GroupCoordinator
    from device_comms import register_device_communicator, unregister_device_communicator

    os.environ[_TOKEN] = token
    register_device_communicator(NAME, StandIn, override=True)
    out = []
    try:
        for capacity, watch in ((64, "1"), (0, "1"), (64, "0"), (0, "0")):
            os.environ[wd.ENV_WATCHDOG] = watch
            old = reset_recorder(FlightRecorder(capacity, dump_prefix=dump_dir + "/rank_"))
            g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                 group_name="marks", device_communicator=NAME)
            try:
                g.all_reduce(torch.ones(2))
                out.append((g._marks is not None, type(g._trace).__name__,
                            g._watch is not None))
            finally:
                g.destroy()
                reset_recorder(old)
    finally:
        os.environ.pop(wd.ENV_WATCHDOG, None)
        unregister_device_communicator(NAME)
        os.environ.pop(_TOKEN, None)
    return out


@pytest.mark.timeout(60)
def test_calls_are_marked_only_for_the_recorder_or_the_watchdog(dist_pool: Any,
                                                                tmp_path: Any) -> None:
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    for got in dist_pool(2).run(marks_by_setting, token, str(tmp_path), timeout=45):
        assert got == [(True, "GroupTrace", True), (True, "StartOnly", True),
                       (True, "GroupTrace", False), (False, "NoneType", False)], got
