"""The flight recorder's ring, on its own: wrap-around, off, settings, threads, entries."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from coordinator.trace.recorder import (
    DONE,
    ERROR,
    FRAMES,
    IN_DTYPES,
    IN_SIZES,
    OP,
    OUT_DTYPES,
    OUT_SIZES,
    P2P_SEQ,
    PEER,
    RID,
    SEQ,
    TRANSPORT,
    FlightRecorder,
    GroupTrace,
    recorder,
    reset_recorder,
    shapes_of,
)


@pytest.fixture
def fresh_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The process's recorder read again from the environment; put back afterwards."""
    for var in ("GROUPCOORD_TRACE_BUFFER", "GROUPCOORD_TRACE_STACKS", "GROUPCOORD_TRACE_DUMP"):
        monkeypatch.delenv(var, raising=False)
    previous = reset_recorder()
    try:
        yield monkeypatch
    finally:
        reset_recorder(previous)


def _trace(rec: FlightRecorder) -> GroupTrace:
    trace = rec.group("tp:0", "tp", [4, 5], 1)
    assert trace is not None
    return trace


def test_the_ring_keeps_the_last_capacity_calls_oldest_first() -> None:
    rec = FlightRecorder(capacity=4)
    trace = _trace(rec)
    for i in range(10):
        trace.begin("all_reduce", i + 1, 0, torch.Size([i]), torch.float32)
    got = rec.entries()
    assert [e[RID] for e in got] == [6, 7, 8, 9]
    assert [e[SEQ] for e in got] == [7, 8, 9, 10]
    assert all(e[OP] == "all_reduce" and e[DONE] == 0 for e in got)


def test_an_entry_outliving_the_ring_is_updated_harmlessly() -> None:
    rec = FlightRecorder(capacity=2)
    trace = _trace(rec)
    old = trace.begin("send", 0, 1, peer=0)
    for i in range(3):
        trace.begin("barrier", i + 1, 1)
    GroupTrace.complete(old)  # no longer in the ring
    assert old not in rec.entries() and old[DONE] > 0


def test_a_recorder_of_capacity_0_records_nothing(fresh_env: pytest.MonkeyPatch) -> None:
    assert FlightRecorder(0).group("g:0", "g", [0], 0) is None
    fresh_env.setenv("GROUPCOORD_TRACE_BUFFER", "0")
    rec = recorder()
    assert not rec.enabled and rec.group("g:0", "g", [0], 0) is None


@pytest.mark.parametrize(("var", "value"), [
    ("GROUPCOORD_TRACE_BUFFER", "lots"), ("GROUPCOORD_TRACE_BUFFER", "-1"),
    ("GROUPCOORD_TRACE_STACKS", "maybe"),
])
def test_bad_settings_raise_naming_the_variable(fresh_env: pytest.MonkeyPatch, var: str,
                                                value: str) -> None:
    fresh_env.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        recorder()


def test_settings_are_read_when_the_recorder_is_made(fresh_env: pytest.MonkeyPatch,
                                                     tmp_path) -> None:
    fresh_env.setenv("GROUPCOORD_TRACE_BUFFER", "16")
    fresh_env.setenv("GROUPCOORD_TRACE_STACKS", "1")
    fresh_env.setenv("GROUPCOORD_TRACE_DUMP", str(tmp_path / "d_"))
    rec = recorder()
    assert (rec.capacity, rec.stacks, rec.dump_prefix) == (16, True, str(tmp_path / "d_"))
    assert recorder() is rec
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(capacity=-1)


def test_threads_never_share_a_record_id() -> None:
    rec = FlightRecorder(capacity=64)
    trace = _trace(rec)
    ids: list[list[int]] = [[] for _ in range(4)]

    def work(k: int) -> None:
        for i in range(500):
            ids[k].append(trace.begin("all_reduce", i, 0)[RID])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for part in ids for i in part]
    assert len(set(every)) == len(every) == 2000


def test_an_entry_keeps_shapes_and_dtypes_never_tensors() -> None:
    trace = _trace(FlightRecorder(capacity=8))
    t = torch.ones(2, 3, dtype=torch.float16)
    entry = trace.begin_tensor("all_gather", 3, 1, t)
    assert (entry[IN_SIZES], entry[IN_DTYPES], entry[SEQ], entry[P2P_SEQ]) == (
        torch.Size([2, 3]), torch.float16, 3, 1)
    entry[OUT_SIZES] = torch.Size([4, 3])
    assert not any(isinstance(x, torch.Tensor) for x in entry)
    odd = trace.begin_tensor("all_reduce", 4, 1, "not a tensor")  # the call's check says so
    assert (odd[IN_SIZES], odd[IN_DTYPES], odd[TRANSPORT], odd[PEER]) == (None, None, None, -1)


