"""``coordinator.trace.analysis``: loading dumps safely and finding who disagreed.

Every dump is built in-process: a :class:`FlightRecorder` per simulated rank,
its :class:`GroupTrace` calls begun, completed or failed as the rank would,
then written with :func:`write_dump` under the rank's number.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.trace.analysis import (
    PlainDataUnpickler,
    analyze,
    find_dumps,
    load_dump,
)
from coordinator.trace.dump import snapshot, write_dump
from coordinator.trace.recorder import FlightRecorder, GroupTrace
from shm_broadcast.errors import CollectiveMismatch, CommTimeout, DecodeError

PREFIX = "gc_rank_"
P2P_OPS = ("send", "recv", "isend", "irecv")
F32 = torch.float32


class Rank:
    """One simulated process: its recorder, its groups and their call counters."""

    def __init__(self, rank: int, capacity: int = 4096) -> None:
        self.rank = rank
        self.rec = FlightRecorder(capacity, dump_prefix="unused_")
        self.traces: dict[str, GroupTrace] = {}
        self.seq: dict[str, int] = {}
        self.p2p_seq: dict[str, int] = {}

    def group(self, name: str, ranks: Sequence[int]) -> Rank:
        trace = self.rec.group(name, name.split(":")[0], ranks, list(ranks).index(self.rank))
        assert trace is not None
        self.traces[name], self.seq[name], self.p2p_seq[name] = trace, 0, 0
        return self

    def call(self, group: str, op: str, shape: Sequence[int] | None = (4, 8), *,
             dtype: torch.dtype = F32, out: Sequence[int] | None = None, done: bool = True,
             error: BaseException | None = None, peer: int = -1) -> list[Any]:
        """Record one call as the coordinator would: begin, then complete or fail."""
        trace = self.traces[group]
        if op in P2P_OPS:
            self.p2p_seq[group] += 1
        else:
            self.seq[group] += 1
        sizes = None if shape is None else torch.Size(shape)
        entry = trace.begin(op, self.seq[group], self.p2p_seq[group], sizes,
                            None if shape is None else dtype, peer)
        if error is not None:
            trace.fail(entry, error)
        elif done:
            trace.complete(entry, None if out is None else torch.Size(out),
                           None if out is None else dtype)
        return entry

    def dump(self, directory: Path, prefix: str = PREFIX) -> str:
        return write_dump(self.rec, path=str(directory / f"{prefix}{self.rank}"),
                          reason="test", rank=self.rank)


def world(n: int, group: str = "tp:0", capacity: int = 4096) -> list[Rank]:
    return [Rank(r, capacity).group(group, range(n)) for r in range(n)]


def dump_all(ranks: Sequence[Rank], directory: Path, order: Sequence[int] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i in order if order is not None else range(len(ranks)):
        ranks[i].dump(directory)
    return directory


#: A run of mixed calls: (op, input shape, output shape on every rank).
MIXED: list[tuple[str, tuple[int, ...] | None, tuple[int, ...] | None]] = [
    ("all_reduce", (4, 8), None),
    ("all_gather", (2, 8), (8, 8)),
    ("broadcast_object", None, None),
    ("all_reduce", (4, 8), None),
    ("reduce_scatter", (8, 8), (2, 8)),
    ("all_reduce", (16,), None),
]


def skipped_all_reduce(directory: Path, order: Sequence[int]) -> Path:
    """World size 4; rank 2 skips the second all_reduce, so its call at that sequence
    number is the next one; every rank's call there fails, as the transports raise."""
    ranks = world(4)
    for r in ranks:
        calls = [c for i, c in enumerate(MIXED) if not (r.rank == 2 and i == 3)]
        for i, (op, shape, out) in enumerate(calls[:4]):
            err = CollectiveMismatch("ranks disagree") if i == 3 else None
            r.call("tp:0", op, shape, out=out, error=err)
    return dump_all(ranks, directory, order)


def group_of(result: dict[str, Any], name: str = "tp:0",
             ranks: Sequence[int] | None = None) -> dict[str, Any]:
    found = [g for g in result["groups"]
             if g["name"] == name and (ranks is None or g["ranks"] == list(ranks))]
    assert len(found) == 1, result["groups"]
    return found[0]


# --------------------------------------------------------------------------
# The analysis


