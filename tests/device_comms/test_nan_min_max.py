"""MIN/MAX reductions propagate every NaN, on every path, at every size.

The reference is :func:`device_comms.reduce_local` (``torch.minimum`` /
``torch.maximum``: NaN wins). gloo's own MIN/MAX keeps the other operand when
the incoming one is NaN, so without care a NaN on some ranks is lost above
the size the signed calls carry inline (4 KiB), depending on which rank held it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.torch_dist.torch_communicator import TorchDistributedCommunicator

#: inline in the signed call's block, then through the backend
_SIZES = [96, 3000]
_OPS = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatterv"]


def _input(rank: int, world_size: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.linspace(-2.0, 2.0, n, dtype=torch.float64).roll(rank * 5).to(dtype)
    x[rank * 7] = float("nan")  # a NaN of its own on each rank
    if rank == world_size - 1:
        x[0] = x[n - 1] = float("nan")  # and two only the last rank has
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


def _expected(call: str, rank: int, world_size: int, n: int, dtype: torch.dtype,
              op: ReduceOp, sizes: list[int]) -> torch.Tensor | None:
    full = reduce_local([_input(r, world_size, n, dtype) for r in range(world_size)], op)
    if call == "reduce":
        return full if rank == 0 else None
    if call == "all_reduce":
        return full
    if call == "reduce_scatter":
        sizes = [n // world_size] * world_size
    start = sum(sizes[:rank])
    return full[start : start + sizes[rank]]


def _call(comm, call: str, x: torch.Tensor, op: ReduceOp, sizes: list[int]):
    if call == "all_reduce":
        return comm.all_reduce(x, op)
    if call == "reduce":
        return comm.reduce(x, 0, op)
    if call == "reduce_scatter":
        return comm.reduce_scatter(x, 0, op)
    return comm.reduce_scatterv(x, 0, sizes, op)


def nan_rank(rank: int, world_size: int, kind: str) -> list[str]:
    cls = CpuCommunicator if kind == "cpu" else TorchDistributedCommunicator
    comm = cls(dist.group.WORLD, torch.device("cpu"), unique_name=f"nan-{kind}", timeout=30)
    bad: list[str] = []
    try:
        for n in _SIZES:
            n -= n % world_size  # reduce_scatter: an even split
            sizes = [n // world_size] * world_size
            sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
            for dtype in (torch.float32, torch.bfloat16):
                for op in (ReduceOp.MIN, ReduceOp.MAX):
                    for call in _OPS:
                        got = _call(comm, call, _input(rank, world_size, n, dtype), op, sizes)
                        want = _expected(call, rank, world_size, n, dtype, op, sizes)
                        if (got is None) != (want is None) or (
                                want is not None and not _same(got, want)):
                            bad.append(f"{call} {op.name} {dtype} n={n}")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["gloo", "cpu"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_min_max_keep_every_nan(dist_pool, world_size: int, kind: str) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(nan_rank, kind, timeout=150)):
        assert bad == [], f"rank {rank}: NaN lost in {bad}"
