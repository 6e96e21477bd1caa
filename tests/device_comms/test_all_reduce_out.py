"""``all_reduce(x, out=...)``: the result in place (``out=x``) or in a tensor of the caller's.

Every all_reduce scheme of the shared-memory engine (one small step, the
two-rank one-step and pipelined schemes, one shot in pieces, reduce-scatter +
all-gather), the hierarchical path (two ranks per simulated node; at 2 ranks
that is one node, the flat path) and gloo, at 2, 3 and 4 ranks, for every
dtype family: the result is bitwise the one the same call
returns as a new tensor (which on shared memory is bitwise the reference
reduction in rank order), ``out`` is what comes back, a separate ``out`` leaves
the input untouched, and ranks may mix the two forms in one call.
``GroupCoordinator.all_reduce`` passes ``out`` through (also at one rank and
for an ``out`` that requires grad), and a write into ``out`` counts as an
in-place op for autograd. Bad ``out`` arguments raise the documented error on the
rank that passed them and a :class:`PeerRejectedError` on the others, after which the
group still works.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.errors import PeerRejectedError

_WS_BYTES = 64 << 10  # small slots, so modest tensors take every scheme


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 13 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-5, 6, (n,), generator=g, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _agrees(got: torch.Tensor, ref: torch.Tensor, exact: bool) -> bool:
    """Bitwise (the engine reduces in rank order), or close where gloo's order differs."""
    if exact or not (ref.dtype.is_floating_point or ref.dtype.is_complex):
        return torch.equal(_bits(got), _bits(ref))
    tol = 2e-2 if ref.element_size() == 2 else 1e-5
    return torch.allclose(got, ref, rtol=tol, atol=tol)


def _comm(mode: str, rank: int) -> CpuCommunicator:
    kw: dict[str, Any] = {"workspace_bytes": _WS_BYTES, "oneshot_bytes": 24 << 10}
    if mode == "gloo":
        kw = {"use_shm": False}
    elif mode == "shm-wide":  # default workspace: one step beyond the torch grain
        kw = {}
    elif mode == "hier":  # two ranks per simulated node: the hierarchical path from 3 ranks
        kw["node_id"] = f"node{rank // 2}"
    return CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"out-{mode}", **kw)


_CASES = [(torch.float32, ReduceOp.SUM), (torch.bfloat16, ReduceOp.AVG),
          (torch.int64, ReduceOp.PRODUCT), (torch.float64, ReduceOp.MAX),
          (torch.bool, ReduceOp.SUM), (torch.complex64, ReduceOp.SUM), (torch.int8, ReduceOp.MAX)]
# one small step, one-step pair, a slot's worth, several pieces, odd lengths
_LENGTHS = [7, 1000, 9000, 40_001, 100_003]


