"""Dumps: plain data only, owner-only files replaced atomically, PyTorch's fields (its own
analyzer parses every entry), the transports named, and the dumps a failed call writes."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import stat
import threading
from typing import Any

import pytest
import torch
from torch.distributed.flight_recorder.components.types import Op

from coordinator import dump_trace
from coordinator.errors import CollectiveMismatch, CommTimeout
from coordinator.trace import auto_dump
from coordinator.trace.dump import ANALYZER_TYPES, OPS, snapshot, write_dump
from coordinator.trace.recorder import (
    DEVICE,
    DIM,
    DONE,
    IN_DTYPES,
    IN_SIZES,
    OUT_SIZES,
    TRANSPORT,
    FlightRecorder,
    GroupTrace,
    reset_recorder,
    shapes_of,
)
from coordinator.trace.transports import TransportNamer

#: The fields of an entry in PyTorch's dump (version 2.10).
_FR_FIELDS = {
    "record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
    "profiling_name", "time_created_ns", "duration_ms", "is_p2p", "input_sizes",
    "input_dtypes", "output_sizes", "output_dtypes", "state", "time_discovered_started_ns",
    "time_discovered_completed_ns", "retired", "timeout_ms", "frames", "thread_id",
    "thread_name",
}


class _PlainOnly(pickle.Unpickler):
    """Loads builtins only: any class reference in the pickle raises."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the dump references {module}.{name}")


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data: dict[str, Any] = _PlainOnly(io.BytesIO(f.read())).load()
    return data


def _recorder(tmp_path: Any) -> FlightRecorder:
    """A recorder holding one call of every kind of state and shape."""
    rec = FlightRecorder(capacity=64, stacks=True, dump_prefix=str(tmp_path / "rank_"))
    names = {"all_reduce": "shm", "send": "gloo"}
    trace = rec.group("tp:0", "tp", [2, 3], 0, lambda op, entry: names.get(op, "gloo"),
                      timeout=12.5)
    assert trace is not None
    GroupTrace.complete(trace.begin_tensor("all_reduce", 1, 0, torch.ones(4)))
    gather = trace.begin_tensor("all_gather", 2, 0, torch.ones(2, 3, dtype=torch.bfloat16))
    gather[OUT_SIZES] = torch.Size([4, 3])
    gather[DONE] = gather[10] + 1000
    GroupTrace.complete(trace.begin("all_gatherv_rows", 3, 0, [torch.Size([1, 2])],
                                    [torch.int64]), [torch.Size([3, 2])], [torch.int64])
    obj = trace.begin("broadcast_object", 4, 0)
    obj[TRANSPORT] = "queue"
    GroupTrace.complete(obj)
    GroupTrace.complete(trace.begin_tensor("send", 4, 1, torch.ones(5), peer=1))
    recv = trace.begin("recv", 4, 2, peer=1)
    GroupTrace.complete(recv, torch.Size([5]), torch.float32)
    GroupTrace.fail(trace.begin_tensor("all_reduce", 5, 2, torch.ones(4)),
                    CommTimeout("late"))
    trace.begin("barrier", 6, 2)  # still running
    return rec


def test_a_dump_holds_plain_data_only_and_is_owner_only(tmp_path) -> None:
    rec = _recorder(tmp_path)
    path = write_dump(rec, rank=3)
    assert path == str(tmp_path / "rank_3")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    dump = _load(path)  # no class is needed to read it back
    assert dump["version"] == "2.10"
    assert dump["pg_config"] == {"tp:0": {"name": "tp:0", "desc": "tp", "ranks": "[2, 3]"}}
    assert dump["pg_status"]["0"] == {"last_enqueued_collective": 6,
                                      "last_started_collective": 6,
                                      "last_completed_collective": 4}
    assert dump["groupcoord"]["rank"] == 3 and dump["groupcoord"]["pid"] == os.getpid()
    for e in dump["entries"]:
        assert set(e) >= _FR_FIELDS, sorted(_FR_FIELDS - set(e))


