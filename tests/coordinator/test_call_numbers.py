"""Ranks out of step never pair different calls of the group.

Every collective of a ``GroupCoordinator`` carries the group's call number
into its communicator (``DeviceCommunicator.number_calls``), and the
shared-memory steps and gloo envelopes compare it beside the call's
signature. Once one rank's call never reached the communicator -- it skipped
a call, or its broadcast went through the TP queue while its peers' went
through the communicator -- its next call would otherwise meet the peers'
previous one of the same kind and return a sum of two different calls. Each
case here checks that every later call either returns the right value or
raises, on every transport.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

_TIMEOUT = 2.0


def _group(rank: int, world_size: int, transport: str, name: str) -> Any:
    from coordinator import GroupCoordinator

    saved = os.environ.get("GROUPCOORD_CPU_SHM")
    os.environ["GROUPCOORD_CPU_SHM"] = "1" if transport == "shm" else "0"
    try:
        return GroupCoordinator([list(range(world_size))], rank, "gloo", True, True,
                                group_name=name, timeout=_TIMEOUT)
    finally:
        if saved is None:
            os.environ.pop("GROUPCOORD_CPU_SHM", None)
        else:
            os.environ["GROUPCOORD_CPU_SHM"] = saved


def _sums(g: Any, rank: int, world_size: int, n: int) -> list[str]:
    """``n`` all_reduces whose right answers differ; each: 'ok', 'WRONG ...' or the error."""
    from coordinator.errors import GroupCoordError

    out = []
    for k in range(n):
        scale = 10.0 ** k
        want = scale * sum(r + 1 for r in range(world_size))
        try:
            got = g.all_reduce(torch.full((4,), scale * (rank + 1)))
            out.append("ok" if torch.equal(got, torch.full((4,), want)) else
                       f"WRONG {got[0].item()} for {want}")
        except GroupCoordError as e:
            out.append(type(e).__name__)
    return out


def bad_source_on_one_rank(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    """The others broadcast from rank 1 (through the communicator); the last rank
    names a source outside the group and raises ValueError. Then three all_reduces."""
    from coordinator.errors import GroupCoordError

    g = _group(rank, world_size, transport, f"badsrc-{transport}")
    try:
        g.all_reduce(torch.ones(4))
        src = world_size + 5 if rank == world_size - 1 else 1
        try:
            g.broadcast_tensor_dict({"x": torch.arange(3.0)} if rank == 1 else None, src)
            first = "returned"
        except (GroupCoordError, ValueError) as e:
            first = type(e).__name__
        return {"rank": rank, "results": [first] + _sums(g, rank, world_size, 3)}
    finally:
        g.destroy()


def routed_apart(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    """Rank 0 broadcasts from itself (the TP queue's writer); the others name
    rank 1 as the source (through the communicator). Then three all_reduces."""
    from coordinator.errors import GroupCoordError

    g = _group(rank, world_size, transport, f"apart-{transport}")
    try:
        g.all_reduce(torch.ones(4))
        src = 0 if rank == 0 else 1
        try:
            g.broadcast_tensor_dict({"x": torch.arange(3.0)} if rank == src else None, src)
            first = "returned"
        except GroupCoordError as e:
            first = type(e).__name__
        return {"rank": rank, "results": [first] + _sums(g, rank, world_size, 3)}
    finally:
        g.destroy()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_rank_that_refused_a_broadcast_never_gets_a_sum_of_other_calls(
        dist_pool, world_size: int, transport: str) -> None:
    outs = dist_pool(world_size).run(bad_source_on_one_rank, transport)
    for o in outs:
        assert not any(r.startswith("WRONG") for r in o["results"]), outs
    assert outs[-1]["results"][0] == "ValueError", outs


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_broadcasts_routed_apart_never_give_a_wrong_sum(dist_pool, world_size: int,
                                                        transport: str) -> None:
    outs = dist_pool(world_size).run(routed_apart, transport)
    for o in outs:
        assert not any(r.startswith("WRONG") for r in o["results"]), outs
    assert any(r == "CollectiveMismatch" for o in outs for r in o["results"]), outs