def out_rank(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    comm = _comm(mode, rank)
    bad: list[str] = []
    try:
        for i, (dtype, op) in enumerate(_CASES):
            for n in _LENGTHS:
                shape = (n,) if n % 2 else (2, n // 2)
                ref = reduce_local([_input(i + n, r, n, dtype).view(shape)
                                    for r in range(world_size)], op)
                x = _input(i + n, rank, n, dtype).view(shape)
                want = comm.all_reduce(x, op)  # a new tensor, as without out
                if not _agrees(want, ref, exact=mode.startswith("shm")):
                    bad.append(f"new tensor {dtype} {op.name} n={n}")
                got = comm.all_reduce(x, op, out=x)
                if got is not x or not torch.equal(_bits(x), _bits(want)):
                    bad.append(f"in place {dtype} {op.name} n={n}")
                x = _input(i + n, rank, n, dtype).view(shape)
                keep = x.clone()
                dst = torch.full(shape, 3, dtype=dtype)
                got = comm.all_reduce(x, op, out=dst)
                if got is not dst or not torch.equal(_bits(dst), _bits(want)):
                    bad.append(f"separate out {dtype} {op.name} n={n}")
                if not torch.equal(_bits(x), _bits(keep)):
                    bad.append(f"input changed {dtype} {op.name} n={n}")
                # ranks mixing the forms in one call: rank 0 in place, the others not
                got = comm.all_reduce(x, op, out=x if rank == 0 else None)
                if not torch.equal(_bits(got), _bits(want)) or (rank == 0 and got is not x):
                    bad.append(f"mixed {dtype} {op.name} n={n}")
        for shape in [(0,), (3, 0), ()]:  # empty and 0-d
            x = torch.full(shape, float(rank + 1))
            got = comm.all_reduce(x, out=x)
            total = float(sum(range(1, world_size + 1)))
            if got is not x or not torch.equal(x, torch.full(shape, total)):
                bad.append(f"shape {shape}")
    finally:
        comm.destroy()
    return {"bad": bad}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["shm", "shm-wide", "hier", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_into_out(dist_pool: Any, world_size: int, mode: str) -> None:
    outs = dist_pool(world_size).run(out_rank, mode, timeout=140)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: {o['bad'][:6]}"


_BUF = 200


def _shifted(buf: torch.Tensor) -> torch.Tensor:
    return buf[1:65]


_BAD_OUT = {
    "dtype": (TypeError, lambda x, buf: torch.empty_like(x, dtype=torch.float64)),
    "shape": (ValueError, lambda x, buf: torch.empty(x.numel() + 1)),
    "strided": (ValueError, lambda x, buf: torch.empty(2 * x.numel())[::2]),
    "overlap": (ValueError, lambda x, buf: _shifted(buf)),
    "meta": (ValueError, lambda x, buf: torch.empty(x.shape, device="meta")),
    "conj": (ValueError, lambda x, buf: torch.zeros(64, dtype=torch.complex64).conj()),
    "not a tensor": (TypeError, lambda x, buf: [0.0] * x.numel()),
}


def bad_out_rank(rank: int, world_size: int, case: str) -> dict[str, Any]:
    comm = _comm("shm", rank)
    try:
        buf = torch.ones(_BUF)
        x = buf[:64]  # out=buf[1:65] overlaps it without being it
        if case == "conj":
            x = torch.ones(64, dtype=torch.complex64)
        err: str | None = None
        try:
            if rank == 1:
                comm.all_reduce(x, out=_BAD_OUT[case][1](x, buf))
            else:
                comm.all_reduce(x)
        except (TypeError, ValueError, PeerRejectedError) as e:
            err = f"{type(e).__name__}: {e}"
        after = comm.all_reduce(torch.full((8,), float(rank)))
    finally:
        comm.destroy()
    return {"err": err, "after": after.tolist()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(_BAD_OUT))
def test_bad_out_is_rejected_everywhere(dist_pool: Any, case: str, world_size: int) -> None:
    outs = dist_pool(world_size).run(bad_out_rank, case, timeout=50)
    outs = outs + [outs[0]] * (3 - world_size)  # rank 2's checks repeat rank 0's
    kind = _BAD_OUT[case][0].__name__
    assert outs[1]["err"] is not None and outs[1]["err"].startswith(kind), outs[1]["err"]
    assert "out" in outs[1]["err"]
    for r in (0, 2):
        assert outs[r]["err"] is not None, outs[r]
        assert outs[r]["err"].startswith("PeerRejectedError"), outs[r]
    for o in outs[:world_size]:
        assert o["after"] == [float(sum(range(world_size)))] * 8  # the group is still in step


def coordinator_rank(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="outcoord")
    bad: list[str] = []
    try:
        total = float(sum(range(1, world_size + 1)))
        for n in (5, 70_000):
            x = torch.full((n,), float(rank + 1))
            if g.all_reduce(x, out=x) is not x or not torch.equal(x, torch.full((n,), total)):
                bad.append(f"in place n={n}")
            x = torch.full((n,), float(rank + 1))
            alias = x.view(x.shape)  # the same memory, another tensor object: in place too
            got = g.all_reduce(x, out=alias)
            if got is not alias or not torch.equal(x, torch.full((n,), total)):
                bad.append(f"alias n={n}")
        x = torch.full((4,), float(rank + 1), requires_grad=True)
        leaf = torch.zeros(4, requires_grad=True)  # filled without autograd, at any world size
        if not torch.equal(g.all_reduce(x, out=leaf).detach(), torch.full((4,), total)):
            bad.append("out requiring grad")
        if leaf.grad_fn is not None:
            bad.append("out picked up a grad_fn")
    finally:
        g.destroy()
    return {"bad": bad}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_group_coordinator_all_reduce_out(dist_pool: Any, world_size: int) -> None:
    for rank, o in enumerate(dist_pool(world_size).run(coordinator_rank, timeout=50)):
        assert o["bad"] == [], f"rank {rank}: {o['bad']}"


def version_rank(rank: int, world_size: int, mode: str, n: int) -> dict[str, Any]:
    """A tensor saved for backward and then overwritten through ``out=``: backward must refuse."""
    comm = _comm(mode, rank)
    try:
        x = torch.full((n,), 3.0)
        comm.all_reduce(x)  # validated once: the next call takes the fast path
        w = torch.ones(n, requires_grad=True)
        y = (w * x).sum()  # saves x
        before = x._version
        comm.all_reduce(x, out=x)
        bumped = x._version > before
        try:
            y.backward()
            refused = False
        except RuntimeError as e:
            refused = "modified by an inplace operation" in str(e)
    finally:
        comm.destroy()
    return {"bumped": bumped, "refused": refused}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [16, 20_000, 300_000], ids=["small", "pair-step", "pipelined"])
@pytest.mark.parametrize("mode", ["shm", "shm-wide", "gloo"])
def test_writes_into_out_count_for_autograd(dist_pool: Any, mode: str, n: int) -> None:
    for rank, o in enumerate(dist_pool(2).run(version_rank, mode, n, timeout=50)):
        assert o["bumped"] and o["refused"], (rank, o)
