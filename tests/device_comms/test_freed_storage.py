"""A tensor whose storage was freed or shrunk is refused, never read as zeros or garbage.

``x.untyped_storage().resize_(0)`` (how FSDP-style code frees a parameter's
memory between uses) leaves ``x`` with its shape but no bytes: its
``data_ptr()`` is 0 (or ``storage_offset * itemsize`` for a view). The
shared-memory engine copies a caller's tensor by address, so such a tensor
was summed as zeros on the one-step path (its ``data_ptr`` 0 looked like
autograd's storage-less zeros), crashed the rank (``memmove`` from a tiny
address) on the larger paths, or failed in numpy on one rank while its peers
waited. Now every call form refuses it before any communication: the rank
raises ``ValueError`` naming the argument, its peers
:class:`~device_comms.errors.PeerRejectedError`, and the group stays usable.
Covered: a first call, a call on the all_reduce fast paths (an entry that
matches, and an (op, dtype) already checked), ``out=`` freed, a freed view
with a storage offset, the very tensor the fast path served before with its
storage shrunk or freed (also at an offset past the null page, and in place),
and every other op the engine runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, PeerRejectedError, ReduceOp

_SMALL, _LARGE = 256, (1 << 18) + 3  # the one-step path; the pieces (both above GRAIN)


def _freed(n: int, offset: int = 0) -> torch.Tensor:
    """``n`` elements whose storage was resized to 0 (``offset``: a view into it)."""
    base = torch.ones(n + offset)
    x = base[offset:]
    base.untyped_storage().resize_(0)
    return x


def _warm(comm: Any, n: int) -> None:
    """Make ``(n,)`` float32 SUM the fast path's entry (and its (op, dtype) checked)."""
    for _ in range(3):
        comm.all_reduce(torch.ones(n))


_Case = Callable[[Any, int, int, bool], Any]


def _ar_first(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.all_reduce(_freed(n, 0) if bad else torch.ones(n), ReduceOp.MAX)


def _ar_warm(comm: Any, rank: int, n: int, bad: bool) -> Any:
    _warm(comm, n)
    return comm.all_reduce(_freed(n) if bad else torch.ones(n))


def _ar_warm_in_place(comm: Any, rank: int, n: int, bad: bool) -> Any:
    _warm(comm, n)
    x = _freed(n) if bad else torch.ones(n)
    return comm.all_reduce(x, out=x)


def _ar_warm_offset(comm: Any, rank: int, n: int, bad: bool) -> Any:
    _warm(comm, n)  # data_ptr() is 16, not 0
    return comm.all_reduce(_freed(n, 4) if bad else torch.ones(n))


def _ar_seen_then_shrunk(comm: Any, rank: int, n: int, bad: bool, offset: int = 500,
                         keep: int = 200, in_place: bool = False) -> Any:
    """The same view, reduced before (the entry, and views of its address), then its
    storage shrunk to ``keep`` elements (0: freed) under it."""
    base = torch.ones(offset + n)
    x = base[offset:]
    for _ in range(3):
        comm.all_reduce(x)
    if bad:
        base.untyped_storage().resize_(keep * 4)
    return comm.all_reduce(x, out=x) if in_place else comm.all_reduce(x)


def _ar_seen_then_freed_far(comm: Any, rank: int, n: int, bad: bool) -> Any:
    # offset 2000 floats: data_ptr() is 8000 once freed, past the null page
    return _ar_seen_then_shrunk(comm, rank, n, bad, offset=2000, keep=0)


def _ar_seen_then_shrunk_in_place(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return _ar_seen_then_shrunk(comm, rank, n, bad, in_place=True)


def _ar_checked_op(comm: Any, rank: int, n: int, bad: bool) -> Any:
    _warm(comm, n)  # (n, 1) is another shape: the fast path of an (op, dtype) checked before
    return comm.all_reduce((_freed(n, 4) if bad else torch.ones(n)).view(n, 1))


def _ar_out(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.all_reduce(torch.ones(n), out=_freed(n) if bad else torch.empty(n))


def _all_gather(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.all_gather(_freed(n, 3) if bad else torch.ones(n), 0)


def _reduce_scatter(comm: Any, rank: int, n: int, bad: bool) -> Any:
    m = n * comm.world_size
    return comm.reduce_scatter(_freed(m) if bad else torch.ones(m), 0)


def _broadcast(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.broadcast(_freed(n) if bad else torch.ones(n), 0)


def _gather(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.gather(_freed(n) if bad else torch.ones(n), 0, 0)


def _reduce(comm: Any, rank: int, n: int, bad: bool) -> Any:
    return comm.reduce(_freed(n) if bad else torch.ones(n), 0)


def _all_to_allv(comm: Any, rank: int, n: int, bad: bool) -> Any:
    rows = [n // comm.world_size] * comm.world_size
    x = _freed(sum(rows) * 2).view(-1, 2) if bad else torch.ones(sum(rows), 2)
    return comm.all_to_allv(x, rows)


_CASES: dict[str, _Case] = {
    "all_reduce-first": _ar_first,
    "all_reduce-warm": _ar_warm,
    "all_reduce-warm-in-place": _ar_warm_in_place,
    "all_reduce-warm-offset-view": _ar_warm_offset,
    "all_reduce-checked-op-offset-view": _ar_checked_op,
    "all_reduce-seen-then-shrunk": _ar_seen_then_shrunk,
    "all_reduce-seen-then-freed-far-offset": _ar_seen_then_freed_far,
    "all_reduce-seen-then-shrunk-in-place": _ar_seen_then_shrunk_in_place,
    "all_reduce-out": _ar_out,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "gather": _gather,
    "reduce": _reduce,
    "all_to_allv": _all_to_allv,
}


def freed_rank(rank: int, world_size: int, who: str) -> list[tuple[str, int, str, str, float]]:
    """Every case at both sizes; ``who``: "one" (the last rank is bad) or "all"."""
    pg = dist.new_group(backend="gloo")
    comm = CpuCommunicator(pg, torch.device("cpu"), unique_name="freed", timeout=20)
    bad = who == "all" or rank == world_size - 1
    got = []
    try:
        for name, case in _CASES.items():
            for n in (_SMALL, _LARGE):
                t0 = time.monotonic()
                try:
                    case(comm, rank, n, bad)
                    kind, msg = "ok", ""
                except Exception as e:  # the parent checks the class and message
                    kind, msg = type(e).__name__, str(e)
                elapsed = time.monotonic() - t0
                after = comm.all_reduce(torch.full((5,), float(rank)))  # still in step
                if after.tolist() != [float(sum(range(world_size)))] * 5:
                    kind = f"group broken after the call: {after.tolist()}"
                got.append((name, n, kind, msg[:300], elapsed))
    finally:
        comm.destroy()
        dist.destroy_process_group(pg)
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["one", "all"])
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_freed_storage_is_refused(dist_pool: Any, world_size: int, who: str) -> None:
    outs = dist_pool(world_size).run(freed_rank, who, timeout=110)
    failures = []
    for rank, rows in enumerate(outs):
        bad = who == "all" or rank == world_size - 1
        for name, n, kind, msg, elapsed in rows:
            if bad:
                ok = kind == "ValueError" and "storage" in msg and ("input_" in msg or "out" in msg)
            else:
                ok = kind == PeerRejectedError.__name__
            if not ok or elapsed > 5.0:
                failures.append(f"rank {rank} {name} n={n}: {kind} {msg[:120]!r} ({elapsed:.1f}s)")
    assert not failures, f"{len(failures)} failures: {failures[:6]}"