def test_ids_timeout_and_thread_are_pytorchs(tmp_path) -> None:
    """``op_id`` counts every call of the group (PyTorch bumps it for collectives and
    point-to-point calls alike), ``timeout_ms`` is the group's, the thread is the
    caller's, and ``pg_status`` is keyed by ``pg_id`` as a string."""
    rec = _recorder(tmp_path)
    other = rec.group("pp:0", "pp", [0, 1], 1)  # no timeout known
    assert other is not None

    def call_from_a_thread() -> None:
        GroupTrace.complete(other.begin("send", 0, 1, peer=0))

    worker = threading.Thread(target=call_from_a_thread, name="fr-worker")
    worker.start()
    worker.join()
    dump = snapshot(rec, rank=2)
    tp = [e for e in dump["entries"] if e["process_group"][0] == "tp:0"]
    assert [e["op_id"] for e in tp] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {e["timeout_ms"] for e in tp} == {12500}
    assert {(e["thread_id"], e["thread_name"]) for e in tp} == {
        (str(threading.get_ident()), threading.current_thread().name)}
    (send,) = [e for e in dump["entries"] if e["process_group"][0] == "pp:0"]
    assert (send["op_id"], send["timeout_ms"], send["pg_id"]) == (1, None, 1)
    assert send["thread_id"] == str(worker.ident)
    assert send["thread_name"] == ""  # the thread has ended: its name is no longer known
    assert dump["pg_status"]["1"] == {"last_enqueued_collective": -1,
                                      "last_started_collective": -1,
                                      "last_completed_collective": -1}


def test_each_entry_reads_as_pytorch_writes_it(tmp_path) -> None:
    entries = snapshot(_recorder(tmp_path), rank=2)["entries"]
    by_op = {}
    for e in entries:
        by_op.setdefault(e["op"], []).append(e)
    reduce_ok, reduce_failed = by_op["all_reduce"]
    assert (reduce_ok["profiling_name"], reduce_ok["transport"], reduce_ok["state"]) == (
        "nccl:all_reduce", "shm", "completed")
    assert reduce_ok["input_sizes"] == reduce_ok["output_sizes"] == [[4]]
    assert reduce_ok["input_dtypes"] == reduce_ok["output_dtypes"] == ["Float"]
    assert (reduce_failed["state"], reduce_failed["error"]) == ("failed", "CommTimeout")
    gather = by_op["all_gather"][0]
    assert (gather["input_sizes"], gather["output_sizes"]) == ([[2, 3]], [[4, 3]])
    assert gather["output_dtypes"] == ["BFloat16"] and gather["duration_ms"] == 0.001
    rows = by_op["all_gatherv_rows"][0]  # the per-rank dimension is not compared
    assert (rows["input_sizes"], rows["true_input_sizes"]) == ([[-1, 2]], [[1, 2]])
    obj = by_op["broadcast_object"][0]
    assert (obj["transport"], obj["input_sizes"], obj["profiling_name"]) == (
        "queue", [], "nccl:broadcast")
    send, recv = by_op["send"][0], by_op["recv"][0]
    assert (send["profiling_name"], send["is_p2p"], send["peer"]) == ("nccl:send 0->1", True, 1)
    assert (recv["profiling_name"], recv["input_sizes"]) == ("nccl:recv 0<-1", [[5]])
    assert by_op["barrier"][0]["state"] == "started"
    memberships = {"tp:0": {2, 3}}
    for e in entries:  # PyTorch's analyzer parses each one
        op = Op(e, memberships, "tp:0")
        assert op.type == OPS[e["op"]][0]


#: The op types of an analyzer from before the list grew: the types PyTorch's
#: NCCL backend has long written, and P2P (torch 2.11's analyzer was seen to refuse
#: ``barrier`` and ``all_gather_v``; its whole list was not read).
_OLDEST_TYPES = frozenset({
    "broadcast", "_broadcast_oop", "reduce", "_reduce_oop", "all_gather", "all_reduce",
    "_all_gather_base", "all_gather_into_tensor_coalesced", "reduce_scatter",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "gather", "scatter",
    "all_to_all", "all_reduce_barrier", "allreduce_coalesced", "ALLGATHER_coalesced",
    "REDUCE_SCATTER_coalesced", "send", "recv"})


