"""Rank-side helpers of the groupcoord backend tests: one group per pool, op cases, inputs.

Every case runs the same torch.distributed call on a groupcoord group and on
the pool's gloo world group (the same ranks), and the rank compares the two
results bitwise. Inputs hold small integers (also in floating point), so
sums and products are exact whatever order a backend reduces in.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_GROUPS: dict[str, Any] = {}

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.int8, torch.uint8)
MOVE_DTYPES = (*FLOATS, *INTS, torch.bool, torch.complex64)
#: shapes of the inputs: 1-D, multi-dimensional (also made non-contiguous), empty, 0-dim
SHAPES: tuple[tuple[int, ...], ...] = ((5,), (3, 4), (0,), ())


def group(timeout: float = 30.0) -> Any:
    """This rank's groupcoord group over the whole pool (made once per pool process)."""
    import coordinator  # noqa: F401 - registers the backend

    pg = _GROUPS.get("gc")
    if pg is None:
        pg = dist.new_group(backend="groupcoord", timeout=datetime.timedelta(seconds=timeout))
        _GROUPS["gc"] = pg
    return pg


def drop_groups(rank: int, world: int) -> int:
    """Destroy the cached group (a module's last step); returns how many were dropped."""
    n = 0
    for key in list(_GROUPS):
        dist.destroy_process_group(_GROUPS.pop(key))
        n += 1
    return n


def inp(shape: tuple[int, ...], dtype: torch.dtype, rank: int, salt: int = 0,
        noncontig: bool = False) -> torch.Tensor:
    """A deterministic input of small values (1..3; 0/1 for bool), per rank and salt."""
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 3 + 1
    if dtype == torch.bool:
        base = base % 2
    t = base.to(dtype).reshape(shape)
    if noncontig and t.dim() >= 2:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values, column-major
        assert not t.is_contiguous()
    return t


