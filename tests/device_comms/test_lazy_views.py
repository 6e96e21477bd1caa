"""Tensors whose raw elements are not laid out, or not valued, as they read.

Three kinds that torch calls contiguous: autograd's storage-less zeros
(``data_ptr()`` is 0), a lazily negated view (``z.conj().imag``
of one element: its bytes hold the un-negated values) and a tensor of at most
one element with a stride other than 1 (``x[3:4:2]``: its flat view cannot be
reinterpreted as bytes). Every collective and point-to-point call must send
their *values*, on shared memory and on gloo, or refuse them with a
ValueError naming the argument (an in-place broadcast into a lazy view).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator


def _neg(value: float, n: int = 1) -> torch.Tensor:
    """A contiguous view reading ``value`` whose bytes hold ``-value``."""
    z = torch.complex(torch.zeros(n), torch.full((n,), -float(value)))
    t = z.conj().imag
    assert t.is_neg() and (n > 1 or t.is_contiguous())
    return t


def _odd(value: float, n: int = 1) -> torch.Tensor:
    """``n`` (0 or 1) elements reading ``value``, with stride 2."""
    return torch.full((4,), float(value)).as_strided((n,), (2,))


_MAKERS: dict[str, Callable[..., torch.Tensor]] = {"neg": _neg, "odd": _odd, "odd-empty": _odd}


def _make(kind: str, value: float) -> torch.Tensor:
    return _MAKERS[kind](value, 0) if kind == "odd-empty" else _MAKERS[kind](value)


def _full(n: int, value: float) -> torch.Tensor:
    return torch.full((n,), float(value))


def lazy_rank(rank: int, world_size: int, mode: str, kind: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"lazy-{kind}",
                           use_shm=mode == "shm")
    n = 0 if kind == "odd-empty" else 1
    bad: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.resolve_neg(), want):
            bad.append(f"{name}: {got.tolist()} != {want.tolist()}")

    try:
        total = float(sum(range(1, world_size + 1)))
        check("all_reduce", comm.all_reduce(_make(kind, rank + 1)), _full(n, total))
        for _ in range(2):  # again: the repeated-call fast path
            check("all_reduce again", comm.all_reduce(_make(kind, rank + 1)), _full(n, total))
        check("all_gather", comm.all_gather(_make(kind, rank), 0),
              torch.cat([_full(n, r) for r in range(world_size)]))
        g = comm.gather(_make(kind, rank), 0, 0)
        if rank == 0:
            check("gather", g, torch.cat([_full(n, r) for r in range(world_size)]))
        if rank == 0:
            comm.send(_make(kind, 5), 1)
        elif rank == 1:
            check("send/recv", comm.recv((n,), torch.float32, 0), _full(n, 5))
        if kind == "neg":
            try:
                comm.broadcast(_make(kind, 7), 0)
                bad.append("broadcast into a lazy view was accepted")
            except ValueError as e:
                if "input_" not in str(e):
                    bad.append(f"broadcast error does not name input_: {e}")
            except Exception as e:  # the peers' PeerRejectedError
                if type(e).__name__ != "PeerRejectedError":
                    bad.append(f"broadcast raised {type(e).__name__}: {e}")
        else:
            b = _make(kind, 7 if rank == 0 else 0)
            check("broadcast", comm.broadcast(b, 0), _full(n, 7))
        check("after", comm.all_reduce(torch.ones(3)), _full(3, world_size))
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["shm", "gloo"])
@pytest.mark.parametrize("kind", sorted(_MAKERS))
def test_lazy_and_odd_views_send_their_values(dist_pool: Any, kind: str, mode: str,
                                              world_size: int) -> None:
    results = dist_pool(world_size).run(lazy_rank, mode, kind, timeout=80)
    assert results == [[]] * world_size


def zero_rank(rank: int, world_size: int, mode: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="lazy-zero",
                           use_shm=mode == "shm")
    bad: list[str] = []
    try:
        for n in (8, 40_000):  # one small step; the large schemes
            for _ in range(3):  # cold (checked) and warm (the cached entry) calls
                z = torch._efficientzerotensor(n)
                if not torch.equal(comm.all_reduce(z), torch.zeros(n)):
                    bad.append(f"all_reduce n={n}")
            if not torch.equal(comm.all_gather(torch._efficientzerotensor(n), 0),
                               torch.zeros(n * world_size)):
                bad.append(f"all_gather n={n}")
            if rank == 0:
                comm.send(torch._efficientzerotensor(n), 1)
            elif rank == 1 and not torch.equal(comm.recv((n,), torch.float32, 0), torch.zeros(n)):
                bad.append(f"send/recv n={n}")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_storage_less_zeros_are_sent_as_zeros(dist_pool: Any, mode: str, world_size: int) -> None:
    assert dist_pool(world_size).run(zero_rank, mode, timeout=80) == [[]] * world_size


def zero_out_rank(rank: int, world_size: int, mode: str, form: str) -> list[str]:
    """Rank 0 asks for its result in a storage-less zero tensor; the others call validly."""
    from device_comms.errors import PeerRejectedError

    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="lazy-zero-out",
                           use_shm=mode == "shm")
    bad: list[str] = []
    try:
        for n in (8, 40_000):
            for _ in range(3):  # cold (checked) and warm (the cached entry) calls
                comm.all_reduce(torch.ones(n))
            x = torch.ones(n)
            z = torch._efficientzerotensor(n)
            try:
                if rank != 0:
                    comm.all_reduce(x)
                elif form == "in-place":
                    comm.all_reduce(z, out=z)
                else:
                    comm.all_reduce(x, out=z)
                bad.append(f"n={n}: no error")
            except PeerRejectedError:  # before ValueError: it is one too
                if rank == 0:
                    bad.append(f"n={n}: the rejecting rank got PeerRejectedError")
            except ValueError as e:
                if rank != 0 or "out" not in str(e):
                    bad.append(f"n={n}: {e!r}")
            y = comm.all_reduce(torch.ones(n))  # the group is still in step
            if not torch.equal(y, torch.full((n,), float(world_size))):
                bad.append(f"n={n}: out of step after the rejection")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("form", ["in-place", "separate"])
@pytest.mark.parametrize("mode", ["shm", "gloo"])
def test_storage_less_zeros_are_refused_as_out(dist_pool: Any, mode: str, form: str,
                                               world_size: int) -> None:
    results = dist_pool(world_size).run(zero_out_rank, mode, form, timeout=80)
    assert results == [[]] * world_size
