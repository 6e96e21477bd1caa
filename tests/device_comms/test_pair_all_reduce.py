"""Two ranks: the one-step all_reduce into the peer's slot (``ShmEngine._pair_small``)
and the pipelined reduce-scatter + all-gather (``ShmEngine._pair_all_reduce``).

Every dtype, odd sizes and piece counts (one piece, several, a last half piece,
halves that are not whole cache lines); results bitwise equal to the reference
reduction in rank order on both ranks, also where the order shows (the maximum
of +0.0 and -0.0 is whichever operand comes first), and no result aliases the
workspace.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.engine_threads import GRAIN

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int8, torch.bool, torch.complex64)


def _ops(dtype: torch.dtype) -> tuple[ReduceOp, ...]:
    if dtype == torch.bool or dtype.is_complex:
        return (ReduceOp.SUM,)
    if dtype.is_floating_point:
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
    return (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR)


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(n, generator=g)
        x[::5] = 0.0 if rank == 0 else -0.0  # +0 on rank 0, -0 on rank 1: order-sensitive
        return x.to(dtype)
    return torch.randint(-3, 4, (n,), generator=g, dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` calls +0.0 and -0.0 equal)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def pair_rank(rank: int, world_size: int, piece: int) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="pair",
                           workspace_bytes=256 << 10, oneshot_bytes=1 << 30)
    eng = comm._engine
    assert eng is not None
    if piece:
        eng.pair_piece_bytes = piece
    lo, hi = eng.ws.slot_address(0, 0), eng.ws.slot_address(1, 1) + eng.ws.slot_bytes
    # One step in place (>= 32 KiB and within a 64 KiB slot for 2- and 4-byte types),
    # then pieces (beyond the slot or the torch grain).
    lengths = [9001, 16000, 16400, GRAIN + 1, GRAIN + 333, (eng.ws.slot_bytes // 2) + 1,
               3 * eng.ws.slot_bytes // 4 + 17, 2 * eng.ws.slot_bytes + 5]
    cases = [(d, n, op) for d in _DTYPES for n in lengths for op in _ops(d)]
    got = []
    for i, (dtype, n, op) in enumerate(cases):
        got.append(comm.all_reduce(_input(i, rank, n, dtype), op))
    aliased = [i for i, g in enumerate(got) if lo <= g.data_ptr() < hi]
    comm.destroy()
    bad = []
    for i, ((dtype, n, op), g) in enumerate(zip(cases, got)):
        want = reduce_local([_input(i, r, n, dtype) for r in range(world_size)], op)
        if not _same_bits(g, want):
            bad.append(f"{dtype} n={n} {op.name}")
    return {"bad": bad, "aliased": aliased, "n": len(cases),
            "bits": [g.view(-1)[:64].clone() for g in got]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("piece", [0, 4096, 12288 + 64, 200], ids=["default", "4KiB", "odd", "tiny"])
def test_pair_all_reduce_matches_reference(dist_pool: Any, piece: int) -> None:
    outs = dist_pool(2).run(pair_rank, piece, timeout=100)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: {o['bad'][:5]} of {o['n']}"
        assert o["aliased"] == [], "results must not be views of the workspace"
    for a, b in zip(outs[0]["bits"], outs[1]["bits"]):
        assert _same_bits(a, b), "both ranks must get the same bits"
