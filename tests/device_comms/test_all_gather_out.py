"""``all_gather(x, dim, out=...)``: the gathered result in a tensor of the caller's.

The engine's small path (every piece fits a slot: one concatenation into
``out``), its row path (larger pieces gathered straight into ``out``) and gloo
(the base's gather-then-copy), at 2 and 3 ranks, along the first, a middle and
the last dimension: ``out`` holds bitwise what the same call returns as a new
tensor, ``out`` is what comes back, and ranks may mix the two forms in one
call. Bad ``out`` arguments raise the documented error on the rank that passed
them and a :class:`PeerRejectedError` on the others, after which the group
still works.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator
from device_comms.errors import PeerRejectedError

_WS_BYTES = 64 << 10  # small slots: 16 KiB pieces fit, 40 KiB ones take the row path


def _comm(mode: str) -> CpuCommunicator:
    kw: dict[str, Any] = {"use_shm": False} if mode == "gloo" else {"workspace_bytes": _WS_BYTES}
    return CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"ago-{mode}", **kw)


def _piece(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype).view(shape)


# (shape, dim): small (one slot), large (rows), along the first / a middle / the last dim
_CASES = [((5,), 0), ((3, 4, 5), 1), ((2, 2000), -1), ((10_000,), 0), ((4, 2500, 1), 1)]
_DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def gather_out_rank(rank: int, world_size: int, mode: str) -> list[str]:
    comm = _comm(mode)
    bad: list[str] = []
    try:
        for shape, dim in _CASES:
            for dtype in _DTYPES:
                x = _piece(rank, shape, dtype)
                want = torch.cat([_piece(r, shape, dtype) for r in range(world_size)], dim)
                out = torch.full_like(want, -1)
                got = comm.all_gather(x, dim, out=out)
                if got is not out or not torch.equal(out, want):
                    bad.append(f"{shape} dim {dim} {dtype}: out is wrong")
                # ranks mixing the forms in one call
                mixed = (comm.all_gather(x, dim) if rank % 2 else
                         comm.all_gather(x, dim, out=torch.empty_like(want)))
                if not torch.equal(mixed, want):
                    bad.append(f"{shape} dim {dim} {dtype}: mixed forms differ")
        return bad
    finally:
        comm.destroy()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_all_gather_into_out_equals_a_new_tensor(dist_pool: Any, world: int, mode: str) -> None:
    for rank, bad in enumerate(dist_pool(world).run(gather_out_rank, mode, timeout=80)):
        assert bad == [], f"rank {rank}: {bad}"


def _bad_out(name: str, x: torch.Tensor, world: int) -> Any:
    n = x.numel() * world
    return {
        "dtype": torch.empty(n, dtype=torch.float64),
        "shape": torch.empty(n + 1),
        "noncontig": torch.empty(2 * n)[::2],
        "overlap": torch.empty(0),  # made in bad_out_rank: the input inside the output
        "not-a-tensor": [0.0] * n,
    }[name]


_BAD = {"dtype": TypeError, "shape": ValueError, "noncontig": ValueError,
        "overlap": ValueError, "not-a-tensor": TypeError}


def bad_out_rank(rank: int, world_size: int, name: str) -> tuple[str, str, bool]:
    comm = _comm("shm")
    try:
        x = torch.ones(8) * rank
        out = _bad_out(name, x, world_size) if rank == 1 else torch.empty(8 * world_size)
        if name == "overlap" and rank == 1:  # torch.distributed allows it; out= does not
            out = torch.empty(8 * world_size)
            x = out[8:16].fill_(rank)
        try:
            comm.all_gather(x, 0, out=out)
            kind, text = "returned", ""
        except Exception as e:
            kind, text = type(e).__name__, str(e)
        after = comm.all_gather(torch.full((2,), float(rank)), 0)
        ok = after.tolist() == [float(r) for r in range(world_size) for _ in range(2)]
        return kind, text, ok
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(_BAD))
def test_a_bad_out_raises_there_and_peers_are_told(dist_pool: Any, name: str) -> None:
    results = dist_pool(2).run(bad_out_rank, name, timeout=50)
    kind, text, ok = results[1]
    assert kind == _BAD[name].__name__ and "out" in text, (kind, text)
    assert results[0][0] == PeerRejectedError.__name__, results[0]
    assert all(r[2] for r in results), "the group must work after a rejected call"
