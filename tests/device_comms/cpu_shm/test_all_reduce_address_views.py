"""The one-step all_reduce's views of caller memory by address never serve stale bytes.

From the second call at an address, the engine copies a small all_reduce's
input (and writes an ``out``) through numpy views of that address instead of
``ctypes.memmove`` (``AddressViews``). The views own nothing, so
every pattern below reuses addresses under changing contents and owners:
fresh tensors whose freed blocks the allocator hands back, one tensor reduced
in place again and again, a persistent ``out`` buffer, rows of one buffer at
different offsets, more buffers than the entry keeps views for, and a tensor
whose storage is swapped or freed between calls. Each result is compared with
the reduction of every rank's inputs computed locally, for a numpy sum, a
torch reduction and a dtype numpy lacks, at 1 KiB and at a size where two
ranks reduce into each other's slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local

_ROUNDS = 40  # more than the entry's view budget (16) and its sighting set


def _inputs(i: int, world_size: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Call ``i``'s operand of every rank: small integers, exact in every dtype."""
    return [((torch.arange(numel) * (r + 1) + 7 * i + r) % 13 - 6).to(dtype)
            for r in range(world_size)]


def _fresh(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    return comm.all_reduce(mine.clone(), op)  # the clone dies after the call: its block returns


def _in_place(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    x = held.setdefault("x", torch.empty_like(mine))
    x.copy_(mine)
    got = comm.all_reduce(x, op, out=x)
    return got.clone()


def _persistent_out(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    dst = held.setdefault("out", torch.empty_like(mine))
    return comm.all_reduce(mine.clone(), op, out=dst).clone()


def _rows(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    buf = held.setdefault("rows", torch.zeros(3, mine.numel(), dtype=mine.dtype))
    row = buf[i % 3]
    row.copy_(mine)
    if i % 2:
        return comm.all_reduce(row, op, out=row).clone()
    return comm.all_reduce(row, op)


def _many(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    bufs = held.setdefault("bufs", [torch.empty_like(mine) for _ in range(20)])
    b = bufs[i % len(bufs)]
    b.copy_(mine)
    return comm.all_reduce(b, op, out=b if i % 3 == 0 else None).clone()


def _swapped(
    comm: Any, i: int, mine: torch.Tensor, op: ReduceOp, held: dict[str, Any]
) -> torch.Tensor:
    x = held.setdefault("x", torch.empty_like(mine))
    if i % 2:
        x.set_(torch.empty_like(mine))  # new storage, maybe at a freed block's address
    else:
        x.untyped_storage().resize_(0)  # frees the block under the same tensor object
        x.set_(torch.empty_like(mine))
    x.copy_(mine)
    return comm.all_reduce(x, op, out=x if i % 4 == 1 else None).clone()


_PATTERNS: dict[str, Callable[..., torch.Tensor]] = {
    "fresh": _fresh,
    "in-place": _in_place,
    "persistent-out": _persistent_out,
    "rows": _rows,
    "many-buffers": _many,
    "swapped-storage": _swapped,
}


def address_rank(rank: int, world_size: int, pattern: str, dname: str, nbytes: int,
                 opname: str) -> tuple[list[str], int]:
    dtype, op = getattr(torch, dname), getattr(ReduceOp, opname)
    numel = nbytes // dtype.itemsize
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"held-{pattern}")
    bad: list[str] = []
    state: dict[str, Any] = {}
    try:
        for i in range(_ROUNDS):
            inputs = _inputs(i, world_size, numel, dtype)
            got = _PATTERNS[pattern](comm, i, inputs[rank], op, state)
            ref = reduce_local(inputs, op)
            if not torch.equal(got, ref):
                wrong = (got != ref).nonzero().flatten()[:3].tolist()
                bad.append(f"call {i}: wrong at {wrong}")
        views = len(comm._flat.small.last.by_address) if comm._flat is not None else 0
    finally:
        comm.destroy()
    return bad, views


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("nbytes", [1024, 48 << 10], ids=["1KiB", "48KiB"])
@pytest.mark.parametrize("dname,opname", [("float32", "SUM"), ("int64", "MAX"),
                                          ("bfloat16", "SUM")])
@pytest.mark.parametrize("pattern", sorted(_PATTERNS))
def test_reused_addresses_give_current_values(
    dist_pool: Any, pattern: str, dname: str, opname: str, nbytes: int, world_size: int
) -> None:
    results = dist_pool(world_size).run(address_rank, pattern, dname, nbytes, opname,
                                        timeout=110)
    for rank, (bad, _) in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:3]}"
    if pattern in ("in-place", "persistent-out", "rows"):  # the views were used, not skipped
        assert all(views > 0 for _, views in results), results


def resizable_rank(rank: int, world_size: int, nbytes: int) -> list[str]:
    """Every call form leaves the caller's input and ``out`` storages growable."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="held-resize")
    bad: list[str] = []
    try:
        numel = nbytes // 4
        for form in ("new", "in-place", "out"):
            for _ in range(3):  # first sighting, second (views made), third (views used)
                x = torch.ones(numel)
                dst = torch.empty(numel)
                if form == "new":
                    comm.all_reduce(x)
                elif form == "in-place":
                    comm.all_reduce(x, out=x)
                else:
                    comm.all_reduce(x, out=dst)
                for name, t in (("input", x), ("out", dst)):
                    try:
                        t.resize_(2 * numel)
                    except RuntimeError as e:
                        bad.append(f"{form}: {name} no longer resizable: {e}")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("nbytes", [1024, 48 << 10, 1 << 20], ids=["1KiB", "48KiB", "1MiB"])
def test_caller_tensors_stay_resizable(dist_pool: Any, nbytes: int, world_size: int) -> None:
    results = dist_pool(world_size).run(resizable_rank, nbytes, timeout=80)
    assert results == [[]] * world_size
