"""groupcoord groups over some ranks of the world: roots and peers are global
ranks in torch's calls and group ranks in ours; a one-rank group answers alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.coordinator.torch_backend.cases import inp


def _ops(pg: Any, rank: int, first: int, last: int) -> list[torch.Tensor]:
    """A few rooted and point-to-point calls on a group whose global ranks run
    from ``first`` to ``last``."""
    n = last - first + 1
    b = inp((3,), torch.float32, rank)
    dist.broadcast(b, src=last, group=pg)
    r = inp((2, 2), torch.int64, rank)
    dist.reduce(r, dst=last, op=dist.ReduceOp.MAX, group=pg)
    g = [torch.zeros(2) for _ in range(n)] if rank == first else None
    dist.gather(inp((2,), torch.float32, rank), g, dst=first, group=pg)
    s = torch.zeros(2)
    dist.scatter(s, [inp((2,), torch.float32, j, 1) for j in range(n)] if rank == last else None,
                 src=last, group=pg)
    outs = [torch.zeros(3) for _ in range(n)]
    dist.all_gather(outs, inp((3,), torch.float32, rank), group=pg)
    p = torch.zeros(2)
    if n > 1:
        if rank == first:
            dist.send(inp((2,), torch.float32, rank, 2), last, group=pg)
        elif rank == last:
            dist.recv(p, first, group=pg)
    return [b, *([r] if rank == last else []), *(g or []), s, *outs, p]


def _subgroups(rank: int, world: int) -> dict[str, Any]:
    import coordinator  # noqa: F401 - registers the backend

    out: dict[str, Any] = {}
    for first, last in ((1, world - 1), (0, 0)):
        ranks = list(range(first, last + 1))
        gc = dist.new_group(ranks, backend="groupcoord")
        gl = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            got, want = _ops(gc, rank, first, last), _ops(gl, rank, first, last)
            out[f"{first}-{last}"] = all(torch.equal(a, b)
                                         for a, b in zip(got, want, strict=True))
            out[f"{first}-{last} mode"] = gc.communicator.mode
        dist.destroy_process_group(gc)
        dist.destroy_process_group(gl)
    return out


def test_subgroups_equal_gloo(dist_pool: Callable[[int], Any]) -> None:
    results = dist_pool(3).run(_subgroups, timeout=60)
    assert results[0] == {"0-0": True, "0-0 mode": "gloo"}  # one rank: nothing to share
    for r in results[1:]:
        assert r == {"1-2": True, "1-2 mode": "shm"}
