"""``all_reduce(x, out=...)``: the result in place (``out=x``) or in a tensor of the caller's.

Every all_reduce scheme of the shared-memory engine (one small step, the
two-rank one-step and pipelined schemes, one shot in pieces, reduce-scatter +
all-gather), the hierarchical path (one node per rank) and gloo, at 2, 3 and 4
ranks: the result is bitwise the one the same call returns as a new tensor (and
that is the reference reduction), ``out`` is what comes back, and a separate
``out`` leaves the input untouched. Bad ``out``
arguments raise the documented error on the rank that passed them and a
:class:`PeerRejectedError` on the others, after which the group still works.
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
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-5, 6, (n,), generator=g, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _comm(mode: str, rank: int) -> CpuCommunicator:
    kw: dict[str, Any] = {"workspace_bytes": _WS_BYTES, "oneshot_bytes": 24 << 10}
    if mode == "gloo":
        kw = {"use_shm": False}
    elif mode == "shm-wide":  # default workspace: one step beyond the torch grain
        kw = {}
    elif mode == "hier":
        kw["node_id"] = f"node{rank}"
    return CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"out-{mode}", **kw)


_CASES = [(torch.float32, ReduceOp.SUM), (torch.bfloat16, ReduceOp.AVG),
          (torch.int64, ReduceOp.PRODUCT), (torch.float64, ReduceOp.MAX)]
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
                if not torch.allclose(want.double(), ref.double(), rtol=1e-2, atol=1e-2):
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


_BAD_OUT = {
    "dtype": (TypeError, lambda x: torch.empty_like(x, dtype=torch.float64)),
    "shape": (ValueError, lambda x: torch.empty(x.numel() + 1)),
    "strided": (ValueError, lambda x: torch.empty(2 * x.numel())[::2]),
    "overlap": (ValueError, lambda x: x.view(-1)[1:].clone().resize_(0).set_(
        x.untyped_storage(), 4, x.shape)),
    "not a tensor": (TypeError, lambda x: [0.0] * x.numel()),
}


def bad_out_rank(rank: int, world_size: int, case: str) -> dict[str, Any]:
    comm = _comm("shm", rank)
    try:
        x = torch.ones(64)
        err: str | None = None
        try:
            if rank == 1:
                comm.all_reduce(x, out=_BAD_OUT[case][1](x))
            else:
                comm.all_reduce(x)
        except (TypeError, ValueError, PeerRejectedError) as e:
            err = f"{type(e).__name__}: {e}"
        after = comm.all_reduce(torch.full((8,), float(rank)))
    finally:
        comm.destroy()
    return {"err": err, "after": after.tolist()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(_BAD_OUT))
def test_bad_out_is_rejected_everywhere(dist_pool: Any, case: str) -> None:
    outs = dist_pool(3).run(bad_out_rank, case, timeout=50)
    kind = _BAD_OUT[case][0].__name__
    assert outs[1]["err"] is not None and outs[1]["err"].startswith(kind), outs[1]["err"]
    assert "out" in outs[1]["err"]
    for r in (0, 2):
        assert outs[r]["err"] is not None and outs[r]["err"].startswith("PeerRejectedError"), outs[r]
    for o in outs:
        assert o["after"] == [3.0] * 8  # 0 + 1 + 2: the group is still in step
