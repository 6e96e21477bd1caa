"""Deterministic cases for the CpuCommunicator tests, shared by ranks and the parent.

Every rank builds the same case list and the same inputs (seeded by case and
rank), so the parent can rebuild every rank's input and compute the expected
result with the reference reduction, independently of the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from device_comms import ReduceOp, reduce_local

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INTS = (torch.int32, torch.int64)
FLOAT_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
INT_OPS = (
    ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
    ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR,
)
# With the tests' workspace (64 KiB: slots of 16 KiB at 2 ranks, 8 KiB at 4)
# this many elements is larger than the whole workspace for every dtype.
BIG = 20011


@dataclass(frozen=True)
class Case:
    """One collective call: ``kind`` with per-rank input shape(s) and arguments."""

    idx: int
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: ReduceOp | None = None
    dim: int = 0
    root: int = 0
    sizes: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def build_cases(n: int) -> list[Case]:
    """All cases for world size ``n`` (same list on every rank)."""
    out: list[Case] = []

    def add(kind: str, dtype: torch.dtype, shape: tuple[int, ...], **kw: Any) -> None:
        out.append(Case(len(out), kind, dtype, shape, **kw))

    for dtype in FLOATS + INTS:
        ops = FLOAT_OPS if dtype in FLOATS else INT_OPS
        for op in ops:
            for shape in ((1,), (7, 3), (BIG,)):
                add("all_reduce", dtype, shape, op=op)
        main_op = ReduceOp.SUM
        alt_op = ReduceOp.AVG if dtype in FLOATS else ReduceOp.BXOR
        for op in (main_op, alt_op, ReduceOp.MAX):
            add("reduce_scatter", dtype, (n * 3, 5), op=op, dim=0)
            add("reduce_scatter", dtype, (4, n * 5), op=op, dim=-1)
            add("reduce_scatter", dtype, (n * 2503, 2), op=op, dim=0)
            uneven = tuple((r * 7 + 3) % 5 for r in range(n))  # contains a 0 for n >= 4
            add("reduce_scatterv", dtype, (sum(uneven), 3), op=op, dim=0, sizes=uneven)
            big_uneven = tuple(2000 + 1500 * r for r in range(n))
            add("reduce_scatterv", dtype, (2, sum(big_uneven)), op=op, dim=1, sizes=big_uneven)
            add("reduce", dtype, (5, 3), op=op, root=n - 1)
            add("reduce", dtype, (BIG,), op=op, root=0)
        add("all_gather", dtype, (1,), dim=0)
        add("all_gather", dtype, (3, 5), dim=1)
        add("all_gather", dtype, (BIG,), dim=0)
        add("all_gather", dtype, (2, BIG // 2), dim=0)
        add("all_gather", dtype, (BIG // 4, 4), dim=1)  # blocks of rows
        add("all_gather", dtype, (3, 9001), dim=1)  # rows larger than a slot
        sizes = tuple(r % 3 for r in range(n))  # includes zeros
        add("all_gatherv", dtype, (0, 4), dim=0, sizes=sizes)
        add("all_gatherv", dtype, (3, 0), dim=1, sizes=tuple(r + 1 for r in range(n)))
        add("all_gatherv", dtype, (0, 7), dim=0, sizes=tuple(1000 * (r + 1) + r for r in range(n)))
        add("all_gatherv", dtype, (2, 0), dim=1, sizes=tuple(3000 * (r + 1) + r for r in range(n)))
        add("broadcast", dtype, (1,), root=n - 1)
        add("broadcast", dtype, (6, 7), root=1)
        add("broadcast", dtype, (BIG,), root=0)
        add("gather", dtype, (2, 3), dim=1, root=1)
        add("gather", dtype, (BIG,), dim=0, root=n - 1)
        add("gather", dtype, (5, 3000), dim=-1, root=0)
    return out


def case_shape(case: Case, rank: int) -> tuple[int, ...]:
    """This rank's input shape (uneven ops take ``sizes[rank]`` along ``dim``)."""
    shape = list(case.shape)
    if case.kind == "all_gatherv" and case.sizes is not None:
        shape[case.dim] = case.sizes[rank]
    return tuple(shape)


def make_input(case: Case, rank: int) -> torch.Tensor:
    """The deterministic input of ``rank`` for ``case``."""
    g = torch.Generator().manual_seed(case.idx * 1009 + rank)
    shape = case_shape(case, rank)
    if case.dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(case.dtype)
    return torch.randint(-5, 6, shape, generator=g, dtype=case.dtype)


def run_case(comm: Any, case: Case, rank: int) -> torch.Tensor | None:
    """Call the collective of ``case`` on ``comm`` with this rank's input."""
    x = make_input(case, rank)
    k = case.kind
    if k == "all_reduce":
        return comm.all_reduce(x, case.op)
    if k == "reduce_scatter":
        return comm.reduce_scatter(x, case.dim, case.op)
    if k == "reduce_scatterv":
        return comm.reduce_scatterv(x, case.dim, list(case.sizes), case.op)
    if k == "reduce":
        return comm.reduce(x, case.root, case.op)
    if k == "all_gather":
        return comm.all_gather(x, case.dim)
    if k == "all_gatherv":
        return comm.all_gatherv(x, case.dim, list(case.sizes))
    if k == "broadcast":
        buf = x if rank == case.root else torch.zeros_like(x)
        return comm.broadcast(buf, case.root)
    if k == "gather":
        return comm.gather(x, case.root, case.dim)
    raise ValueError(f"unknown case kind {k!r}")


def expected(case: Case, n: int, rank: int) -> torch.Tensor | None:
    """The reference result of ``case`` on ``rank`` of ``n`` (reduce_local, torch.cat)."""
    xs = [make_input(case, r) for r in range(n)]
    k = case.kind
    if k == "all_reduce":
        return reduce_local(xs, case.op)
    if k == "reduce":
        return reduce_local(xs, case.op) if rank == case.root else None
    if k in ("reduce_scatter", "reduce_scatterv"):
        full = reduce_local(xs, case.op)
        d = case.dim % full.dim()
        sizes = case.sizes or tuple([full.shape[d] // n] * n)
        return full.split(list(sizes), d)[rank]
    if k in ("all_gather", "all_gatherv"):
        return torch.cat(xs, case.dim)
    if k == "broadcast":
        return xs[case.root]
    if k == "gather":
        return torch.cat(xs, case.dim) if rank == case.root else None
    raise ValueError(f"unknown case kind {k!r}")
