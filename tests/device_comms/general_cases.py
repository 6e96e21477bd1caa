"""The general cases of the device communicators: inputs, the case list, how a
communicator runs a case, and the fixed-order reference.

Shared by tests/device_comms/test_general_cases.py (shared memory and plain
gloo) and tests/device_comms/cuda/pynccl/test_cuda_communicator.py (the CUDA
communicator). Cases are built identically on every rank and in the parent
(seeded inputs), so the parent recomputes each expected result with the
reference.
"""

from __future__ import annotations

from typing import Any

import torch

from device_comms import ReduceOp, reduce_local

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
)


def valid_ops(dt: torch.dtype) -> list[ReduceOp]:
    """Reductions that make sense for ``dt``."""
    if dt.is_complex:
        return [ReduceOp.SUM, ReduceOp.AVG]
    if dt.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [o for o in ReduceOp if o is not ReduceOp.AVG]


def make(idx: int, rank: int, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
    """Deterministic input of ``rank`` for case ``idx``."""
    g = torch.Generator().manual_seed(idx * 1009 + rank)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt.is_complex:
        return torch.randn(shape, generator=g, dtype=dt)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g).to(dt)
    lo = 0 if dt == torch.uint8 else -3
    return torch.randint(lo, 4, shape, generator=g, dtype=dt)


def cases(n: int) -> list[tuple[Any, ...]]:
    """``(idx, kind, dtype, shape, op, kwargs)`` for world size ``n``."""
    out: list[tuple[Any, ...]] = []

    def add(kind: str, dt: torch.dtype, shape: tuple[int, ...], op: Any = None, **kw: Any) -> None:
        out.append((len(out), kind, dt, shape, op, kw))

    sizes = [(r * 5 + 2) % 4 for r in range(n)]
    sizes[n // 2] = 0
    for dt in DTYPES:
        for op in valid_ops(dt):
            for shape in ((), (0,), (2, 3, 5, 7)):
                add("all_reduce", dt, shape, op)
        for shape, dim in (((2 * n, 3), 0), ((3, n), -1), ((2, 3, n * 2, 1), 2), ((0, n), 1)):
            add("reduce_scatter", dt, shape, ReduceOp.SUM, dim=dim)
            add("all_gather", dt, shape, dim=dim)
            add("all_to_all", dt, shape, sdim=dim, gdim=0)
            add("scatter", dt, shape, dim=dim, src=n - 1)
        add("reduce_scatter", dt, (n * 2, 3),
            ReduceOp.MAX if not dt.is_complex else ReduceOp.AVG, dim=0)
        add("reduce_scatterv", dt, (sum(sizes), 3), ReduceOp.SUM, dim=0, sizes=sizes)
        add("reduce_scatterv", dt, (2, sum(sizes)), valid_ops(dt)[-1], dim=-1, sizes=sizes)
        add("all_gatherv", dt, (3, 2), dim=0, sizes=sizes)
        add("all_gatherv", dt, (2, 3, 2), dim=1, sizes=sizes)
        add("gather", dt, (3, 2), dim=1, dst=n - 1)
        add("reduce", dt, (4, 3), valid_ops(dt)[-1], dst=n - 1)
        add("broadcast", dt, (3, 5), src=n - 1)
        add("broadcast", dt, (), src=1)
        add("sendrecv", dt, (3, 4))
    for dt in (torch.float32, torch.bfloat16, torch.int16, torch.bool):
        op = ReduceOp.BOR if dt == torch.bool else ReduceOp.SUM
        add("all_reduce", dt, (3 << 15,), op)  # larger than the small workspace
        add("all_gather", dt, (301, 71), dim=1)
        add("reduce_scatter", dt, (n * 20001,), op, dim=0)
        add("broadcast", dt, (100001,), src=n - 1)
        add("gather", dt, (71, 301), dim=0, dst=n - 1)
        add("all_gatherv", dt, (3, 9000), dim=1, sizes=[9000 * r for r in range(n)])
    return out


def in_shape(case: tuple[Any, ...], rank: int) -> tuple[int, ...]:
    """The input shape of ``rank`` (all_gatherv: its own entry along ``dim``)."""
    _, kind, _, shape, _, kw = case
    s = list(shape)
    if kind == "all_gatherv":
        s[kw["dim"]] = kw["sizes"][rank]
    return tuple(s)


def run_case(comm: Any, case: tuple[Any, ...], rank: int, n: int) -> Any:
    """Run one case on ``comm``; non-contiguous inputs for every other case."""
    idx, kind, dt, _, op, kw = case
    x = make(idx, rank, in_shape(case, rank), dt)
    if idx % 2 and x.dim() >= 2 and kind != "broadcast":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    if kind == "all_reduce":
        return comm.all_reduce(x, op)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, kw["dim"], op)
    if kind == "reduce_scatterv":
        return comm.reduce_scatterv(x, kw["dim"], kw["sizes"], op)
    if kind == "all_gather":
        return comm.all_gather(x, kw["dim"])
    if kind == "all_gatherv":
        return comm.all_gatherv(x, kw["dim"], kw["sizes"])
    if kind == "gather":
        return comm.gather(x, kw["dst"], kw["dim"])
    if kind == "reduce":
        return comm.reduce(x, kw["dst"], op)
    if kind == "broadcast":
        return comm.broadcast(x if rank == kw["src"] else torch.zeros_like(x), kw["src"])
    if kind == "scatter":
        return comm.scatter(x if rank == kw["src"] else None, kw["src"], kw["dim"])
    if kind == "all_to_all":
        return comm.all_to_all(x, kw["sdim"], kw["gdim"])
    if kind == "sendrecv":  # forward ring, then backward ring
        got = []
        for step in (1, -1):
            dst, src = (rank + step) % n, (rank - step) % n
            if rank % 2 == 0:
                comm.send(x, dst)
                got.append(comm.recv(x.shape, x.dtype, src))
            else:
                got.append(comm.recv(x.shape, x.dtype, src))
                comm.send(x, dst)
        return torch.stack(got)
    raise ValueError(kind)


def expected(case: tuple[Any, ...], n: int, rank: int) -> torch.Tensor | None:
    """Reference result (``reduce_local``/``torch.cat``/``chunk``)."""
    idx, kind, dt, _, op, kw = case
    xs = [make(idx, r, in_shape(case, r), dt) for r in range(n)]
    if kind == "all_reduce":
        return reduce_local(xs, op)
    if kind == "reduce":
        return reduce_local(xs, op) if rank == kw["dst"] else None
    if kind in ("reduce_scatter", "reduce_scatterv"):
        full = reduce_local(xs, op)
        d = kw["dim"] % full.dim()
        return full.split(kw.get("sizes") or [full.shape[d] // n] * n, d)[rank]
    if kind in ("all_gather", "all_gatherv"):
        return torch.cat(xs, kw["dim"])
    if kind == "gather":
        return torch.cat(xs, kw["dim"]) if rank == kw["dst"] else None
    if kind == "broadcast":
        return xs[kw["src"]]
    if kind == "scatter":
        return xs[kw["src"]].chunk(n, kw["dim"])[rank]
    if kind == "all_to_all":
        return torch.cat([xs[r].chunk(n, kw["sdim"])[rank] for r in range(n)], kw["gdim"])
    if kind == "sendrecv":
        return torch.stack([xs[(rank - 1) % n], xs[(rank + 1) % n]])
    raise ValueError(kind)
