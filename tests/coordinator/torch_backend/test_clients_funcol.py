"""Functional collectives on the groupcoord backend equal gloo's, eager and compiled.

``torch.distributed._functional_collectives`` (what DTensor and compiled
models call) run ``all_reduce``, ``all_gather_tensor``,
``reduce_scatter_tensor`` and ``all_to_all_single`` (uneven splits) over a
process group of the backend under test and over a gloo group of the same
ranks, first eagerly, then inside one function compiled by ``torch.compile``
(``aot_eager`` in CI: dynamo traces the collectives into the graph; the
``slow`` test compiles with inductor, which lowers them to its own kernels and
waits). Inputs hold small integers in float32, so sums are exact in any order
and the results must be bitwise equal.
"""

from __future__ import annotations

from typing import Any

import pytest

#: The backend whose results are compared with gloo's.
UNDER_TEST = "groupcoord"


def _splits(world_size: int, rank: int) -> tuple[list[int], list[int]]:
    """Uneven all-to-all splits: rank ``r`` sends ``r + j + 1`` rows to rank ``j``."""
    send = [rank + j + 1 for j in range(world_size)]
    recv = [j + rank + 1 for j in range(world_size)]
    return send, recv


def _collectives(x: Any, group: Any, send: list[int], recv: list[int]) -> tuple[Any, ...]:
    """The four functional collectives on ``x`` (rows of 3), as a compiled model calls them."""
    import torch.distributed._functional_collectives as funcol

    total = sum(send)
    return (
        funcol.all_reduce(x * 2, "sum", group),
        funcol.all_gather_tensor(x, 0, group),
        funcol.reduce_scatter_tensor(x, "sum", 0, group),
        funcol.all_to_all_single(x[:total] + 1, recv, send, group),
    )


def funcol_rank(rank: int, world_size: int, compile_backend: str | None) -> dict[str, Any]:
    """On every rank: the collectives on both groups (eager, or compiled with
    ``compile_backend``); how they compare."""
    import torch
    import torch.distributed as dist

    import coordinator  # noqa: F401  registers the groupcoord backend

    send, recv = _splits(world_size, rank)
    # the same shape on every rank (as all_reduce needs), room for the largest send
    rows = max(sum(_splits(world_size, r)[0]) for r in range(world_size))
    rows += -rows % world_size  # reduce_scatter splits dim 0 evenly
    x = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) % 17 + rank
    fn = _collectives
    if compile_backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(_collectives, backend=compile_backend, fullgraph=True)
    under_test = dist.new_group(backend=UNDER_TEST)
    gloo = dist.new_group(backend="gloo")
    try:
        ours = [t.clone() for t in fn(x, under_test, send, recv)]
        theirs = [t.clone() for t in fn(x, gloo, send, recv)]
    finally:
        dist.destroy_process_group(under_test)
        dist.destroy_process_group(gloo)
    names = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single")
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: {a} != {b}"
    # and the values are the right ones, not just the same ones
    assert torch.equal(ours[0], 2 * sum(x - rank + r for r in range(world_size)))
    assert ours[3].shape == (sum(recv), 3)
    return {name: tuple(t.shape) for name, t in zip(names, ours, strict=True)}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_functional_collectives_equal_gloo(dist_pool: Any, world_size: int,
                                           compile_backend: str | None) -> None:
    results = dist_pool(world_size).run(funcol_rank, compile_backend, timeout=120)
    assert results[0]["all_gather_tensor"][0] == world_size * results[0]["all_reduce"][0]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_functional_collectives_under_inductor_equal_gloo(dist_pool: Any,
                                                          world_size: int) -> None:
    dist_pool(world_size).run(funcol_rank, "inductor", timeout=600)