@pytest.fixture(params=["installed", "oldest"])
def allowlist(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """PyTorch's analyzer with the op types it ships, or cut to the older list."""
    from torch.distributed.flight_recorder.components import types

    if request.param == "oldest":
        monkeypatch.setattr(types, "COLLECTIVES", _OLDEST_TYPES - types.P2P)
    return str(request.param)


def _pytorch_report(directory: Any, caplog: pytest.LogCaptureFixture) -> str:
    """What PyTorch's analyzer reports (through logging) on the dumps in ``directory``."""
    from torch.distributed.flight_recorder.fr_trace import main

    with caplog.at_level(logging.INFO):
        main([str(directory)])
    return caplog.text


def test_every_op_type_is_one_every_analyzer_lists() -> None:
    from torch.distributed.flight_recorder.components import types

    written = {fr_type for fr_type, *_ in OPS.values()}
    assert written <= ANALYZER_TYPES <= _OLDEST_TYPES
    assert ANALYZER_TYPES <= types.COLLECTIVES | types.P2P  # the installed analyzer's too


def _write_ranks(directory: Any, calls: Any, n: int = 2) -> None:
    """``n`` ranks' dumps of the ``calls(rank)`` each rank makes: ``(op, input size,
    output size or None while it runs, dim or None)``."""
    f32 = torch.float32
    for rank in range(n):
        rec = FlightRecorder(capacity=32, dump_prefix=str(directory / "rank_"))
        trace = rec.group("ep:0", "ep", list(range(n)), rank)
        assert trace is not None
        for seq, (op, size, out, dim) in enumerate(calls(rank), start=1):
            if size is None:  # no tensors
                GroupTrace.complete(trace.begin(op, seq, 0))
                continue
            if op in ("dispatch", "all_gatherv_rows") and not isinstance(size, list):
                size, out = [size], [out] if isinstance(out, torch.Size) else out
            kinds = [f32] * len(size) if isinstance(size, list) else f32
            entry = trace.begin(op, seq, 0, size, kinds)
            entry[DIM] = dim
            if out == "same":  # completed with the input's shape: no output recorded
                GroupTrace.complete(entry)
            elif out is not None:
                GroupTrace.complete(entry, out, kinds)
        write_dump(rec, rank=rank)


def _agreeing(rank: int) -> list[tuple[str, Any, Any, Any]]:
    """One step of calls that agree, the variable-size ones along several dims."""
    h, S = 4, torch.Size
    mine, total = S([rank + 1, h]), S([3, h])
    return [("all_gatherv", mine, total, None),
            ("reduce_scatterv", total, mine, 0),
            ("dispatch", mine, total, None),
            ("combine", total, mine, None),
            ("all_to_allv", mine, S([2 - rank, h]), None),
            ("all_gatherv_rows", mine, total, None),
            ("all_gatherv", S([h, rank + 1]), S([h, 3]), 1),  # along the last dimension
            ("reduce_scatterv", S([2, h, 3]), S([2, h, rank + 1]), -1),
            ("dispatch", [mine, S([rank + 1, 2 * h]), S([rank + 1])],  # several tensors
             [total, S([3, 2 * h]), S([3])], None),
            ("all_gatherv", [S([h, rank + 1]), S([rank + 1])], [S([h, 3]), S([3])], -1),
            ("barrier", None, None, None),
            ("all_reduce", S([h]), S([h]), None)]


def test_variable_size_calls_and_barriers_read_clean_in_pytorchs_analyzer(
        tmp_path, caplog, allowlist: str) -> None:
    """Every entry parses and the step reads without an error, with the installed
    analyzer's op types and with the older, shorter list."""
    from coordinator.trace import analysis

    _write_ranks(tmp_path, _agreeing)
    memberships = {"ep:0": {0, 1}}
    for rank in range(2):
        for e in _load(str(tmp_path / f"rank_{rank}"))["entries"]:
            assert e["profiling_name"].startswith("nccl:"), e
            assert Op(e, memberships, "ep:0").type == OPS[e["op"]][0]
    report = _pytorch_report(tmp_path, caplog)
    assert "has errors" not in report and "Culprit" not in report, report
    result = analysis.analyze(str(tmp_path))
    assert result["ok"], result
    (group,) = result["groups"]
    assert group["first_mismatch"] is None, group


_S = torch.Size
#: Variable-size calls that disagree between two ranks: rank r's call.
_DISAGREEING: dict[str, Any] = {
    "other-columns": lambda r: ("all_gatherv", _S([r + 1, 4 * (r + 1)]),
                                _S([3, 4 * (r + 1)]), None),
    "other-op": lambda r: (("all_gatherv", _S([r + 1, 4]), _S([3, 4]), None) if r == 0
                           else ("reduce_scatterv", _S([3, 4]), _S([r + 1, 4]), None)),
    "other-dim-columns": lambda r: ("reduce_scatterv", _S([4 + r, 3]), _S([4 + r, r + 1]), -1),
}


@pytest.mark.parametrize("case", sorted(_DISAGREEING))
def test_pytorchs_analyzer_still_finds_a_variable_size_call_that_disagrees(
        tmp_path, caplog, allowlist: str, case: str) -> None:
    from coordinator.trace import analysis

    _write_ranks(tmp_path, lambda r: [_DISAGREEING[case](r)])
    report = _pytorch_report(tmp_path, caplog)
    assert "Collective sequence number: 1 has errors" in report, report
    (group,) = analysis.analyze(str(tmp_path))["groups"]
    assert group["first_mismatch"] is not None and group["first_mismatch"]["seq"] == 1


@pytest.mark.parametrize("case", ["gathered-rows", "reduced-rows"])
def test_groupcoord_trace_compares_the_rows_that_do_not_vary(tmp_path, case: str) -> None:
    """A variable-size call whose rows on the side that may not vary differ between
    ranks is a mismatch for ``groupcoord trace``."""
    from coordinator.trace import analysis

    if case == "gathered-rows":  # each rank gathers another total
        def calls(r: int) -> Any:
            return [("all_gatherv", _S([r + 1, 4]), _S([3 + r, 4]), None)]
    else:  # each rank scatters from another total
        def calls(r: int) -> Any:
            return [("reduce_scatterv", _S([3 + r, 4]), _S([r + 1, 4]), None)]
    _write_ranks(tmp_path, calls)
    (group,) = analysis.analyze(str(tmp_path))["groups"]
    mismatch = group["first_mismatch"]
    assert mismatch is not None and mismatch["seq"] == 1 and mismatch["tie"], group


@pytest.mark.parametrize("op", ["all_gatherv", "dispatch", "all_gatherv_rows",
                                "reduce_scatterv"])
@pytest.mark.parametrize("running", ["all", "one"])
def test_a_variable_size_call_in_flight_is_no_mismatch(tmp_path, op: str,
                                                       running: str) -> None:
    """Stuck in the call (no output yet, what a watchdog dump holds) on every rank
    or on one while the other completed: nothing disagrees."""
    from coordinator.trace import analysis

    def calls(r: int) -> Any:
        mine = _S([r + 1, 4])
        if op == "reduce_scatterv":
            return [(op, _S([3, 4]), None if running == "all" or r == 1 else mine, None)]
        return [(op, mine, None if running == "all" or r == 1 else _S([3, 4]), None)]

    _write_ranks(tmp_path, calls)
    entry = _load(str(tmp_path / "rank_1"))["entries"][0]
    assert entry["true_output_sizes"] is None and entry["state"] == "started", entry
    (group,) = analysis.analyze(str(tmp_path))["groups"]
    assert group["first_mismatch"] is None, group


@pytest.mark.parametrize("op", ["all_gatherv", "all_gatherv_rows"])
def test_a_gather_of_nothing_from_the_peers_is_no_mismatch(tmp_path, caplog, op: str) -> None:
    """The peers sent 0 rows: rank 0's output has its input's shape (no output
    size is recorded then), yet the call completed and agrees."""
    from coordinator.trace import analysis

    _write_ranks(tmp_path, lambda r: [(op, _S([3 if r == 0 else 0, 4]),
                                       "same" if r == 0 else _S([3, 4]), None)])
    entry = _load(str(tmp_path / "rank_0"))["entries"][0]
    assert entry["true_output_sizes"] == [[3, 4]] and entry["state"] == "completed", entry
    (group,) = analysis.analyze(str(tmp_path))["groups"]
    assert group["first_mismatch"] is None, group
    report = _pytorch_report(tmp_path, caplog)
    assert "has errors" not in report, report


def test_a_dump_replaces_the_file_atomically_and_never_follows_a_link(tmp_path) -> None:
    rec = _recorder(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    path = tmp_path / "rank_0"
    path.symlink_to(target)
    write_dump(rec, rank=0)
    write_dump(rec, rank=0)
    assert not path.is_symlink() and target.read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "rank_0"]  # no temporary left


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o755, 0o704],
                         ids=["world-writable", "group-writable", "readable", "other-readable"])