def test_clean_run_of_mixed_calls_is_ok(tmp_path: Path) -> None:
    ranks = world(4)
    for r in ranks:
        for op, shape, out in MIXED:
            r.call("tp:0", op, shape, out=out)
        # Sizes that differ by rank where they may: the analyzer's -1 rows.
        r.call("tp:0", "all_gatherv", (r.rank + 1, 8), out=(10, 8))
        # A rooted call: only the root's output is the gathered one.
        r.call("tp:0", "gather", (2, 8), out=(8, 8) if r.rank == 0 else None)
    result = analyze(str(dump_all(ranks, tmp_path)))
    g = group_of(result)
    assert result["ok"] and g["ok"]
    assert g["first_mismatch"] is None and g["behind"] == [] and g["missing_dumps"] == []
    assert [(p["rank"], p["first_seq"], p["last_seq"], p["last_state"]) for p in g["progress"]] \
        == [(r, 1, 8, "completed") for r in range(4)]
    latency = {x["op"]: x for x in g["latency"]}
    assert latency["all_reduce"]["count"] == 12 and latency["broadcast_object"]["count"] == 4
    assert 0 <= latency["all_reduce"]["p50_ms"] <= latency["all_reduce"]["p99_ms"] \
        <= latency["all_reduce"]["max_ms"]
    assert g["in_flight"] == [] and g["p2p"] == []
    assert [d["rank"] for d in result["dumps"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (2, 3, 1, 0), (3, 2, 0, 1)])
def test_rank_2_skipping_an_all_reduce_is_the_culprit_in_any_file_order(
        tmp_path: Path, order: tuple[int, ...]) -> None:
    result = analyze(str(skipped_all_reduce(tmp_path, order)))
    assert not result["ok"]
    mm = group_of(result)["first_mismatch"]
    assert mm["culprits"] == [2] and mm["seq"] == 4 and not mm["tie"]
    assert mm["majority"]["op"] == "all_reduce" and mm["majority"]["input_sizes"] == [[4, 8]]
    calls = {c["rank"]: c for c in mm["calls"]}
    assert calls[2]["op"] == "reduce_scatter" and calls[2]["input_sizes"] == [[8, 8]]
    assert calls[0]["input_dtypes"] == ["Float"]
    assert {c["state"] for c in calls.values()} == {"failed"}
    assert {c["error"] for c in calls.values()} == {"CollectiveMismatch"}
    assert mm["behind"] == [] and mm["absent"] == []


def test_same_op_with_other_sizes_is_a_mismatch_and_a_tie_names_every_rank(
        tmp_path: Path) -> None:
    ranks = world(3)
    for r in ranks:
        r.call("tp:0", "all_reduce", (4, 8) if r.rank != 1 else (4, 9))
    mm = group_of(analyze(str(dump_all(ranks, tmp_path / "three"))))["first_mismatch"]
    assert mm["culprits"] == [1] and not mm["tie"]
    assert mm["majority"]["input_sizes"] == [[4, 8]]
    pair = world(2)
    pair[0].call("tp:0", "all_reduce", (4, 8))
    pair[1].call("tp:0", "all_reduce", (4, 8), dtype=torch.bfloat16)
    mm = group_of(analyze(str(dump_all(pair, tmp_path / "two"))))["first_mismatch"]
    assert mm["tie"] and mm["culprits"] == [0, 1] and mm["majority"] is None


@pytest.mark.parametrize("dumped_early", [False, True])
def test_a_rank_that_stopped_early_is_behind_not_a_culprit(tmp_path: Path,
                                                          dumped_early: bool) -> None:
    ranks = world(4)
    for r in ranks:
        for op, shape, out in MIXED[:3]:
            r.call("tp:0", op, shape, out=out)
    if dumped_early:
        ranks[3].dump(tmp_path)
    for r in ranks[:3]:  # rank 3 never makes call 4: the others wait in it
        r.call("tp:0", "all_reduce", (4, 8), done=False)
    dump_all(ranks, tmp_path, order=(0, 1, 2) if dumped_early else None)
    result = analyze(str(tmp_path))
    g = group_of(result)
    assert not result["ok"] and g["first_mismatch"] is None and g["max_seq"] == 4
    assert g["behind"] == [{"rank": 3, "last_seq": 3, "by": 1, "dumped_early": dumped_early}]
    flying = {f["rank"]: f for f in g["in_flight"]}
    assert sorted(flying) == [0, 1, 2]
    oldest = flying[0]["oldest"]
    assert (oldest["op"], oldest["seq"], oldest["state"]) == ("all_reduce", 4, "started")
    assert oldest["age_ms"] >= 0


