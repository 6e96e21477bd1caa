"""A rank that skips one ``all_reduce``: every rank raises and writes its flight-recorder
dump, and PyTorch's analyzer (``torchfrtrace DIR``, in a subprocess) finds the
mismatch at that call, on the shared-memory transport and on gloo.

Which rank the analyzer blames depends on the order it reads the files in.
It takes the first rank of its ``os.walk`` file order (the directory's order:
a hash of the names on ext4, creation order on tmpfs) as the reference and
reports every *other* rank whose entry differs as ``Culprit rank N``; nothing
in a dump's content changes that choice. So when rank 2's file comes first it
names ranks 0, 1 and 3 instead of 2 (with rank 2's ``all_gather`` as the
expected call). The test reads the directory in the analyzer's order and
checks the report that order must give. ``groupcoord trace`` (once
``coordinator.trace.analysis`` exists) compares every rank and must name
rank 2 whatever the order.
"""

from __future__ import annotations

import os
import pickle
import re
import stat
from typing import Any

import pytest
import torch

from tests.coordinator.trace.fr_tools import PREFIX, analyzer_order, torchfrtrace

pytestmark = pytest.mark.timeout(120)

_SKIPPER = 2
_TIMEOUT = 10.0


def _calls(g: Any, rank: int) -> list[tuple[str, Any]]:
    """The run of mixed calls; rank 2 leaves out the second ``all_reduce``."""
    n = g.world_size
    run: list[tuple[str, Any]] = [
        ("all_reduce", lambda: g.all_reduce(torch.ones(4))),
        ("all_gather", lambda: g.all_gather(torch.ones(4), dim=0)),
        ("broadcast", lambda: g.broadcast(torch.ones(3) if rank == 0 else torch.zeros(3), 0)),
        ("reduce_scatter", lambda: g.reduce_scatter(torch.ones(2 * n), dim=0)),
        ("broadcast_object", lambda: g.broadcast_object({"step": 1} if rank == 0 else None)),
        ("barrier", lambda: g.barrier()),
        ("all_reduce", lambda: g.all_reduce(torch.ones(4))),  # rank 2 skips this one
        ("all_gather", lambda: g.all_gather(torch.ones(4), dim=0)),
        ("all_reduce", lambda: g.all_reduce(torch.ones(4))),
    ]
    if rank == _SKIPPER:
        del run[6]
    return run


def skip_one_all_reduce(rank: int, world_size: int, transport: str,
                        directory: str) -> dict[str, Any]:
    """Run the calls until one raises; the dump is written by the failing call."""
    from coordinator import GroupCoordinator
    from coordinator.errors import GroupCoordError
    from coordinator.trace.recorder import reset_recorder

    saved = os.environ.get("GROUPCOORD_TRACE_DUMP")
    os.environ["GROUPCOORD_TRACE_DUMP"] = os.path.join(directory, PREFIX)
    previous = reset_recorder()  # this run's calls only, dumped where the test looks
    try:
        kwargs = {"device_communicator": "torch"} if transport == "gloo" else {}
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=f"frmm-{transport}", timeout=_TIMEOUT, **kwargs)
    finally:
        if saved is None:
            os.environ.pop("GROUPCOORD_TRACE_DUMP", None)
        else:
            os.environ["GROUPCOORD_TRACE_DUMP"] = saved
    try:
        done: list[str] = []
        for name, call in _calls(g, rank):
            try:
                call()
            except GroupCoordError as e:
                return {"rank": rank, "done": done, "failed": name,
                        "error": type(e).__name__, "dump": getattr(e, "trace_dump", None),
                        "group": g.unique_name}
            done.append(name)
        return {"rank": rank, "done": done, "failed": None, "error": None, "dump": None,
                "group": g.unique_name}
    finally:
        g.destroy()
        reset_recorder(previous)






_SEQ = 7  # rank 2's 7th collective is the all_gather its peers' 7th all_reduce meets


def _dumps(dist_pool: Any, directory: str, transport: str) -> list[dict[str, Any]]:
    """Run the calls on 4 ranks; check that every rank raised at call 7 and dumped."""
    outs = dist_pool(4).run(skip_one_all_reduce, transport, directory, timeout=60)
    for o in outs:
        assert o["error"] == "CollectiveMismatch", outs
        assert len(o["done"]) == _SEQ - 1, outs
        assert o["dump"] == os.path.join(directory, f"{PREFIX}{o['rank']}"), outs
    assert outs[_SKIPPER]["failed"] == "all_gather"
    assert all(o["failed"] == "all_reduce" for o in outs if o["rank"] != _SKIPPER)
    for r in range(4):
        mode = stat.S_IMODE(os.stat(os.path.join(directory, f"{PREFIX}{r}")).st_mode)
        assert mode == 0o600, oct(mode)
    return outs


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_torchfrtrace_and_groupcoord_trace_find_the_skipped_all_reduce(
        dist_pool, tmp_path, transport: str, capsys: pytest.CaptureFixture) -> None:
    from coordinator.cli import main as cli_main
    from coordinator.trace import analysis

    directory = str(tmp_path / "dumps")
    outs = _dumps(dist_pool, directory, transport)

    with open(os.path.join(directory, f"{PREFIX}0"), "rb") as f:
        dump = pickle.load(f)
    reduces = [e for e in dump["entries"] if e["op"] == "all_reduce"]
    assert {e["transport"] for e in reduces} == {transport}  # the transport the calls took
    assert reduces[-1]["state"] == "failed" and reduces[-1]["error"] == "CollectiveMismatch"

    # PyTorch's analyzer, as a subprocess on the directory
    report = torchfrtrace(directory, subprocess_run=True)
    assert f"Collective sequence number: {_SEQ} has errors" in report, report
    blamed = {int(r) for r in re.findall(r"Culprit rank (\d+)", report)}
    if analyzer_order(directory)[0] != _SKIPPER:  # the reference made the agreed calls
        assert blamed == {_SKIPPER}, report
        assert "found collective type: 'all_gather'" in report, report
    else:  # rank 2 is the reference: the analyzer blames the others
        assert blamed == {0, 1, 3}, report
        assert "Expected collective type: 'all_gather'" in report, report

    # groupcoord trace: the majority names rank 2 whatever the file order
    result = analysis.analyze(directory)
    (group,) = [g for g in result["groups"] if g["name"] == outs[0]["group"]]
    mismatch = group["first_mismatch"]
    assert mismatch["seq"] == _SEQ and mismatch["culprits"] == [_SKIPPER], result
    assert not mismatch["tie"]
    ops = {c["rank"]: c["op"] for c in mismatch["calls"]}
    assert ops == {0: "all_reduce", 1: "all_reduce", 2: "all_gather", 3: "all_reduce"}, ops
    assert cli_main(["trace", directory]) == 1  # the table; exit 1: a mismatch
    table = capsys.readouterr().out
    assert "all_reduce" in table and "culprit" in table.lower(), table
