"""torch's sub-byte dtypes (``torch.uint4``, ``torch.int2``...): one element per byte,
no copy kernel.

Point-to-point calls and all_to_allv move their bytes by address and carry
them exactly (a non-contiguous tensor is copied through its bytes). The
collectives whose transports copy with torch (all_gather, gather, broadcast,
scatter, all_to_all, all_gatherv) refuse them before any step, with a
TypeError naming the argument on the rank that passed one and the peers'
rejection elsewhere; reductions refuse them for want of arithmetic. Before,
they failed inside the collective (``NotImplementedError: copy_kernel``) on
some ranks while the others waited for their timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator
from shm_broadcast.errors import PeerRejectedError


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).contiguous()


def _mine(rank: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """``rows x 4`` elements of ``dtype`` that differ by rank (values 0-15 per byte)."""
    raw = (torch.arange(rows * 4, dtype=torch.uint8) * 3 + rank) % 16
    return raw.reshape(rows, 4).view(dtype)


def sub_byte_rank(rank: int, world_size: int, mode: str, dtype_name: str) -> list[str]:
    dtype = getattr(torch, dtype_name)
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"),
                           unique_name=f"sub-byte-{dtype_name}", use_shm=mode == "shm")
    n, bad = world_size, []

    def same(name: str, got: Any, want: torch.Tensor) -> None:
        if not isinstance(got, torch.Tensor) or got.dtype != dtype or got.shape != want.shape \
                or not torch.equal(_bytes(got), _bytes(want)):
            bad.append(f"{name}: got {getattr(got, 'dtype', got)} "
                       f"{tuple(getattr(got, 'shape', ()))}, want {dtype} {tuple(want.shape)}")

    def refused(name: str, call: Any, mine: bool = True) -> None:
        """``call`` raises a TypeError naming input_ and the dtype (``mine``: this rank
        passed the tensor), else the peers' rejection quoting it."""
        try:
            call()
            bad.append(f"{name}: accepted")
        except Exception as e:
            kind = TypeError if mine else PeerRejectedError
            if type(e) is not kind or dtype_name not in str(e) or "input_" not in str(e):
                bad.append(f"{name}: {type(e).__name__}: {e}")

    try:
        x = _mine(rank, dtype, 2 * n)
        every = [_mine(r, dtype, 2 * n) for r in range(n)]
        refused("all_gather", lambda: comm.all_gather(x.t(), 0))
        refused("gather", lambda: comm.gather(x, 0, 0))
        rows = [2] * n  # two rows to every rank
        got = comm.all_to_allv(x, rows, rows)
        same("all_to_allv", got, torch.cat(
            [every[r].view(torch.uint8)[2 * rank:2 * rank + 2] for r in range(n)]).view(dtype))
        if n > 1:
            if rank == 0:
                comm.send(x.t(), 1)
            elif rank == 1:
                same("send/recv", comm.recv((4, 2 * n), dtype, 0), every[0].t())
        refused("broadcast", lambda: comm.broadcast(x, 0))
        refused("scatter", lambda: comm.scatter(x if rank == 0 else None, 0, 0),
                mine=rank == 0)  # only the source passes a tensor
        refused("all_to_all", lambda: comm.all_to_all(x, 0, 0))
        refused("all_gatherv", lambda: comm.all_gatherv(x, 0, [2 * n] * n))
        try:
            comm.all_reduce(x)
            bad.append("all_reduce: accepted")
        except TypeError as e:
            if "op=ReduceOp.SUM" not in str(e):
                bad.append(f"all_reduce: {e}")
        # the communicator still works
        if not torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(n))):
            bad.append("all_reduce after the refusals")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("mode", ["shm", "gloo"])
@pytest.mark.parametrize("dtype_name", ["uint4", "int2"])
def test_sub_byte_tensors_move_exactly_or_are_refused_everywhere(
        dist_pool: Any, dtype_name: str, mode: str, world_size: int) -> None:
    if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
        pytest.skip(f"this torch has no torch.{dtype_name}")
    results = dist_pool(world_size).run(sub_byte_rank, mode, dtype_name, timeout=80)
    assert results == [[]] * world_size