def test_complete_and_fail() -> None:
    trace = _trace(FlightRecorder(capacity=8))
    entry = trace.begin("reduce_scatter", 1, 0, torch.Size([8]), torch.float32)
    GroupTrace.complete(entry, torch.Size([4]), torch.float32)
    assert entry[DONE] > 0 and (entry[OUT_SIZES], entry[OUT_DTYPES]) == (
        torch.Size([4]), torch.float32)
    failed = trace.begin("barrier", 2, 0)
    GroupTrace.fail(failed, TimeoutError("first"))
    GroupTrace.fail(failed, KeyError("second"))
    assert failed[ERROR] == "TimeoutError"  # the first failure stands


def test_stacks_are_recorded_when_asked() -> None:
    trace = _trace(FlightRecorder(capacity=8, stacks=True))
    entry = trace.begin_tensor("all_reduce", 1, 0, torch.ones(1))
    frames = entry[FRAMES]
    assert frames and set(frames[-1]) == {"name", "filename", "line"}
    assert frames[-1]["name"] == "test_stacks_are_recorded_when_asked"
    assert _trace(FlightRecorder(capacity=8)).begin("barrier", 1, 0)[FRAMES] is None


def test_shapes_of() -> None:
    a, b = torch.ones(2, 3), torch.zeros(4, dtype=torch.int64)
    assert shapes_of(a) == (torch.Size([2, 3]), torch.float32)
    assert shapes_of([a, b]) == ([torch.Size([2, 3]), torch.Size([4])],
                                 [torch.float32, torch.int64])
    assert shapes_of(([a], [3, 4])) == ([torch.Size([2, 3])], [torch.float32])
    assert shapes_of({"x": a}) == (None, None)
    assert shapes_of(None) == (None, None)
    assert shapes_of([1, 2]) == (None, None)


def test_groups_are_listed_in_creation_order() -> None:
    rec = FlightRecorder(capacity=8)
    first, second = _trace(rec), rec.group("pp:0", "pp", [0, 4], 1)
    assert rec.groups() == [first, second] and (first.pg_id, second.pg_id) == (0, 1)  # type: ignore[union-attr]


def test_closed_groups_without_entries_are_forgotten() -> None:
    rec = FlightRecorder(capacity=4)
    first, second = _trace(rec), rec.group("pp:0", "pp", [0, 4], 1)
    assert second is not None
    first.begin("barrier", 1, 0)
    first.closed = second.closed = True
    assert rec.groups() == [first]  # still has an entry in the ring
    third = rec.group("dp:0", "dp", [0, 1], 0)
    assert third is not None and third.pg_id == 2  # ids are never reused
    for i in range(4):  # the ring forgets the closed group's call
        third.begin("barrier", i + 1, 0)
    fourth = rec.group("ep:0", "ep", [0, 1], 0)  # creation forgets it too
    assert rec.groups() == [third, fourth]
    for _ in range(100):  # bounded however many groups come and go
        g = rec.group("tmp:0", "tmp", [0], 0)
        assert g is not None
        g.closed = True
    assert len(rec.groups()) == 2


def test_start_only_keeps_the_start_of_an_unrecorded_call() -> None:
    from coordinator.calls.call_book import CallBook
    from coordinator.trace.recorder import CREATED, StartOnly

    rec = FlightRecorder(capacity=4)
    entry = StartOnly().begin_tensor("all_reduce", 3, 1, torch.ones(2))
    assert len(entry) == len(_trace(rec).begin("x", 0, 0)) and entry[CREATED] > 0
    assert rec.entries()[0][OP] == "x"  # it went into no ring
    # A peer closed its connections after most of the timeout: with the start
    # known, the call is the timeout the peer had, not a closed connection.
    from coordinator.errors import CommTimeout

    book = CallBook("g:0", 0, 2, timeout=1.0)  # the recorder is off: trace None
    entry[CREATED] -= 2 * 10**9
    with pytest.raises(CommTimeout, match="gave up waiting"):
        book.failed("all_reduce", 4, RuntimeError("Connection closed by peer [::1]:1"), entry)