def test_a_mismatch_after_a_rank_stopped_leaves_it_out(tmp_path: Path) -> None:
    ranks = world(4)
    for r in ranks:
        r.call("tp:0", "all_reduce")
        if r.rank != 0:
            r.call("tp:0", "all_reduce", (4, 8) if r.rank != 3 else (2, 8), done=False)
    mm = group_of(analyze(str(dump_all(ranks, tmp_path))))["first_mismatch"]
    assert mm["seq"] == 2 and mm["culprits"] == [3] and mm["behind"] == [0]
    assert [c["rank"] for c in mm["calls"]] == [1, 2, 3]


def test_ring_wrap_compares_only_the_calls_every_rank_still_holds(tmp_path: Path) -> None:
    def run(directory: Path, odd: tuple[int, int]) -> dict[str, Any]:
        ranks = [Rank(r, capacity=8).group("tp:0", range(3)).group("pp:0", [r])
                 for r in range(3)]
        for r in ranks:
            for i in range(1, 11):
                shape = (2, 8) if (r.rank, i) == odd else (4, 8)
                r.call("tp:0", "all_reduce", shape)
                if r.rank == 1 and i == 5:  # rank 1's ring holds 3 more calls of another group
                    for _ in range(3):
                        r.call("pp:0", "barrier", None)
        return group_of(analyze(str(dump_all(ranks, directory))))

    g = run(tmp_path / "early", odd=(2, 4))  # seq 4 is gone from rank 1's ring
    assert [(p["rank"], p["first_seq"], p["last_seq"], p["wrapped"]) for p in g["progress"]] \
        == [(0, 3, 10, True), (1, 6, 10, True), (2, 3, 10, True)]
    assert g["ok"] and g["first_mismatch"] is None
    g = run(tmp_path / "late", odd=(1, 8))
    assert g["first_mismatch"]["seq"] == 8 and g["first_mismatch"]["culprits"] == [1]


def test_groups_sharing_a_name_are_told_apart_by_their_ranks(tmp_path: Path) -> None:
    ranks = [Rank(r).group("tp:0", [0, 1] if r < 2 else [2, 3]) for r in range(4)]
    for r in ranks:
        r.call("tp:0", "all_reduce")
        if r.rank != 3:
            r.call("tp:0", "all_gather", (2, 8), out=(4, 8))
    result = analyze(str(dump_all(ranks, tmp_path, order=(3, 1, 2, 0))))
    first, second = group_of(result, ranks=[0, 1]), group_of(result, ranks=[2, 3])
    assert first["ok"] and [p["last_seq"] for p in first["progress"]] == [2, 2]
    assert not second["ok"] and second["first_mismatch"] is None
    assert second["behind"] == [{"rank": 3, "last_seq": 1, "by": 1, "dumped_early": False}]


def test_missing_dumps_empty_dumps_and_a_single_rank(tmp_path: Path) -> None:
    ranks = world(3)
    ranks[0].call("tp:0", "all_reduce")
    ranks[1].call("tp:0", "all_reduce")  # rank 1 made the call, rank 0 too; rank 2 dumps none
    dump_all(ranks[:2], tmp_path / "missing")
    g = group_of(analyze(str(tmp_path / "missing")))
    assert g["missing_dumps"] == [2] and g["ok"]
    dump_all(ranks, tmp_path / "empty")  # rank 2's dump holds no call: it reached seq 0
    g = group_of(analyze(str(tmp_path / "empty")))
    assert g["behind"] == [{"rank": 2, "last_seq": 0, "by": 1, "dumped_early": False}]
    alone = Rank(0).group("tp:0", [0])
    alone.call("tp:0", "all_reduce", error=CommTimeout("stuck"))
    result = analyze(str(dump_all([alone], tmp_path / "alone")))
    assert result["ok"] and group_of(result)["progress"][0]["last_state"] == "failed"


