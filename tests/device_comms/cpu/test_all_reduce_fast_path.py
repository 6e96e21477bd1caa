"""The communicator's fast path for a repeated small all_reduce never skips a check it needs.

``CpuCommunicator.all_reduce`` sends a call straight to the engine when it
matches the last one-step all_reduce (op, dtype, shape) and is a plain
contiguous CPU tensor. Each case below first makes such an entry, then calls
with a tensor that matches the entry's op, dtype and shape but must *not* be
copied as raw bytes: a lazily negated view (``z.conj().imag`` of one element
is contiguous), a non-contiguous view of the same shape, a tensor that
requires grad, a sparse tensor, a different op; and it alternates new-tensor,
in-place and separate-``out`` calls on one entry. Every result is compared
with the reduction of all ranks' inputs computed locally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local


def _x(rank: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randn(shape, generator=g)


def _neg_view(rank: int, world_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    def make(r: int) -> torch.Tensor:
        return torch.complex(_x(r, (1,)), _x(r, (1,), 1)).conj().imag  # neg bit, contiguous

    mine = make(rank)
    assert mine.is_neg() and mine.is_contiguous()  # the case exists on this torch
    return mine, [make(r).clone() for r in range(world_size)]


def _transposed(rank: int, world_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    def make(r: int) -> torch.Tensor:
        return _x(r, (8, 8), 2).t()  # shape (8, 8), not contiguous

    return make(rank), [make(r).contiguous() for r in range(world_size)]


def _sliced(rank: int, world_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    def make(r: int) -> torch.Tensor:
        return _x(r, (8, 16), 3)[:, ::2]  # shape (8, 8), every other column

    return make(rank), [make(r).contiguous() for r in range(world_size)]


_CASES: dict[str, Callable[[int, int], tuple[torch.Tensor, list[torch.Tensor]]]] = {
    "neg-view": _neg_view,
    "transposed": _transposed,
    "strided": _sliced,
}


def fast_path_rank(rank: int, world_size: int, case: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"fast-{case}")
    bad: list[str] = []
    try:
        x, inputs = _CASES[case](rank, world_size)
        shape = tuple(x.shape)
        for _ in range(3):  # the entry now exists for (SUM, float32, shape)
            comm.all_reduce(_x(rank, shape, 9))
        ref = reduce_local(inputs, ReduceOp.SUM)
        keep = x.clone()
        got = comm.all_reduce(x)
        if not torch.equal(got, ref):
            bad.append(f"{case}: new tensor {got.flatten()[:4].tolist()} != "
                       f"{ref.flatten()[:4].tolist()}")
        if not torch.equal(x, keep):
            bad.append(f"{case}: the input changed")
        dst = torch.empty(shape)
        if not torch.equal(comm.all_reduce(x, out=dst), ref):
            bad.append(f"{case}: separate out")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_matching_entry_does_not_skip_checks(dist_pool: Any, case: str, world_size: int) -> None:
    results = dist_pool(world_size).run(fast_path_rank, case, timeout=80)
    assert results == [[]] * world_size


def forms_rank(rank: int, world_size: int) -> list[str]:
    """One entry, every call form and op in turn; grad, sparse and op changes in between."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="fast-forms")
    bad: list[str] = []
    try:
        for i in range(12):
            inputs = [_x(r, (4, 64), i) for r in range(world_size)]
            x = inputs[rank].clone()
            op = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.AVG)[i % 4]
            ref = reduce_local(inputs, op)
            form = i % 3
            if form == 0:
                got = comm.all_reduce(x, op)
            elif form == 1:
                got = comm.all_reduce(x, op, out=x)
                if got is not x:
                    bad.append(f"call {i}: in place returned another tensor")
            else:
                got = comm.all_reduce(x, op, out=torch.empty_like(x))
            if not torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
                bad.append(f"call {i}: {op.name} form {form} wrong")
            # same op, dtype and shape, but requires grad: the checked path
            w = inputs[rank].clone().requires_grad_(True)
            r = comm.all_reduce(w, op)
            if not torch.allclose(r, ref, rtol=1e-6, atol=1e-6):
                bad.append(f"call {i}: requires_grad input")
        sparse = torch.eye(4, 64).to_sparse()
        try:
            comm.all_reduce(sparse)
            bad.append("a sparse tensor was accepted")
        except (TypeError, ValueError):
            pass
        comm.barrier()  # the rejection left the group in step
        y = comm.all_reduce(torch.ones(4, 64))
        if not torch.equal(y, torch.full((4, 64), float(world_size))):
            bad.append("the group is out of step after the rejection")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_call_forms_share_one_entry(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(forms_rank, timeout=80)
    assert results == [[]] * world_size


#: Layouts an engine's layers might take in turn: shapes of one numel, a dtype numpy
#: lacks, another op on a kept layout, an integer MAX, a size reduced into the peer's slot.
_LAYOUTS: list[tuple[tuple[int, ...], torch.dtype, ReduceOp]] = [
    ((256,), torch.float32, ReduceOp.SUM),
    ((4, 64), torch.float32, ReduceOp.SUM),
    ((256,), torch.bfloat16, ReduceOp.SUM),
    ((256,), torch.float32, ReduceOp.MAX),
    ((8, 16), torch.int64, ReduceOp.MAX),
    ((12_288,), torch.float32, ReduceOp.SUM),
]


def _ints(rank: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Small integers as float32: exact in every dtype and summation order."""
    return (_x(rank, shape, seed) * 8).round()


def layouts_rank(rank: int, world_size: int) -> list[str]:
    """Layouts in turn, every call form: right results, and each layout's entry is kept
    (not made again on its next turn); an input of a kept layout that is not plain
    (non-contiguous, requires grad) still takes the checked path."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="fast-layouts")
    bad: list[str] = []
    try:
        entries: dict[int, Any] = {}
        for call in range(5 * len(_LAYOUTS)):
            i = call % len(_LAYOUTS)
            shape, dtype, op = _LAYOUTS[i]
            inputs = [_ints(r, shape, call).to(dtype) for r in range(world_size)]
            x = inputs[rank].clone()
            ref = reduce_local(inputs, op)
            form = (call // len(_LAYOUTS)) % 3
            if form == 0:
                got = comm.all_reduce(x, op)
            elif form == 1:
                got = comm.all_reduce(x, op, out=x)
            else:
                got = comm.all_reduce(x, op, out=torch.empty_like(x))
            if not torch.equal(got, ref):
                bad.append(f"call {call}: {shape} {dtype} {op.name} form {form} wrong")
            eng = comm._flat  # the engine's entries are what this test checks
            entry = None if eng is None else eng.small.find(op, dtype, torch.Size(shape))
            if entry is None or not entry.plain:
                bad.append(f"call {call}: no entry kept for {shape} {dtype} {op.name}")
            elif entries.setdefault(i, entry) is not entry:
                bad.append(f"call {call}: the entry of {shape} {dtype} {op.name} was made again")
            if i == 1:  # a kept layout, not the last one: (4, 64) float32 SUM
                t = _ints(rank, (64, 4), call).t()  # shape (4, 64), not contiguous
                want = reduce_local([_ints(r, (64, 4), call).t() for r in range(world_size)],
                                    ReduceOp.SUM)
                comm.all_reduce(_x(rank, (8, 16), call).to(torch.int64), ReduceOp.MAX)
                if not torch.equal(comm.all_reduce(t), want):
                    bad.append(f"call {call}: a transposed input of a kept layout")
                g = inputs[rank].clone().requires_grad_(True)
                comm.all_reduce(torch.zeros(256))
                if not torch.equal(comm.all_reduce(g, op), ref):
                    bad.append(f"call {call}: an input that requires grad")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_layouts_in_turn_keep_their_entries(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(layouts_rank, timeout=80)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:4]}"


#: reduce_scatter layouts: (shape, dim, dtype, op). Dimension 0 (or all dimensions
#: before ``dim`` of length 1) gives each rank one block of the input: one step in the
#: engine; a block split across rows (dim 1 of a matrix) takes the engine's general path.
_SCATTER_LAYOUTS: list[tuple[tuple[int, ...], int, torch.dtype, ReduceOp]] = [
    ((3 * 4 * 64,), 0, torch.float32, ReduceOp.SUM),
    ((3 * 4, 64), 0, torch.float32, ReduceOp.SUM),
    ((1, 3 * 4 * 64), 1, torch.bfloat16, ReduceOp.SUM),
    ((3 * 4, 8), 0, torch.int64, ReduceOp.MAX),
    ((3 * 4, 64), 0, torch.float32, ReduceOp.AVG),
    ((8, 3 * 4), 1, torch.float32, ReduceOp.SUM),
    ((3 * 4 * 1024,), -1, torch.float32, ReduceOp.SUM),
]


#: reduce_scatterv counts of 12 rows per world size (a rank may get none).
_COUNTS = {2: (5, 7), 3: (0, 5, 7), 4: (3, 0, 4, 5)}
_SCATTERV_LAYOUTS: list[tuple[tuple[int, ...], int, torch.dtype, ReduceOp]] = [
    ((12, 64), 0, torch.float32, ReduceOp.SUM),
    ((12, 64), 0, torch.bfloat16, ReduceOp.SUM),
    ((12, 8), 0, torch.int64, ReduceOp.MAX),
    ((1, 12), 1, torch.float32, ReduceOp.AVG),
    ((8, 12), 1, torch.float32, ReduceOp.SUM),
]


def scatter_layouts_rank(rank: int, world_size: int, uneven: bool) -> list[str]:
    """reduce_scatter layouts in turn, between all_reduces, or with ``uneven``
    reduce_scatterv layouts with uneven counts (one rank gets none at world sizes 3
    and 4): each rank's part, bitwise as reduced locally, and the one-step layouts
    keep their entries, made at their second call."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="fast-scatter")
    bad: list[str] = []
    layouts = _SCATTERV_LAYOUTS if uneven else _SCATTER_LAYOUTS
    counts = _COUNTS[world_size] if uneven else None
    try:
        entries: dict[int, Any] = {}
        for call in range(4 * len(layouts)):
            i = call % len(layouts)
            shape, dim, dtype, op = layouts[i]
            inputs = [_ints(r, shape, call).to(dtype) for r in range(world_size)]
            reduced = reduce_local(inputs, op)
            if counts is None:
                want = reduced.chunk(world_size, dim)[rank]
                got = comm.reduce_scatter(inputs[rank].clone(), dim, op)
            else:
                want = reduced.split(list(counts), dim)[rank]
                got = comm.reduce_scatterv(inputs[rank].clone(), dim, list(counts), op)
            if got.shape != want.shape or not torch.equal(got, want):
                bad.append(f"call {call}: {shape} dim {dim} {dtype} {op.name} wrong")
            if i == 2:  # an all_reduce of the same bytes between them
                comm.all_reduce(inputs[rank])
            eng = comm._flat  # the engine's entries are what this test checks
            if eng is None:
                bad.append("no engine")
                break
            d = dim % len(shape)
            entry = eng.small.find_scatter(op, dtype, torch.Size(shape), d, counts)
            # an entry is made when a layout comes back: from its second call on
            one_step = all(n == 1 for n in shape[:d]) and call >= len(layouts)
            if entry.plain != one_step:
                bad.append(f"call {call}: {shape} dim {dim}: one-step entry {entry.plain}")
            elif one_step and entries.setdefault(i, entry) is not entry:
                bad.append(f"call {call}: the entry of {shape} dim {dim} was made again")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("uneven", [False, True], ids=["reduce_scatter", "reduce_scatterv"])
def test_reduce_scatter_layouts_in_turn(dist_pool: Any, uneven: bool, world_size: int) -> None:
    results = dist_pool(world_size).run(scatter_layouts_rank, uneven, timeout=80)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:4]}"
