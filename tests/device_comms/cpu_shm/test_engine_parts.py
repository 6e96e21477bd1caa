"""Each part of the shared-memory engine built alone over a real workspace.

Every rank maps a real workspace (``open_workspace``) and builds one
:class:`~device_comms.cpu_shm.context.EngineContext` and one part over it, with
no engine and no communicator: the one-step all_reduce (``SmallAllReduce``),
the two-rank pipelined all_reduce (``PairAllReduce``), the gathers
(``ShmGathers``) and the all-to-all-v (``ShmAllToAllv``). Results are compared
with a reference computed locally from every rank's inputs. The address-view
cache (``AddressViews``) is checked in one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from device_comms import ReduceOp, reduce_local
from device_comms.cpu_shm.address_views import NULL_PAGE, AddressViews
from device_comms.cpu_shm.alltoallv import ShmAllToAllv
from device_comms.cpu_shm.context import EngineContext, shape_key, signature
from device_comms.cpu_shm.gather import ShmGathers
from device_comms.cpu_shm.pair import PairAllReduce
from device_comms.cpu_shm.small import KEPT_ENTRIES, SmallAllReduce
from device_comms.cpu_shm.sync import StepSync
from device_comms.cpu_shm.workspace import WorkspacePlan, open_workspace

pytestmark = pytest.mark.timeout(120)


def _context(rank: int, world_size: int, name: str, total_bytes: int) -> EngineContext:
    """A context over a fresh workspace shared by every rank (one node)."""
    plan = WorkspacePlan.from_nodes([0] * world_size, rank)
    ws, pids, err = open_workspace(dist.group.WORLD, plan, total_bytes)
    assert err is None and ws is not None, err
    sync = StepSync(ws, name, plan.local_ranks, pids, 60.0)
    return EngineContext(ws, sync, threads=1)


def _operand(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers: exact in every dtype, so any reduction order gives the same bits."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


def small_part_rank(rank: int, world_size: int) -> list[str]:
    ctx = _context(rank, world_size, "part-small", 1 << 20)
    small = SmallAllReduce(ctx)
    bad: list[str] = []
    cases = [((256,), torch.float32, ReduceOp.SUM), ((16, 8), torch.int64, ReduceOp.MAX),
             ((100,), torch.bfloat16, ReduceOp.AVG), ((12_288,), torch.float32, ReduceOp.SUM)]
    try:
        for seed, (shape, dtype, op) in enumerate(cases):
            buf = torch.empty(shape, dtype=dtype)  # one address again and again: views kick in
            for call in range(4):
                inputs = [_operand(seed * 10 + call, r, shape, dtype) for r in range(world_size)]
                buf.copy_(inputs[rank])
                entry = small.last
                if op is not entry.op or dtype is not entry.dtype or buf.shape != entry.shape:
                    entry = small.remember(buf, op)
                form = ("new", "in-place", "out", "new")[call]
                if form == "new":
                    got = small.run(buf, entry)
                elif form == "in-place":
                    got = small.run(buf, entry, buf).clone()
                else:
                    got = small.run(buf, entry, torch.empty(shape, dtype=dtype))
                want = reduce_local(inputs, op)
                if not torch.equal(got, want):
                    bad.append(f"{dtype} {shape} {op.name} call {call} ({form})")
        if small.last.into_peer != (world_size == 2):  # 48 KiB: into the peer's slot
            bad.append(f"into_peer is {small.last.into_peer} with {world_size} ranks")
    finally:
        small.close()
        ctx.close()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_all_reduce_part_alone(dist_pool: Any, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(small_part_rank, timeout=100)):
        assert bad == [], f"rank {rank}: {bad}"


def kept_entries_rank(rank: int, world_size: int) -> list[str]:
    """Layouts used in turn keep their entries, up to ``KEPT_ENTRIES``, oldest out first."""
    ctx = _context(rank, world_size, "part-kept", 1 << 20)
    small = SmallAllReduce(ctx)
    bad: list[str] = []
    layouts = [((256,), torch.float32, ReduceOp.SUM), ((512,), torch.float32, ReduceOp.SUM),
               ((4, 64), torch.float32, ReduceOp.SUM), ((256,), torch.bfloat16, ReduceOp.SUM),
               ((256,), torch.float32, ReduceOp.MAX), ((12_288,), torch.float32, ReduceOp.SUM)]
    try:
        made: dict[int, Any] = {}
        for call in range(4 * len(layouts)):  # in turn: every call misses the last entry
            i = call % len(layouts)
            shape, dtype, op = layouts[i]
            inputs = [_operand(call, r, shape, dtype) for r in range(world_size)]
            entry = small.find(op, dtype, torch.Size(shape))
            if i in made and entry is not made[i]:
                bad.append(f"call {call}: the entry of {shape} {dtype} {op.name} was not kept")
            if not entry.plain:
                entry = small.remember(inputs[rank], op)
            made.setdefault(i, entry)
            if small.last is not entry:
                bad.append(f"call {call}: last is not the entry used")
            got = small.run(inputs[rank].clone(), entry)
            if not torch.equal(got, reduce_local(inputs, op)):
                bad.append(f"call {call}: {shape} {dtype} {op.name} wrong")
        for extra in range(KEPT_ENTRIES):  # as many new layouts: the six above go, oldest first
            small.remember(torch.zeros(1000 + extra), ReduceOp.SUM)
            over = len(layouts) + extra + 1 - KEPT_ENTRIES
            gone = [i for i, (shape, dtype, op) in enumerate(layouts)
                    if not small.find(op, dtype, torch.Size(shape)).plain]
            if gone != list(range(min(len(layouts), max(0, over)))):
                bad.append(f"after {extra + 1} new layouts the gone ones are {gone}")
                break
        small.close()
        if small.find(ReduceOp.SUM, torch.float32, torch.Size((1000,))).plain:
            bad.append("close kept an entry")
    finally:
        small.close()
        ctx.close()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_all_reduce_keeps_entries(dist_pool: Any, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(kept_entries_rank, timeout=100)):
        assert bad == [], f"rank {rank}: {bad}"


def pair_part_rank(rank: int, world_size: int) -> list[str]:
    ctx = _context(rank, world_size, "part-pair", 256 << 10)
    bad: list[str] = []
    try:
        if world_size != 2:
            try:
                PairAllReduce(ctx)
                bad.append("built over more than two ranks")
            except ValueError:
                pass
            return bad
        pair = PairAllReduce(ctx, piece_bytes=12_288 + 64,  # odd halves, several pieces
                             torch_piece_bytes=12_288 + 64)
        for seed, (count, dtype, op) in enumerate([(100_003, torch.float32, ReduceOp.SUM),
                                                   (40_001, torch.int64, ReduceOp.MAX),
                                                   (70_000, torch.bfloat16, ReduceOp.AVG)]):
            inputs = [_operand(seed, r, (count,), dtype) for r in range(world_size)]
            signed = (signature("all_reduce", dtype, op), shape_key(inputs[rank].shape))
            got = pair.all_reduce(inputs[rank].clone(), op, signed, None)
            mine = inputs[rank].clone()
            in_place = pair.all_reduce(mine, op, signed, mine)
            want = reduce_local(inputs, op)
            if not (torch.equal(got, want) and torch.equal(in_place, want)):
                bad.append(f"{dtype} n={count} {op.name}")
        pair.close()
    finally:
        ctx.close()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_pair_all_reduce_part_alone(dist_pool: Any, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(pair_part_rank, timeout=100)):
        assert bad == [], f"rank {rank}: {bad}"


def gathers_part_rank(rank: int, world_size: int) -> list[str]:
    ctx = _context(rank, world_size, "part-gather", 64 << 10)
    gathers = ShmGathers(ctx)
    bad: list[str] = []
    try:
        mine = _operand(1, rank, (3, 5), torch.float32)
        every = [_operand(1, r, (3, 5), torch.float32) for r in range(world_size)]
        got = gathers.all_gather_cat(mine, 1)
        if got is None or not torch.equal(got, torch.cat(every, 1)):
            bad.append("all_gather_cat")
        rooted = gathers.all_gather_cat(mine, 0, "gather", 1, 15)
        if (rooted is not None) != (rank == 1) or (rank == 1 and rooted is not None
                                                   and not torch.equal(rooted, torch.cat(every))):
            bad.append("gather to rank 1")
        shapes = [torch.Size((r + 1, 4)) for r in range(world_size)]
        uneven = [_operand(2, r, tuple(shapes[r]), torch.int32) for r in range(world_size)]
        if not torch.equal(gathers.gatherv_cat(uneven[rank], shapes, 0, 7), torch.cat(uneven)):
            bad.append("gatherv_cat")
        # Rows wider than a slot (64 KiB of data: slots of 16 KiB for 2 ranks, 8 KiB for 3):
        # every row goes in column pieces.
        widths = [5000 + 7 * r for r in range(world_size)]
        pieces = [_operand(3, r, (2, widths[r]), torch.float32) for r in range(world_size)]
        out2 = torch.empty(2, sum(widths))
        gathers.gather_rows(pieces[rank], widths, out2, "all_gather", 11)
        if not torch.equal(out2, torch.cat(pieces, 1)):
            bad.append("gather_rows")
    finally:
        ctx.close()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_gathers_part_alone(dist_pool: Any, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(gathers_part_rank, timeout=100)):
        assert bad == [], f"rank {rank}: {bad}"


def alltoallv_part_rank(rank: int, world_size: int) -> list[str]:
    ctx = _context(rank, world_size, "part-a2av", 64 << 10)
    part = ShmAllToAllv(ctx)
    bad: list[str] = []
    try:
        if not part.fits:
            return ["the size record does not fit a slot"]
        # Rank r sends (r + q + 1) * 500 rows of 4 floats to rank q: several windows.
        send_of = [[(r + q + 1) * 500 for q in range(world_size)] for r in range(world_size)]
        rows = [torch.full((sum(send_of[r]), 4), float(r)) + torch.arange(sum(send_of[r]))[:, None]
                for r in range(world_size)]
        got = part.all_to_allv(rows[rank], send_of[rank], None)
        want = torch.cat([rows[r][sum(send_of[r][:rank]) : sum(send_of[r][: rank + 1])]
                          for r in range(world_size)])
        if not torch.equal(got, want):
            bad.append("all_to_allv")
        part.close()
    finally:
        ctx.close()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_alltoallv_part_alone(dist_pool: Any, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(alltoallv_part_rank, timeout=100)):
        assert bad == [], f"rank {rank}: {bad}"


def test_address_views_made_on_the_second_sighting_only_for_matching_tensors() -> None:
    x = torch.arange(8, dtype=torch.float32)
    views = AddressViews(x, np.dtype(np.float32), limit=2)
    address = x.data_ptr()
    assert views.get(address) is None
    assert views.sight(x, address) is None  # first sighting: nothing made
    made = views.sight(x, address)
    assert made is not None and views.get(address) is made and len(views) == 1
    raw, typed = made
    assert raw.nbytes == x.nbytes and typed.shape == (8,)
    x.add_(1)  # the views see the bytes as they are now
    assert typed.tolist() == x.tolist()
    x.resize_(64)  # the views own nothing: the caller's storage stays growable
    other = torch.zeros(8)
    assert views.sight(other, NULL_PAGE - 8) is None  # no memory down there
    for wrong in (torch.zeros(4), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2]):
        views.sight(wrong, wrong.data_ptr())
        assert views.sight(wrong, wrong.data_ptr()) is None  # not this shape, dtype, layout
    views.sight(other, other.data_ptr() + 4)
    assert views.sight(other, other.data_ptr() + 4) is None  # not where the tensor starts
    extra = [torch.zeros(8) for _ in range(3)]
    for t in extra:  # more addresses than the limit: the cache starts over, bounded
        views.sight(t, t.data_ptr())
        views.sight(t, t.data_ptr())
    assert len(views) <= 2