def test_point_to_point_calls_pair_per_direction(tmp_path: Path) -> None:
    def run(directory: Path, recv_shape: tuple[int, ...], recvs: int) -> dict[str, Any]:
        ranks = [Rank(r).group("pp:0", [2, 3]) for r in (2, 3)]  # group ranks 0 and 1
        for _ in range(3):
            ranks[0].call("pp:0", "send", (4,), peer=1)
        for _ in range(recvs):
            ranks[1].call("pp:0", "recv", recv_shape, peer=0)
        ranks[1].call("pp:0", "send", (1,), peer=0, done=False)
        directory.mkdir()
        for r in ranks:
            r.dump(directory)
        return group_of(analyze(str(directory)), "pp:0")

    g = run(tmp_path / "short", (4,), recvs=2)
    pairs = {(p["src"], p["dst"]): p for p in g["p2p"]}
    assert pairs[(2, 3)]["matched"] == 2 and pairs[(2, 3)]["mismatches"] == []
    assert pairs[(2, 3)]["unmatched_sends"] == [{"p2p_seq": 3, "op": "send",
                                                 "state": "completed"}]
    assert pairs[(3, 2)]["unmatched_sends"][0]["state"] == "started"
    assert g["ok"] and [f["rank"] for f in g["in_flight"]] == [3]
    g = run(tmp_path / "sizes", (8,), recvs=3)
    pairs = {(p["src"], p["dst"]): p for p in g["p2p"]}
    assert not g["ok"] and len(pairs[(2, 3)]["mismatches"]) == 3
    assert pairs[(2, 3)]["mismatches"][0]["send_sizes"] == [[4]]
    assert pairs[(2, 3)]["mismatches"][0]["recv_sizes"] == [[8]]


def test_prefix_is_inferred_and_hidden_files_are_skipped(tmp_path: Path) -> None:
    ranks = world(2)
    dump_all(ranks, tmp_path)
    (tmp_path / ".groupcoord_trace.abc12").write_bytes(b"half a dump")
    (tmp_path / "notes.txt").write_text("not a dump")
    assert find_dumps(str(tmp_path)) == (PREFIX, {0: str(tmp_path / f"{PREFIX}0"),
                                                  1: str(tmp_path / f"{PREFIX}1")})
    (tmp_path / "other_7").write_bytes(b"")
    with pytest.raises(ValueError, match="--prefix"):
        find_dumps(str(tmp_path))
    assert sorted(find_dumps(str(tmp_path), "/somewhere/" + PREFIX)[1]) == [0, 1]


# --------------------------------------------------------------------------
# PyTorch's own dumps