def test_the_default_directory_must_be_private(tmp_path, monkeypatch, mode: int) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("GROUPCOORD_TRACE_DUMP", raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    from coordinator.trace.recorder import default_dump_prefix

    prefix = default_dump_prefix()
    assert prefix == str(tmp_path / f"groupcoord-trace-{os.geteuid()}" / "rank_")
    rec = FlightRecorder(8)
    path = write_dump(rec, rank=3)
    assert path == prefix + "3"
    directory = os.path.dirname(prefix)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    os.chmod(directory, mode)  # as someone preparing the directory for the dumps would
    with pytest.raises(PermissionError, match="GROUPCOORD_TRACE_DUMP"):
        write_dump(rec, rank=3)


def test_dump_trace_writes_the_process_recorder(tmp_path) -> None:
    previous = reset_recorder(_recorder(tmp_path))
    try:
        path = dump_trace(str(tmp_path / "mine"))
        assert _load(path)["groupcoord"]["reason"].startswith("on demand")
        with pytest.raises(TypeError, match="path"):
            dump_trace(7)  # type: ignore[arg-type]
    finally:
        reset_recorder(previous)


def test_a_failed_call_dumps_once_per_error(tmp_path, caplog) -> None:
    rec = _recorder(tmp_path)
    trace = rec.groups()[0]
    err = CollectiveMismatch("peers called all_gather")
    path = auto_dump.dump_for_error(trace, "all_reduce", 7, err)
    assert path == str(tmp_path / f"rank_{_rank()}")
    assert err.trace_dump == path and path in err.__notes__[-1]  # type: ignore[attr-defined]
    assert "op all_reduce, call #7: CollectiveMismatch" in _load(path)["groupcoord"]["reason"]
    os.unlink(path)
    assert auto_dump.dump_for_error(trace, "all_reduce", 7, err) is None  # the same error
    try:
        raise CommTimeout("explained") from err
    except CommTimeout as wrapped:  # the same failure, passed up
        assert auto_dump.dump_for_error(trace, "dispatch", 8, wrapped) is None
    assert auto_dump.dump_for_error(trace, "all_reduce", 9, ValueError("bad dim")) is None
    assert not os.path.exists(path)

    (tmp_path / "file").write_bytes(b"")
    broken = FlightRecorder(capacity=4, dump_prefix=str(tmp_path / "file" / "rank_"))
    other = broken.group("g:0", "g", [0], 0)
    assert other is not None
    with caplog.at_level(logging.WARNING, logger="coordinator.trace.auto_dump"):
        assert auto_dump.dump_for_error(other, "barrier", 1, CommTimeout("t")) is None
    assert "could not write the dump" in caplog.text


def _rank() -> int:
    from coordinator.trace.dump import global_rank

    return global_rank()


class _Comm:
    """Public facts of a communicator, as the namer reads them."""

    def __init__(self, name: str, mode: str = "", custom_ar: Any = None) -> None:
        self.name, self.mode, self.custom_ar = name, mode, custom_ar
        self.device_group = None


class _CustomAr:
    max_size = 1024


def _entry(op: str, size: Any = None, dtype: Any = None, peer: int = -1) -> list[Any]:
    trace = FlightRecorder(capacity=4).group("g:0", "g", [0, 1], 0)
    assert trace is not None
    return trace.begin(op, 1, 0, size, dtype, peer)


@pytest.mark.parametrize(("comm", "op", "want"), [
    (_Comm("cpu", "shm"), "all_reduce", "shm"),
    (_Comm("cpu", "shm"), "scatter", "gloo"),
    (_Comm("cpu", "shm"), "broadcast_object", "shm"),
    (_Comm("cpu", "shm"), "barrier", "gloo"),
    (_Comm("cpu", "shm"), "send_object", "gloo"),
    (_Comm("cpu", "hierarchical"), "all_reduce", "hierarchical"),
    (_Comm("cpu", "hierarchical"), "all_gather", "gloo"),
    (_Comm("cpu", "gloo"), "all_reduce", "gloo"),
    (_Comm("torch"), "all_reduce", "gloo"),
    (_Comm("other"), "all_reduce", "torch"),
])
def test_transports_on_cpu(comm: _Comm, op: str, want: str) -> None:
    namer = TransportNamer(comm, torch.device("cpu"))
    assert namer(op, _entry(op, torch.Size([4]), torch.float32)) == want


def test_point_to_point_takes_the_link_it_settled_on() -> None:
    namer = TransportNamer(_Comm("cpu", "shm"), torch.device("cpu"),
                           lambda op, peer: peer == 1)
    assert namer("send", _entry("send", peer=1)) == "shm"
    assert namer("irecv_tensor_dict", _entry("irecv_tensor_dict", peer=2)) == "gloo"


def test_transports_of_a_cuda_group() -> None:
    namer = TransportNamer(_Comm("cuda", custom_ar=_CustomAr()), torch.device("cuda", 0))
    small, big = torch.Size([64]), torch.Size([4096])
    assert namer("all_reduce", _entry("all_reduce", small, torch.float16)) == "custom_allreduce"
    assert namer("all_reduce", _entry("all_reduce", big, torch.float16)) == "pynccl"
    assert namer("all_reduce", _entry("all_reduce", small, torch.int64)) == "pynccl"
    assert namer("all_to_all", _entry("all_to_all", small, torch.float16)) == "torch"
    assert namer("broadcast_object", _entry("broadcast_object")) == "gloo"
    entry = _entry("all_gather", small, torch.float16)
    assert entry[IN_SIZES] == small and entry[IN_DTYPES] is torch.float16
    assert namer("all_gather", entry) == "pynccl"


def record_a_step(rank: int, world_size: int, capacity: int) -> dict[str, Any]:
    """A mix of a group's calls on 2 ranks; the snapshot of what they recorded."""
    from coordinator import GroupCoordinator

    rec = FlightRecorder(capacity=capacity)
    previous = reset_recorder(rec)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="wired", timeout=42)
    try:
        other = 1 - rank
        g.all_reduce(torch.ones(4))
        g.all_gather(torch.ones(2, 3), dim=0)
        g.gather(torch.ones(3), dst=0)
        g.all_gatherv_rows([torch.ones(rank + 1, 2)])
        g.broadcast_tensor_dict({"x": torch.ones(2)} if rank == 0 else None)
        if rank == 0:
            g.send(torch.ones(5), 1)
            g.send_tensor_dict({"y": torch.ones(3)})
            g.isend(torch.ones(6), other).wait()
        else:
            g.recv(torch.Size([5]), torch.float32, 0)
            g.recv_tensor_dict(0)
            g.irecv((torch.Size([6]), torch.float32), other).wait()
        g.barrier()
        dump = snapshot(rec, rank=rank)
        return {"entries": [{k: e[k] for k in ("op", "collective_seq_id", "p2p_seq_id",
                                               "op_id", "state", "input_sizes",
                                               "output_sizes", "transport", "peer",
                                               "profiling_name", "rows_vary",
                                               "true_output_sizes", "timeout_ms",
                                               "thread_id")}
                            for e in dump["entries"]], "trace": g._trace is not None,
                "thread": str(threading.get_ident()), "pg_status": dump["pg_status"]}
    finally:
        g.destroy()
        reset_recorder(previous)