def compare(name: str, run: Callable[[Any], list[torch.Tensor]], gc: Any) -> str | None:
    """Run ``run`` on gloo (WORLD) and groupcoord; None when the results are equal,
    ``"skip"`` when gloo refuses the call, else a description of the difference."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = run(dist.group.WORLD)
    except (RuntimeError, ValueError, TypeError) as e:
        return f"skip: {type(e).__name__}: {str(e)[:120]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(gc)
    if len(got) != len(want):
        return f"{name}: {len(got)} outputs, gloo {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            return f"{name}[{i}]: got {g!r}, gloo {w!r}"
    return None


def run_cases(rank: int, world: int, op: str) -> dict[str, Any]:
    """Every case of ``op`` on this rank: ``{"bad": [...], "ran": n, "skipped": [...],
    "shm": shared-memory calls served during them}``."""
    gc = group()
    before = sum(gc.communicator.shm_calls.values())
    bad, skipped, ran = [], [], 0
    for name, run in CASES[op](rank, world):
        res = compare(name, run, gc)
        if res is not None and res.startswith("skip"):
            skipped.append(f"{name} ({res})")
        elif res is not None:
            bad.append(res)
        else:
            ran += 1
    return {"bad": bad, "ran": ran, "skipped": skipped,
            "shm": sum(gc.communicator.shm_calls.values()) - before}


Case = tuple[str, Callable[[Any], list[torch.Tensor]]]


def _nc(pg: Any, nc: bool) -> bool:
    """Whether a case's tensor is non-contiguous: only on groupcoord, since gloo's
    ``reduce_scatter`` and ``scatter`` read and write non-contiguous tensors' raw
    storage (wrong results); the reference runs on contiguous ones."""
    return nc and pg is not dist.group.WORLD


Variant = tuple[str, torch.dtype, tuple[int, ...], bool]


def _variants(dtypes: tuple[torch.dtype, ...]) -> list[Variant]:
    out = []
    for dt in dtypes:
        for shape in SHAPES:
            out.append((f"{str(dt)[6:]}{list(shape)}", dt, shape, False))
        out.append((f"{str(dt)[6:]}[3, 4]-noncontig", dt, (3, 4), True))
    return out


_RED = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR}
_BITWISE = ("band", "bor", "bxor")


def _all_reduce(op: str) -> Callable[[int, int], list[Case]]:
    def cases(rank: int, world: int) -> list[Case]:
        dtypes = (*INTS, torch.bool) if op in _BITWISE else (*FLOATS, *INTS, torch.bool,
                                                              torch.complex64)
        out: list[Case] = []
        for name, dt, shape, nc in _variants(dtypes):
            def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                    nc: bool = nc) -> list[torch.Tensor]:
                t = inp(shape, dt, rank, noncontig=_nc(pg, nc))
                dist.all_reduce(t, _RED[op], group=pg)
                return [t]
            out.append((name, run))
        return out
    return cases


def _avg(rank: int, world: int) -> list[Case]:
    # gloo has no AVG: the reference is gloo's SUM divided by the group size
    out: list[Case] = []
    for name, dt, shape, nc in _variants((torch.float32, torch.float64)):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            t = inp(shape, dt, rank, noncontig=_nc(pg, nc))
            if pg is dist.group.WORLD:
                dist.all_reduce(t, dist.ReduceOp.SUM, group=pg)
                return [t / world]
            dist.all_reduce(t, dist.ReduceOp.AVG, group=pg)
            return [t]
        out.append((name, run))
    return out


def _coalesced(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for dt in (torch.float32, torch.int32, torch.bfloat16):
        def run(pg: Any, dt: torch.dtype = dt) -> list[torch.Tensor]:
            ts = [inp((3, 4), dt, rank, noncontig=_nc(pg, True)), inp((5,), dt, rank, 1),
                  inp((0,), dt, rank)]
            dist.all_reduce_coalesced(ts, dist.ReduceOp.MAX, group=pg)
            return ts
        out.append((str(dt), run))
    return out


def _broadcast(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for name, dt, shape, nc in _variants(MOVE_DTYPES):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            t = inp(shape, dt, rank, noncontig=_nc(pg, nc))
            dist.broadcast(t, src=world - 1, group=pg)
            return [t]
        out.append((name, run))
    return out


def _reduce(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    dst = 1 % world
    for op in ("sum", "max"):
        for name, dt, shape, nc in _variants((torch.float32, torch.bfloat16, torch.int64)):
            def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                    nc: bool = nc, op: str = op) -> list[torch.Tensor]:
                t = inp(shape, dt, rank, noncontig=_nc(pg, nc))
                dist.reduce(t, dst=dst, op=_RED[op], group=pg)
                return [t] if rank == dst else []  # non-roots' tensors are unspecified
            out.append((f"{op}-{name}", run))
    return out


def _all_gather(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for name, dt, shape, nc in _variants(MOVE_DTYPES):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            outs = [torch.full(shape, 0, dtype=dt) for _ in range(world)]
            dist.all_gather(outs, inp(shape, dt, rank, noncontig=_nc(pg, nc)), group=pg)
            return outs
        out.append((name, run))

    def uneven(pg: Any) -> list[torch.Tensor]:
        if pg is dist.group.WORLD:  # gloo gathers equal sizes only: the expected result
            return [inp((r + 1,), torch.float32, r) for r in range(world)]
        outs = [torch.zeros(r + 1) for r in range(world)]
        dist.all_gather(outs, inp((rank + 1,), torch.float32, rank), group=pg)
        return outs
    out.append(("uneven", uneven))
    return out


def _all_gather_into_tensor(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for name, dt, shape, nc in _variants(MOVE_DTYPES):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            o = torch.zeros((world * shape[0], *shape[1:]) if shape else (world,), dtype=dt)
            x = inp(shape, dt, rank, noncontig=_nc(pg, nc))
            if pg is dist.group.WORLD and not shape:  # gloo wants the input 1-D
                x = x.reshape(1)
            dist.all_gather_into_tensor(o, x, group=pg)
            return [o]
        out.append((name, run))
    return out


def _all_gather_coalesced(rank: int, world: int) -> list[Case]:
    def run(pg: Any) -> list[torch.Tensor]:
        ins = [inp((3, 4), torch.float32, rank, noncontig=_nc(pg, True)),
               inp((2,), torch.float32, rank)]  # torch wants one dtype
        outs = [[torch.zeros_like(x) for x in ins] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins, group=pg)
        return [t for o in outs for t in o]

    def run_into(pg: Any) -> list[torch.Tensor]:
        ins = [inp((3, 4), torch.float32, rank), inp((5,), torch.bfloat16, rank, 2)]
        outs = [torch.zeros((world * x.shape[0], *x.shape[1:]), dtype=x.dtype) for x in ins]
        if pg is dist.group.WORLD:  # gloo has no coalesced all_gather_into_tensor
            for o, x in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, x, group=pg)
            return outs
        with dist._coalescing_manager(group=pg):
            for o, x in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, x, group=pg)
        return outs
    return [("lists", run), ("into_tensor", run_into)]


def _gather(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for name, dt, shape, nc in _variants((torch.float32, torch.int8, torch.bool, torch.bfloat16)):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            outs = [torch.zeros(shape, dtype=dt) for _ in range(world)] if rank == 0 else None
            dist.gather(inp(shape, dt, rank, noncontig=_nc(pg, nc)), outs, dst=0, group=pg)
            return outs or []
        out.append((name, run))
    return out


def _scatter(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    src = world - 1
    for name, dt, shape, nc in _variants((torch.float32, torch.int8, torch.bool, torch.bfloat16)):
        def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                nc: bool = nc) -> list[torch.Tensor]:
            o = torch.zeros(shape, dtype=dt)
            if _nc(pg, nc) and o.dim() >= 2:
                o = torch.zeros(shape[::-1], dtype=dt).t()
            ins = ([inp(shape, dt, r, 5) for r in range(world)] if rank == src else None)
            dist.scatter(o, ins, src=src, group=pg)
            return [o]
        out.append((name, run))
    return out


def _reduce_scatter(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for op in ("sum", "min"):
        for name, dt, shape, nc in _variants((torch.float32, torch.bfloat16, torch.int32)):
            def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                    nc: bool = nc, op: str = op) -> list[torch.Tensor]:
                o = torch.zeros(shape, dtype=dt)
                ins = [inp(shape, dt, rank, j, noncontig=_nc(pg, nc)) for j in range(world)]
                dist.reduce_scatter(o, ins, op=_RED[op], group=pg)
                return [o]
            out.append((f"{op}-{name}", run))
    return out


def _reduce_scatter_tensor(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for op in ("sum", "max"):
        for name, dt, shape, nc in _variants((torch.float32, torch.bfloat16, torch.int64)):
            def run(pg: Any, dt: torch.dtype = dt, shape: tuple[int, ...] = shape,
                    nc: bool = nc, op: str = op) -> list[torch.Tensor]:
                o = torch.zeros(shape, dtype=dt)
                if not shape:
                    return []  # gloo needs dim 0 to split
                x = inp((world * shape[0], *shape[1:]), dt, rank)
                dist.reduce_scatter_tensor(o, x, op=_RED[op], group=pg)
                return [o]
            out.append((f"{op}-{name}", run))
    return out


def _all_to_all_single(rank: int, world: int) -> list[Case]:
    out: list[Case] = []
    for name, dt, _shape, _nc in _variants((torch.float32, torch.int16, torch.bool)):
        if _shape == () or _nc:
            continue

        def even(pg: Any, dt: torch.dtype = dt) -> list[torch.Tensor]:
            x = _wire(pg, inp((world * 2, 3), dt, rank))
            o = torch.zeros_like(x)
            dist.all_to_all_single(o, x, group=pg)
            return [o.to(dt)]

        def splits(pg: Any, dt: torch.dtype = dt) -> list[torch.Tensor]:
            send = [(rank + j) % 3 for j in range(world)]  # rows to rank j
            recv = [(i + rank) % 3 for i in range(world)]  # rows from rank i
            x = _wire(pg, inp((sum(send), 2), dt, rank))
            o = torch.zeros((sum(recv), 2), dtype=x.dtype)
            dist.all_to_all_single(o, x, recv, send, group=pg)
            return [o.to(dt)]
        out += [(f"even-{name}", even), (f"splits-{name}", splits)]
    return out


def _wire(pg: Any, x: torch.Tensor) -> torch.Tensor:
    """``x``, widened to int32 for gloo where it is int16 (gloo's all-to-all has no int16)."""
    return x.to(torch.int32) if pg is dist.group.WORLD and x.dtype == torch.int16 else x


def _all_to_all(rank: int, world: int) -> list[Case]:
    def run(pg: Any) -> list[torch.Tensor]:
        if pg is dist.group.WORLD:  # gloo moves equal sizes only: the expected result
            return [inp((i + rank + 1,), torch.float32, i, rank) for i in range(world)]
        ins = [inp((rank + j + 1,), torch.float32, rank, j) for j in range(world)]
        outs = [torch.zeros(i + rank + 1) for i in range(world)]
        dist.all_to_all(outs, ins, group=pg)
        return outs

    def multi(pg: Any) -> list[torch.Tensor]:
        ins = [inp((2, 3), torch.int64, rank, j, noncontig=_nc(pg, True)) for j in range(world)]
        outs = [torch.zeros((2, 3), dtype=torch.int64) for _ in range(world)]
        dist.all_to_all(outs, ins, group=pg)
        return outs
    return [("uneven", run), ("noncontig", multi)]


def _functional(rank: int, world: int) -> list[Case]:
    import torch.distributed._functional_collectives as fc

    def all_reduce(pg: Any) -> list[torch.Tensor]:
        return [fc.wait_tensor(fc.all_reduce(inp((4, 2), torch.float32, rank), "sum", pg))]

    def all_gather(pg: Any) -> list[torch.Tensor]:
        return [fc.wait_tensor(fc.all_gather_tensor(inp((2, 3), torch.float32, rank), 0, pg))]

    def reduce_scatter(pg: Any) -> list[torch.Tensor]:
        x = inp((world * 2, 3), torch.float32, rank)
        return [fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, pg))]

    def coalesced(pg: Any) -> list[torch.Tensor]:
        xs = [inp((world, 3), torch.float32, rank), inp((world * 2,), torch.float32, rank, 1)]
        return [fc.wait_tensor(t) for t in
                fc.reduce_scatter_tensor_coalesced(xs, "sum", [0, 0], pg)]

    def gather_coalesced(pg: Any) -> list[torch.Tensor]:
        xs = [inp((2, 3), torch.float32, rank), inp((4,), torch.bfloat16, rank, 1)]
        return [fc.wait_tensor(t) for t in fc.all_gather_into_tensor_coalesced(xs, pg)]

    def all_to_all(pg: Any) -> list[torch.Tensor]:
        x = inp((world * 2,), torch.float32, rank)
        return [fc.wait_tensor(fc.all_to_all_single(x, None, None, pg))]
    return [("all_reduce", all_reduce), ("all_gather_tensor", all_gather),
            ("reduce_scatter_tensor", reduce_scatter), ("reduce_scatter_coalesced", coalesced),
            ("all_gather_coalesced", gather_coalesced),
            ("all_to_all_single", all_to_all)]


def _autograd(rank: int, world: int) -> list[Case]:
    """Leaves that require grad, written in place as torch's backends do (no history)."""
    def all_reduce(pg: Any) -> list[torch.Tensor]:
        t = inp((3, 4), torch.float32, rank, noncontig=_nc(pg, True)).requires_grad_()
        dist.all_reduce(t, group=pg)
        assert t.grad_fn is None
        return [t.detach()]

    def all_gather(pg: Any) -> list[torch.Tensor]:
        outs = [torch.zeros(2) for _ in range(world)]  # gloo refuses outputs that require grad
        dist.all_gather(outs, inp((2,), torch.float32, rank).requires_grad_(), group=pg)
        return [o.detach() for o in outs]
    return [("all_reduce", all_reduce), ("all_gather", all_gather)]


CASES: dict[str, Callable[[int, int], list[Case]]] = {
    **{f"all_reduce-{op}": _all_reduce(op) for op in _RED},
    "all_reduce-avg": _avg,
    "all_reduce_coalesced": _coalesced,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_coalesced": _all_gather_coalesced,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all_single": _all_to_all_single,
    "all_to_all": _all_to_all,
    "functional": _functional,
    "autograd": _autograd,
}