#: A dump PyTorch 2.13 wrote (``_dump_fr_trace`` after all_reduce, broadcast and
#: all_reduce on a new group, one gloo rank; see ``_TORCH_DUMP_SCRIPT``).
TORCH_GLOO_DUMP = base64.b64decode(
    "gAJ9KFgHAAAAdmVyc2lvbnEAWAQAAAAyLjEwcQFYCQAAAHBnX2NvbmZpZ3ECfShYAAAAAHEDfShYBAAAAG5hbWVx"
    "BGgDWAQAAABkZXNjcQVoA1gFAAAAcmFua3NxBlgCAAAAW11xB3V1WBAAAABjb21tX2xpYl92ZXJzaW9ucQhoA1gJ"
    "AAAAcGdfc3RhdHVzcQl9KFgBAAAAMHEKfShYGAAAAGxhc3RfZW5xdWV1ZWRfY29sbGVjdGl2ZXELSwJYFwAAAGxh"
    "c3Rfc3RhcnRlZF9jb2xsZWN0aXZlcQxK/////1gZAAAAbGFzdF9jb21wbGV0ZWRfY29sbGVjdGl2ZXENSwJ1WAEA"
    "AAAxcQ59KGgLSwFoDEr/////aA1LAXV1WAcAAABlbnRyaWVzcQ9dKH0oWAYAAABmcmFtZXNxEF0ofShoBFgKAAAA"
    "YWxsX3JlZHVjZXERWAgAAABmaWxlbmFtZXESWE0AAAAvd29yay92ZW52L2xpYi9weXRob24zLjExL3NpdGUtcGFj"
    "a2FnZXMvdG9yY2gvZGlzdHJpYnV0ZWQvZGlzdHJpYnV0ZWRfYzEwZC5weXETWAQAAABsaW5lcRRNrQx1cRV9KGgE"
    "WAcAAAB3cmFwcGVycRZoElhIAAAAL3dvcmsvdmVudi9saWIvcHl0aG9uMy4xMS9zaXRlLXBhY2thZ2VzL3RvcmNo"
    "L2Rpc3RyaWJ1dGVkL2MxMGRfbG9nZ2VyLnB5cRdoFEtTdXEYfShoBFgIAAAAPG1vZHVsZT5xGWgSWAgAAAA8c3Ry"
    "aW5nPnEaaBRLBnVlWAkAAAByZWNvcmRfaWRxG0sAWAUAAABwZ19pZHEcSwBYDQAAAHByb2Nlc3NfZ3JvdXBxHWgK"
    "WAoAAABkZWZhdWx0X3BncR6GWAsAAAB0aHJlYWRfbmFtZXEfWAYAAABweXRob25xIFgJAAAAdGhyZWFkX2lkcSFY"
    "DwAAADEzOTk5MTcwNjA0OTQwOHEiWBEAAABjb2xsZWN0aXZlX3NlcV9pZHEjSwFYCgAAAHAycF9zZXFfaWRxJEsA"
    "WAUAAABvcF9pZHElSwFYDgAAAHByb2ZpbGluZ19uYW1lcSZYDwAAAGdsb286YWxsX3JlZHVjZXEnWA8AAAB0aW1l"
    "X2NyZWF0ZWRfbnNxKIoIfRckN9B17BhYCwAAAGlucHV0X3NpemVzcSldKF0oSwRLCGVlWAwAAABpbnB1dF9kdHlw"
    "ZXNxKl0oWAUAAABGbG9hdHErZVgMAAAAb3V0cHV0X3NpemVzcSxdKF0oSwRLCGVlWA0AAABvdXRwdXRfZHR5cGVz"
    "cS1dKGgrZVgFAAAAc3RhdGVxLlgJAAAAc2NoZWR1bGVkcS9YGgAAAHRpbWVfZGlzY292ZXJlZF9zdGFydGVkX25z"
    "cTBOWBwAAAB0aW1lX2Rpc2NvdmVyZWRfY29tcGxldGVkX25zcTFOWAcAAAByZXRpcmVkcTKIWAoAAAB0aW1lb3V0"
    "X21zcTNKQHcbAFgGAAAAaXNfcDJwcTSJdX0oaBBdKH0oaARYCQAAAGJyb2FkY2FzdHE1aBJoE2gUTUkMdWgYfSho"
    "BGgZaBJoGmgUSwd1ZWgbSwFoHEsAaB1oCmgehmgfaCBoIWgiaCNLAmgkSwBoJUsCaCZYDgAAAGdsb286YnJvYWRj"
    "YXN0cTZoKIoIrIgmN9B17BhoKV0oXShLBEsIZWVoKl0oaCtlaCxdKF0oSwRLCGVlaC1dKGgrZWguaC9oME5oMU5o"
    "MohoM0pAdxsAaDSJdX0oaBBdKGgVaBh9KGgEaBloEmgaaBRLCHVlaBtLAmgcSwFoHWgOWAkAAAB1bmRlZmluZWRx"
    "N4ZoH2ggaCFoImgjSwFoJEsAaCVLAWgmaCdoKIoIPNo0N9B17BhoKV0oXShLBEsIZWVoKl0oaCtlaCxdKF0oSwRL"
    "CGVlaC1dKGgrZWguaC9oME5oMU5oMohoM0pAdxsAaDSJdWV1cTgu"
)

