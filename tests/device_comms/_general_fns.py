"""Rank functions of tests/device_comms/test_general_cases.py (module-level, importable).

Cases are built identically on every rank and in the parent (seeded inputs),
so the parent recomputes each expected result with the fixed-order reference.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from device_comms import (
    CollectiveMismatch,
    CommunicatorClosed,
    CpuCommunicator,
    ReduceOp,
    TorchDistributedCommunicator,
    reduce_local,
)

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
)
SMALL_WS = 64 << 10  # slots of a few KiB: "large" inputs go through in pieces


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
        add("reduce_scatter", dt, (n * 2, 3), ReduceOp.MAX if not dt.is_complex else ReduceOp.AVG, dim=0)
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


def _group() -> Any:
    return dist.new_group(timeout=datetime.timedelta(seconds=20), backend="gloo")


def _attempt(fn: Any) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e), time.monotonic() - t0)


def general(rank: int, n: int) -> dict[str, Any]:
    """Every case through shared memory and through plain gloo, plus error paths."""
    pg = _group()
    out: dict[str, Any] = {}
    shm = CpuCommunicator(pg, torch.device("cpu"), unique_name="gen", workspace_bytes=SMALL_WS, timeout=20)
    gloo = TorchDistributedCommunicator(pg, torch.device("cpu"), unique_name="gen-gloo")
    out["mode"] = shm.mode
    out["shm"] = [run_case(shm, c, rank, n) for c in cases(n)]
    out["gloo"] = [run_case(gloo, c, rank, n) for c in cases(n)]
    # Complex MIN/MAX/PRODUCT: a clear TypeError before any communication.
    out["complex"] = [
        _attempt(lambda op=op: c.all_reduce(torch.ones(3, dtype=torch.complex64), op))
        for c in (shm, gloo) for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
    ]
    # Disagreements that the element count alone does not reveal (shared memory).
    x = torch.arange(6.0).reshape(2, 3) + rank
    out["mismatch"] = [
        _attempt(lambda: shm.all_gather(x if rank else x.reshape(3, 2), 0)),
        _attempt(lambda: shm.all_gather(x, 0 if rank else 1)),
        _attempt(lambda: shm.gather(x if rank else x.reshape(3, 2), n - 1, 0)),
        _attempt(lambda: shm.reduce_scatter(torch.ones(n, n), 0 if rank else 1)),
        _attempt(lambda: shm.all_gatherv(torch.ones(2, 3) if rank else torch.ones(2, 3, 1), 0, [2] * n)),
    ]
    out["after_mismatch"] = shm.all_reduce(torch.ones(3)).tolist()
    # A peer whose sizes list disagrees (not only its own input) is caught by
    # the signature / the per-rank size headers on every rank, promptly.
    bad_sizes = [2] * n if rank else [2] * (n - 1) + [1]
    for label, c in (("shm", shm), ("gloo", gloo)):
        out[f"sizes_differ_{label}"] = _attempt(
            lambda c=c: c.all_gatherv(torch.ones(bad_sizes[rank], 4), 0, bad_sizes)
        )
        out[f"after_sizes_{label}"] = c.all_gatherv(
            torch.full((rank % 2, 2), float(rank)), 0, [r % 2 for r in range(n)]
        ).tolist()
    shm.destroy()
    gloo.close()
    out["closed"] = [
        _attempt(lambda c=c: c.all_reduce(torch.ones(2))) for c in (shm, gloo)
    ] + [_attempt(lambda: shm.all_gather(torch.ones(2))), _attempt(lambda: shm.send(torch.ones(1), 0 if rank else 1))]
    dist.destroy_process_group(pg)
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def lifecycle(rank: int, n: int) -> dict[str, Any]:
    """Two communicators interleaved, then many create/destroy cycles."""
    pg_a, pg_b = _group(), _group()
    a = CpuCommunicator(pg_a, torch.device("cpu"), unique_name="a", workspace_bytes=SMALL_WS, timeout=20)
    b = CpuCommunicator(pg_b, torch.device("cpu"), unique_name="b", timeout=20)
    inter = []
    for i in range(6):  # changing shapes/dtypes, interleaving two groups and ops
        dt = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
        x = torch.full((i + 1, 3), rank + 1, dtype=dt)
        inter.append((a.all_reduce(x), b.all_gather(x, 0), a.broadcast(x.clone(), i % n),
                      b.reduce_scatterv(torch.ones(i + 1, dtype=dt), 0, [i + 1] + [0] * (n - 1))))
    a.destroy()
    b.destroy()
    dist.barrier()
    fds0 = _fds()
    for _ in range(12):
        c = CpuCommunicator(pg_a, torch.device("cpu"), unique_name="cyc", workspace_bytes=SMALL_WS)
        c.all_reduce(torch.ones(5))
        c.destroy()
    dist.barrier()
    segs = [s for s in os.listdir("/dev/shm") if s.startswith("gc_cpucomm_")]
    fds1 = _fds()
    dist.destroy_process_group(pg_a)
    dist.destroy_process_group(pg_b)
    return {"inter": inter, "fds": (fds0, fds1), "segs": segs}
