"""all_reduce one element either side of every path's threshold, bitwise against the reference.

The engine picks its scheme by size: the one-step path up to
:data:`~device_comms.cpu_shm.engine_threads.GRAIN` elements (two ranks: into the
peer's slot from :data:`~device_comms.cpu_shm.small.PAIR_SMALL_MIN_BYTES`, torch's
reductions from :data:`~device_comms.cpu_shm.small.PAIR_TORCH_INTO_PEER_MIN_BYTES` up to
:data:`~device_comms.cpu_shm.small.PAIR_TORCH_INTO_PEER_MAX_BYTES`), then
one step per slot, one shot in slot-sized pieces up to the one-shot bytes,
the pipelined pair scheme (pieces of :data:`DEFAULT_PAIR_PIECE_BYTES`, or
:data:`DEFAULT_PAIR_TORCH_PIECE_BYTES` for torch's reductions) or
reduce-scatter + all-gather. Each size below is ``threshold - 1``,
``threshold`` and ``threshold + 1`` elements of every dtype (odd counts, not
divisible by the world size), as a new tensor, in place and into an ``out``
view with a storage offset; results must equal :func:`reduce_local` of every
rank's inputs bit for bit (the engine reduces in rank order too) and leave the
input untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.cpu_shm.engine import DEFAULT_ONESHOT_BYTES, PAIR_ONE_STEP_MAX_BYTES
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.cpu_shm.pair import DEFAULT_PAIR_PIECE_BYTES, DEFAULT_PAIR_TORCH_PIECE_BYTES
from device_comms.cpu_shm.small import (
    PAIR_SMALL_MIN_BYTES,
    PAIR_TORCH_INTO_PEER_MAX_BYTES,
    PAIR_TORCH_INTO_PEER_MIN_BYTES,
)

_DTYPES = ("int8", "uint8", "bool", "complex64", "float16", "bfloat16", "float64", "float32",
           "int32", "int64")


def _ops(dt: torch.dtype) -> list[ReduceOp]:
    if dt == torch.bool:
        return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.BXOR]
    if dt.is_complex:
        return [ReduceOp.SUM, ReduceOp.AVG]
    if dt.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
    return [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BXOR]


def _make(seed: int, rank: int, n: int, dt: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dt == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dt.is_complex:
        return torch.randn(n, generator=g, dtype=dt)
    if dt.is_floating_point:
        return (torch.randn(n, generator=g) * 2).to(dt)
    return torch.randint(0 if dt == torch.uint8 else -3, 4, (n,), generator=g, dtype=dt)


def _sizes(dt: torch.dtype, slot: int, world_size: int) -> list[int]:
    """Element counts around every threshold (the same on every rank)."""
    isz = dt.itemsize
    edges = [GRAIN * isz, slot, DEFAULT_ONESHOT_BYTES, DEFAULT_PAIR_PIECE_BYTES,
             DEFAULT_PAIR_TORCH_PIECE_BYTES]
    if world_size == 2:
        edges += [PAIR_SMALL_MIN_BYTES, PAIR_TORCH_INTO_PEER_MIN_BYTES,
                  PAIR_TORCH_INTO_PEER_MAX_BYTES, PAIR_ONE_STEP_MAX_BYTES]
    counts = {1, 7, 1001}
    for e in edges:
        counts |= {e // isz - 1, e // isz, e // isz + 1}
    return sorted(counts)


def threshold_rank(rank: int, world_size: int, dnames: list[str]) -> list[tuple[Any, ...]]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="thresholds",
                           timeout=60)
    slot = comm._flat.ws.slot_bytes
    bad: list[tuple[Any, ...]] = []
    seed = 0
    try:
        for dt in (getattr(torch, d) for d in dnames):
            for n in _sizes(dt, slot, world_size):
                big = n * dt.itemsize > (64 << 10)
                for op in _ops(dt):
                    if big and op not in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
                        continue  # the large paths share one reduction per op: keep it cheap
                    seed += 1
                    xs = [_make(seed, r, n, dt) for r in range(world_size)]
                    ref = reduce_local(xs, op)
                    for form in ("new", "in-place", "out-offset"):
                        x = xs[rank].clone()
                        if form == "new":
                            got = comm.all_reduce(x, op)
                        elif form == "in-place":
                            got = comm.all_reduce(x, op, out=x)
                        else:
                            got = comm.all_reduce(x, op, out=torch.empty(n + 3, dtype=dt)[3:])
                        if not torch.equal(got, ref):
                            wrong = (got != ref).nonzero().flatten()
                            bad.append((str(dt), n, op.name, form, wrong[:3].tolist(), len(wrong)))
                        if form != "in-place" and not torch.equal(x, xs[rank]):
                            bad.append((str(dt), n, op.name, form, "input modified"))
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow),
                                        pytest.param(5, marks=pytest.mark.slow)])
def test_sizes_around_every_threshold(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(threshold_rank, list(_DTYPES), timeout=290)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {len(bad)} wrong, first {bad[:5]}"
