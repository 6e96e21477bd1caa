"""Dumps of collectives that failed, or have not completed, say what the ranks called.

* An ``all_gather`` / ``reduce_scatter`` that failed (or still waits) dumps the
  output shape the call would have produced, not its input's: PyTorch's
  analyzer checks ``output numel == input numel * n`` (all-gather) and
  ``input numel == output numel * n`` (reduce-scatter) between every pair of
  ranks, so ranks that made identical calls must not be reported as
  mismatching each other (nor an entry as mismatching itself).
* Ranks that disagree on a broadcast's ``src`` or an all-reduce's reduce op
  all raise ``CollectiveMismatch``: ``groupcoord trace`` must not report ``ok``,
  and names the rank that differs from the majority (a tie at 2 ranks).

Real ranks (the ``dist_pool`` fixture), real dumps, read by ``torchfrtrace``
(its ``Op.match`` in-process and the command in a subprocess) and by
``groupcoord trace``.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch

from tests.coordinator.rank_checks import env_set
from tests.coordinator.trace.fr_tools import PREFIX, analyzer_order, torchfrtrace

pytestmark = pytest.mark.timeout(180)

_TIMEOUT = 10.0


def _group(rank: int, world_size: int, directory: str, name: str) -> Any:
    """A group whose dumps go to ``directory``, on a fresh recorder."""
    from coordinator import GroupCoordinator
    from coordinator.trace.recorder import reset_recorder

    with env_set("GROUPCOORD_TRACE_DUMP", os.path.join(directory, PREFIX)):
        previous = reset_recorder()
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=name, timeout=_TIMEOUT)
    return g, previous


def bigger_on_last_rank(rank: int, world_size: int, op: str, directory: str) -> dict[str, Any]:
    """Every rank but the last passes 2 elements per rank, the last 3: all raise."""
    from coordinator.errors import GroupCoordError
    from coordinator.trace.recorder import reset_recorder

    g, previous = _group(rank, world_size, directory, f"fs-{op}")
    try:
        k = 3 if rank == world_size - 1 else 2
        g.all_reduce(torch.ones(2))  # a completed call first
        try:
            if op == "all_gather":
                g.all_gather(torch.ones(k, 2), dim=0)
            else:
                g.reduce_scatter(torch.ones(2, world_size * k), dim=-1)
        except GroupCoordError as e:
            return {"rank": rank, "error": type(e).__name__,
                    "dump": getattr(e, "trace_dump", None)}
        return {"rank": rank, "error": None, "dump": None}
    finally:
        g.destroy()
        reset_recorder(previous)


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)  # our own test's dumps






@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failed_call_dumps_the_output_shape_it_would_produce(
        dist_pool: Any, tmp_path: Any, world_size: int, op: str) -> None:
    from torch.distributed.flight_recorder.components.types import MatchState, Op

    from coordinator.trace import analysis

    directory = str(tmp_path / "dumps")
    outs = dist_pool(world_size).run(bigger_on_last_rank, op, directory, timeout=90)
    assert all(o["error"] == "CollectiveMismatch" for o in outs), outs
    last = world_size - 1
    entries = {}
    for r in range(world_size):
        dump = _load(os.path.join(directory, f"{PREFIX}{r}"))
        (e,) = [x for x in dump["entries"] if x["op"] == op]
        assert e["state"] == "failed" and e["error"] == "CollectiveMismatch", e
        k = 3 if r == last else 2
        if op == "all_gather":  # in (k, 2) along dim 0 -> (n * k, 2)
            assert e["input_sizes"] == [[k, 2]], e
            assert e["output_sizes"] == [[world_size * k, 2]], e
        else:  # in (2, n * k) along dim -1 -> (2, k)
            assert e["input_sizes"] == [[2, world_size * k]], e
            assert e["output_sizes"] == [[2, k]], e
        assert e["true_output_sizes"] == e["output_sizes"], e
        entries[r] = e

    # PyTorch's matcher: each entry matches itself, and the ranks that made the
    # same call match each other.
    members = {"g": set(range(world_size))}
    ops = {r: Op(e, members, "g") for r, e in entries.items()}
    for r in range(world_size):
        got = ops[r].match(ops[r])
        assert got.state == MatchState.FULLY_MATCHED, (r, str(got))
    for r in range(last):
        for s in range(last):
            got = ops[r].match(ops[s])
            assert got.state == MatchState.FULLY_MATCHED, (r, s, str(got))

    # torchfrtrace on the directory: only the disagreeing side is blamed.
    report = torchfrtrace(directory)
    assert "Collective sequence number: 2 has errors" in report, report
    blamed = {int(r) for r in re.findall(r"Culprit rank (\d+)", report)}
    if analyzer_order(directory)[0] == last:  # the odd one is its reference
        assert blamed == set(range(last)), report
    else:
        assert blamed == {last}, report
    assert "numel" not in report, report  # no element-count complaint: only the sizes

    # groupcoord trace: the last rank (a tie at 2)
    result = analysis.analyze(directory)
    (group,) = result["groups"]
    mm = group["first_mismatch"]
    assert mm is not None and mm["seq"] == 2, group
    if world_size == 2:
        assert mm["tie"] and mm["culprits"] == [0, 1], mm
    else:
        assert not mm["tie"] and mm["culprits"] == [last], mm


#: op, the dim the call stores (an all-to-all's: scatter and gather dims), and the
#: output shape of an input of shape (3, 2n) in a group of n ranks.
IN_FLIGHT_CASES = {
    "all_gather": ("all_gather", 1, lambda n: [3, 2 * n * n]),
    "all_gather-np-dim": ("all_gather", np.int64(-1), lambda n: [3, 2 * n * n]),
    "reduce_scatter": ("reduce_scatter", 1, lambda n: [3, 2]),
    "all_to_all-1-0": ("all_to_all", (1, 0), lambda n: [3 * n, 2]),
    "all_to_all-1-1": ("all_to_all", (1, 1), lambda n: [3, 2 * n]),
    "all_to_all-np-dims": ("all_to_all", (np.int32(-1), np.int64(-2)), lambda n: [3 * n, 2]),
}


@pytest.mark.parametrize("case", list(IN_FLIGHT_CASES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_call_in_flight_dumps_the_output_shape_it_will_produce(
        world_size: int, case: str, tmp_path: Any) -> None:
    """Entries begun and not completed (a hang), as every rank's dump shows them."""
    from torch.distributed.flight_recorder.components.types import MatchState, Op

    from coordinator.trace.dump import snapshot
    from coordinator.trace.recorder import DIM, FlightRecorder

    op, dim, want = IN_FLIGHT_CASES[case]
    t = torch.ones(3, 2 * world_size)
    entries = []
    for r in range(world_size):
        rec = FlightRecorder(16, dump_prefix=str(tmp_path / PREFIX))
        g = rec.group("g:0", "g", list(range(world_size)), r, timeout=10)
        assert g is not None
        entry = g.begin_tensor(op, 1, 0, t)
        entry[DIM] = dim  # what the call stores: its dim
        entries.append(snapshot(rec, rank=r)["entries"][-1])
    e = entries[0]
    assert e["state"] == "started"
    assert e["output_sizes"] == [want(world_size)], e
    members = {"g": set(range(world_size))}
    # PyTorch's matcher leaves every all-to-all undecided (any split is legal).
    agreed = MatchState.UNDECIDED if op == "all_to_all" else MatchState.FULLY_MATCHED
    for a in entries:
        for b in entries:
            got = Op(a, members, "g").match(Op(b, members, "g"))
            assert got.state == agreed, str(got)