def test_a_groups_calls_are_recorded_in_order(dist_pool) -> None:
    outs = dist_pool(2).run(record_a_step, 64, timeout=60)
    for rank, out in enumerate(outs):
        got = [(e["op"], e["collective_seq_id"], e["p2p_seq_id"], e["state"])
               for e in out["entries"]]
        sends = ("send", "send_tensor_dict", "isend") if rank == 0 else (
            "recv", "recv_tensor_dict", "irecv")
        assert got == [("all_reduce", 1, 0, "completed"), ("all_gather", 2, 0, "completed"),
                       ("gather", 3, 0, "completed"), ("all_gatherv_rows", 4, 0, "completed"),
                       ("broadcast_tensor_dict", 5, 0, "completed"),
                       (sends[0], 5, 1, "completed"), (sends[1], 5, 2, "completed"),
                       (sends[2], 5, 3, "completed"), ("barrier", 6, 3, "completed")], got
        assert [e["op_id"] for e in out["entries"]] == list(range(1, 10))
        assert {(e["timeout_ms"], e["thread_id"]) for e in out["entries"]} == {
            (42000, out["thread"])}
        assert list(out["pg_status"].values()) == [{"last_enqueued_collective": 6,
                                                    "last_started_collective": 6,
                                                    "last_completed_collective": 6}]
        by_op = {e["op"]: e for e in out["entries"]}
        assert by_op["all_gather"]["output_sizes"] == [[4, 3]]
        rows = by_op["all_gatherv_rows"]  # PyTorch's view: an all-gather, the rows -n
        assert (rows["output_sizes"], rows["true_output_sizes"]) == ([[-2, 2]], [[3, 2]])
        assert rows["profiling_name"] == "nccl:all_gather" and rows["rows_vary"] == [True, False]
        assert by_op["all_reduce"]["transport"] == "shm"
        assert by_op[sends[2]]["output_sizes"] == [[6]] and by_op[sends[2]]["peer"] == 1 - rank
        assert by_op[sends[0]]["transport"] == "shm"  # the direction's shared-memory link
        assert by_op["barrier"]["transport"] == "gloo"