_TORCH_DUMP_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    x = torch.ones(4, 8)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    dist.all_reduce(x, group=dist.new_group([0]))
    with open(sys.argv[1], "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    dist.destroy_process_group()
""")


def _check_torch_dump(directory: Path) -> None:
    result = analyze(str(directory))
    assert result["ok"], result
    assert result["dumps"][0]["entries"] == 3
    groups = {g["name"]: g for g in result["groups"]}
    assert groups["0"]["progress"][0]["last_seq"] == 2
    assert groups["1"]["progress"][0]["last_seq"] == 1
    assert groups["0"]["latency"] == [] and groups["0"]["in_flight"] == []  # gloo: no timing


def test_a_dump_written_by_pytorch_loads(tmp_path: Path) -> None:
    (tmp_path / "torch_fr_0").write_bytes(TORCH_GLOO_DUMP)
    _check_torch_dump(tmp_path)


@pytest.mark.slow
def test_a_dump_pytorch_writes_now_loads(tmp_path: Path) -> None:
    out = tmp_path / "dumps"
    out.mkdir()
    subprocess.run([sys.executable, "-c", _TORCH_DUMP_SCRIPT, str(out / "torch_fr_0"),
                    str(tmp_path / "store")], check=True, timeout=120)
    _check_torch_dump(out)


# --------------------------------------------------------------------------
# Hostile and malformed dumps


def _valid_dump() -> dict[str, Any]:
    r = Rank(0).group("tp:0", [0, 1])
    r.call("tp:0", "all_reduce")
    return snapshot(r.rec, rank=0)


def _write(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / f"{PREFIX}0"
    path.write_bytes(data)
    return str(path)


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (self.command,)


def test_a_pickle_that_calls_os_system_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dump = _valid_dump()
    dump["entries"][0]["state"] = _RunsCommand(f"touch {marker}")
    path = _write(tmp_path, pickle.dumps(dump, protocol=4))
    with pytest.raises(DecodeError, match="posix.system|os.system") as info:
        load_dump(path, 0)
    assert path in str(info.value) and not marker.exists()


def test_a_pickle_that_calls_exec_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    data = b"cbuiltins\nexec\n(" + pickle.dumps(code, protocol=0)[:-1] + b"tR."
    path = _write(tmp_path, data)
    with pytest.raises(DecodeError, match="builtins.exec"):
        load_dump(path, 0)
    assert not marker.exists()
    with pytest.raises(DecodeError, match="REDUCE"):  # a call without a global: refused too
        PlainDataUnpickler.loads(b"\x80\x04N)R.", path)


@pytest.mark.parametrize("data, match", [
    (pickle.dumps(_valid_dump(), protocol=4)[:200], "not a readable pickle"),
    (b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"abc.", "not a readable pickle"),
    (b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N.", "expected a dict, got None"),
    (pickle.dumps({1: 2}, protocol=4), "dict key is int"),
    (pickle.dumps({frozenset([1]): 2}, protocol=4), "FROZENSET"),
    (pickle.dumps(["not", "a", "dict"]), "the dump: expected a dict"),
    (pickle.dumps({"entries": []}), "version: missing"),
])
def test_malformed_pickles_raise_decode_error_naming_the_file(
        tmp_path: Path, data: bytes, match: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(DecodeError, match=match) as info:
        load_dump(path, 0)
    assert path in str(info.value)


def _mutate(dump: dict[str, Any], where: str, value: Any) -> None:
    *parents, last = where.split(".")
    target: Any = dump
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[int(last) if last.isdigit() else last] = value


@pytest.mark.parametrize("where, value, field", [
    ("entries", {"a": 1}, "entries: expected a list"),
    ("entries.0.collective_seq_id", "3", "entries[0].collective_seq_id: expected an int64"),
    ("entries.0.collective_seq_id", 1 << 70, "entries[0].collective_seq_id"),
    ("entries.0.input_sizes", [[4, "8"]], "entries[0].input_sizes[0]"),
    ("entries.0.input_dtypes", "Float", "entries[0].input_dtypes: expected a list"),
    ("entries.0.process_group", ("tp:0",), "entries[0].process_group"),
    ("entries.0.state", None, "entries[0].state"),
    ("entries.0.duration_ms", float("nan"), "entries[0].duration_ms"),
    ("entries.0.duration_ms", 10**400, "entries[0].duration_ms"),  # float() would overflow
    ("entries.0.op", "x" * 5000, "entries[0].op"),
    ("pg_config.tp:0.ranks", "[0, __import__('os')]", "pg_config['tp:0'].ranks"),
    ("groupcoord.monotonic_ns", 1.5, "groupcoord.monotonic_ns"),
])
def test_wrong_types_raise_decode_error_naming_the_field(
        tmp_path: Path, where: str, value: Any, field: str) -> None:
    dump = _valid_dump()
    _mutate(dump, where, value)
    path = _write(tmp_path, pickle.dumps(dump, protocol=4))
    with pytest.raises(DecodeError, match=re.escape(field)) as info:
        load_dump(path, 0)
    assert path in str(info.value)


def test_a_missing_entry_field_is_named(tmp_path: Path) -> None:
    dump = _valid_dump()
    del dump["entries"][0]["record_id"]
    with pytest.raises(DecodeError, match=r"entries\[0\].record_id: missing"):
        load_dump(_write(tmp_path, pickle.dumps(dump)), 0)


def test_size_cap_and_shared_references_are_bounded(tmp_path: Path) -> None:
    data = pickle.dumps(_valid_dump(), protocol=4)
    with pytest.raises(DecodeError, match="more than the 100"):
        load_dump(_write(tmp_path, data), 0, max_bytes=100)
    assert load_dump(_write(tmp_path, data), 0, max_bytes=len(data)).calls
    # One entry named 5000 times, each naming one list of 1000 dims: a small file
    # whose full walk would be 5 million ints.
    dump = _valid_dump()
    entry = dump["entries"][0]
    entry["input_sizes"] = [[1] * 1000]
    dump["entries"] = [entry] * 5000
    data = pickle.dumps(dump, protocol=4)
    assert len(data) < 50_000
    with pytest.raises(DecodeError, match="more data than the file's size allows"):
        load_dump(_write(tmp_path, data), 0)