def disagree(rank: int, world_size: int, kind: str, directory: str) -> dict[str, Any]:
    """The last rank passes another broadcast ``src`` / all-reduce op: all raise."""
    from coordinator.errors import GroupCoordError
    from coordinator.trace.recorder import reset_recorder
    from device_comms import ReduceOp

    g, previous = _group(rank, world_size, directory, f"ro-{kind}")
    try:
        odd = rank == world_size - 1
        g.all_reduce(torch.ones(2))  # a completed call first
        src = 1 if odd else 0
        try:
            if kind == "src":
                g.broadcast(torch.ones(4), src)
            elif kind == "object-src":
                g.broadcast_object({"from": rank} if rank == src else None, src)
            elif kind == "dict-src":
                g.broadcast_tensor_dict({"t": torch.ones(2)} if rank == src else None, src)
            elif kind == "list-src":
                g.broadcast_object_list([rank] if rank == src else [None], src)
            else:
                g.all_reduce(torch.ones(4), op=ReduceOp.MAX if odd else ReduceOp.SUM)
        except GroupCoordError as e:
            return {"rank": rank, "error": type(e).__name__}
        return {"rank": rank, "error": None}
    finally:
        g.destroy()
        reset_recorder(previous)


@pytest.mark.parametrize("kind", ["src", "object-src", "dict-src", "list-src", "op"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_on_root_or_reduce_op_are_named(
        dist_pool: Any, tmp_path: Any, world_size: int, kind: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import main as cli_main
    from coordinator.trace import analysis

    directory = str(tmp_path / "dumps")
    outs = dist_pool(world_size).run(disagree, kind, directory, timeout=90)
    assert all(o["error"] == "CollectiveMismatch" for o in outs), outs

    result = analysis.analyze(directory)
    (group,) = result["groups"]
    assert not result["ok"] and not group["ok"], group
    mm = group["first_mismatch"]
    assert mm is not None and mm["seq"] == 2, group
    last = world_size - 1
    if world_size == 2:
        assert mm["tie"] and mm["culprits"] == [0, 1], mm
    else:
        assert not mm["tie"] and mm["culprits"] == [last], mm
    field, agreed, odd = ("reduce_op", "SUM", "MAX") if kind == "op" else ("root", 0, 1)
    got = {c["rank"]: c[field] for c in mm["calls"]}
    assert got == {r: odd if r == last else agreed for r in range(world_size)}, mm

    assert cli_main(["trace", directory]) == 1
    out = capsys.readouterr().out
    assert "ok: no disagreement" not in out, out
    assert f"MISMATCH at seq 2, culprits {[0, 1] if world_size == 2 else [last]}" in out, out

    # PyTorch's analyzer still loads and reads the dumps (its verdict: nothing it compares)
    torchfrtrace(directory)