def variable_sizes_along_a_dim(rank: int, world_size: int, directory: str) -> None:
    """A real group's all_gatherv along dim 1 and reduce_scatterv along dim -1, dumped."""
    from coordinator import GroupCoordinator

    rec = FlightRecorder(capacity=16, dump_prefix=os.path.join(directory, "rank_"))
    previous = reset_recorder(rec)
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="dims")
    try:
        sizes = [r + 1 for r in range(world_size)]
        with contextlib.suppress(TypeError):  # refused on every rank; the dumps still work
            g.all_gatherv(torch.ones(2, 2, 3), dim="1", sizes=[2] * world_size)  # type: ignore
        g.all_gatherv(torch.ones(2, rank + 1, 3), dim=1, sizes=sizes)
        g.reduce_scatterv(torch.ones(2, sum(sizes)), dim=-1, sizes=sizes)
        write_dump(rec, rank=rank)
    finally:
        g.destroy()
        reset_recorder(previous)


@pytest.mark.timeout(60)
def test_a_groups_variable_size_calls_show_the_rows_along_their_dim(dist_pool, tmp_path,
                                                                    caplog) -> None:
    from coordinator.trace import analysis

    n = 2  # the pool the other tests of this file use (-n is -2, not -1)
    dist_pool(n).run(variable_sizes_along_a_dim, str(tmp_path), timeout=45)
    for rank in range(n):
        refused, gv, rs = [e for e in _load(str(tmp_path / f"rank_{rank}"))["entries"]
                           if e["op"] in ("all_gatherv", "reduce_scatterv")]
        assert refused["state"] == "failed" and refused["input_sizes"] == [[-1, 2, 3]]
        assert (gv["input_sizes"], gv["output_sizes"]) == ([[2, -1, 3]], [[2, -n, 3]]), gv
        assert gv["true_output_sizes"] == [[2, n * (n + 1) // 2, 3]], gv
        assert gv["rows_vary"] == [True, False]
        assert (rs["input_sizes"], rs["output_sizes"]) == ([[2, -n]], [[2, -1]]), rs
        assert rs["true_output_sizes"] == [[2, rank + 1]] and rs["rows_vary"] == [False, True]
    report = _pytorch_report(tmp_path, caplog)
    assert "has errors" not in report, report
    assert analysis.analyze(str(tmp_path))["ok"]


def test_a_recorder_turned_off_records_nothing(dist_pool) -> None:
    outs = dist_pool(2).run(record_a_step, 0, timeout=60)
    assert all(o["entries"] == [] and not o["trace"] for o in outs), outs


# ---------------------------------------------------------------------- what the analyzer reads
class _Raising:
    """Device marks whose every query raises (a sticky CUDA error)."""

    def started_ns(self) -> int | None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    completed_ns = replays = started_ns


def test_marks_that_cannot_be_read_leave_the_call_started_and_the_dump_whole(tmp_path) -> None:
    rec = _recorder(tmp_path)
    trace = rec.groups()[0]
    stuck = trace.begin_tensor("all_reduce", 7, 2, torch.ones(4))
    stuck[DEVICE] = _Raising()
    failed = trace.begin_tensor("all_reduce", 8, 2, torch.ones(4))
    failed[DEVICE] = _Raising()
    GroupTrace.fail(failed, CommTimeout("late"))
    entries = snapshot(rec, rank=0)["entries"]
    assert len(entries) == 10  # every entry, the unreadable ones included
    got = {e["collective_seq_id"]: e for e in entries if e["collective_seq_id"] in (7, 8)}
    assert (got[7]["state"], got[7]["time_discovered_started_ns"], got[7]["replays"]) == (
        "started", None, None)
    assert (got[8]["state"], got[8]["error"]) == ("failed", "CommTimeout")


def _two_ranks(directory: Any, rejecter: Any) -> None:
    """Rank 0's all_to_allv that rank 1 rejected, recorded by rank 1 with ``rejecter``."""
    x = torch.zeros(4, 2)
    for rank in range(2):
        rec = FlightRecorder(capacity=8, dump_prefix=str(directory / "rank_"))
        trace = rec.group("ep:0", "ep", [0, 1], rank)
        assert trace is not None
        entry = trace.begin("all_to_allv", 1, 0, *(shapes_of(x) if rank == 0 else rejecter))
        GroupTrace.fail(entry, CollectiveMismatch("rejected") if rank == 0 else ValueError("bad"))
        write_dump(rec, rank=rank)


@pytest.mark.parametrize("rejecter", [(torch.Size([3, 2]), torch.float32), (None, None)],
                         ids=["its-tensor", "nothing"])
def test_a_rejected_all_to_allv_reads_in_pytorchs_analyzer(tmp_path, capsys,
                                                          rejecter: Any) -> None:
    """The rejecting rank records its tensor's shape (``reject_call(op, e, data)``);
    one that recorded nothing shows ``[[]]``: PyTorch's analyzer indexes
    ``input_sizes[0]`` of both sides of every tensor call it compares."""
    from torch.distributed.flight_recorder.fr_trace import main

    _two_ranks(tmp_path, rejecter)
    mine = _load(str(tmp_path / "rank_1"))["entries"][0]
    want = [[-1, 2]] if rejecter[0] is not None else [[]]
    assert mine["input_sizes"] == mine["output_sizes"] == want
    assert mine["input_dtypes"] == mine["output_dtypes"] == (
        ["Float"] if rejecter[0] is not None else [])
    main([str(tmp_path)])  # raised IndexError in Op.dtype_mismatch on an empty size list
    capsys.readouterr()
    memberships = {"ep:0": {0, 1}}
    peer = Op(_load(str(tmp_path / "rank_0"))["entries"][0], memberships, "ep:0")
    empty = Op(snapshot_entry("all_gather"), memberships, "ep:0")
    for a, b in ((peer, empty), (empty, peer)):  # dtype_mismatch's three clauses, both ways
        a.dtype_mismatch(b)
        a.match(b)


def snapshot_entry(op: str) -> dict[str, Any]:
    """The dump entry of tensor call ``op`` that recorded no shape."""
    rec = FlightRecorder(capacity=4)
    trace = rec.group("ep:0", "ep", [0, 1], 1)
    assert trace is not None
    trace.begin(op, 1, 0)
    entry: dict[str, Any] = snapshot(rec, rank=1)["entries"][0]
    assert entry["input_sizes"] == entry["output_sizes"] == [[]]
    return entry


def reject_and_receive(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """A real rejected all_to_allv (rank 1 rejects, as moe.combine does), then a
    blocking recv and an irecv seen in flight: their entries hold what they receive."""
    import threading
    import time

    from coordinator import GroupCoordinator
    from coordinator.errors import PeerRejectedError

    rec = FlightRecorder(capacity=64, dump_prefix=os.path.join(directory, "rank_"))
    previous = reset_recorder(rec)
    g = GroupCoordinator([[0, 1]], rank, "gloo", True, group_name="rejects")
    out: dict[str, Any] = {}
    try:
        x = torch.ones(3, 2)
        if rank == 1:
            g.reject_call("all_to_allv", ValueError("expert_out is bad"), [x, x])
        else:
            with contextlib.suppress(PeerRejectedError):
                g.all_to_allv(x, [1, 2], [1, 2])
        write_dump(rec, rank=rank)
        if rank == 1:
            seen: list[dict[str, Any]] = []
            timer = threading.Timer(0.2, lambda: seen.append(snapshot(rec, rank=1)))
            timer.start()
            g.recv(torch.Size([5]), torch.float32, 0)
            timer.join()
            h = g.irecv((torch.Size([6]), torch.float64), 0)
            seen.append(snapshot(rec, rank=1))
            h.wait()
            out["in_flight"] = [[(e["op"], e["state"], e["input_sizes"], e["input_dtypes"])
                                 for e in s["entries"] if "recv" in e["op"]] for s in seen]
        else:
            time.sleep(0.5)  # the receiver's recv waits meanwhile
            g.send(torch.ones(5), 1)
            time.sleep(0.3)  # and its irecv
            g.send(torch.ones(6, dtype=torch.float64), 1)
        g.barrier()
    finally:
        g.destroy()
        reset_recorder(previous)
    return out


@pytest.mark.timeout(60)
def test_a_real_rejection_and_receives_in_flight_read_in_pytorchs_analyzer(
        dist_pool, tmp_path, capsys) -> None:
    from torch.distributed.flight_recorder.fr_trace import main

    outs = dist_pool(2).run(reject_and_receive, str(tmp_path), timeout=45)
    rejected = _load(str(tmp_path / "rank_1"))["entries"][-1]
    assert (rejected["op"], rejected["state"], rejected["input_sizes"]) == (
        "all_to_allv", "failed", [[-1, 2], [-1, 2]])
    main([str(tmp_path)])
    capsys.readouterr()
    recv, irecv = outs[1]["in_flight"]
    assert recv == [("recv", "started", [[5]], ["Float"])], recv
    assert irecv[-1] == ("irecv", "started", [[6]], ["Double"]), irecv
