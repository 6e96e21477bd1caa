"""The GroupCoordinator calls of the fault matrix: how each rank makes them, what
each must return, and how a culprit gets one wrong.

Every op runs on the TP group of a world of ``n`` ranks (TP = the whole world,
so the group has the TP broadcaster, a message queue from rank 0). An op is
either *collective* (every rank calls it) or *paired* (point to point: rank
``2k`` sends to rank ``2k + 1``). ``route`` says how its data travels, which
decides what a skipped or mismatched call can be caught by:

* ``comm``: the device communicator (shared memory, gloo or hierarchical),
  whose calls are signed;
* ``mq``: the TP broadcaster (the writer does not wait for its readers);
* ``cpu``: objects over the CPU group (gloo);
* ``barrier``: gloo's monitored barrier.

Inputs are small and exact (integers held in float32), so every expected
result is computed here, independently of the library.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Op", "OPS", "FOLLOW_UP", "other_op", "same_result", "x_of"]

# Variants of a call: None (good), "dtype" (float64 instead of float32),
# "shape" (a size or the layout differs), "other-op" (another op entirely).


def x_of(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: distinct small integers, exact in any float dtype."""
    return (torch.arange(math.prod(shape)).reshape(shape) + 100 * rank).to(dtype)


def _dt(bad: str | None) -> torch.dtype:
    return torch.float64 if bad == "dtype" else torch.float32


def _sum(n: int, shape: tuple[int, ...]) -> torch.Tensor:
    return sum((x_of(r, shape) for r in range(n)), torch.zeros(shape))


@dataclass(frozen=True)
class Op:
    """One GroupCoordinator call of the matrix.

    Attributes:
        name: Test-id name (``broadcast_object-mq``).
        methods: The GroupCoordinator method(s) an error must name (``op <m>``).
        call: ``call(g, rank, n, bad)`` makes the call on ``rank``.
        expect: ``expect(rank, n)``: what a good call returns on ``rank``.
        route: ``comm``, ``mq``, ``cpu`` or ``barrier`` (see the module docstring).
        paired: Point to point (rank ``2k`` -> ``2k + 1``) instead of collective.
        mismatches: The variants (``dtype``, ``shape``) a culprit can get wrong;
            ``skip`` and ``other-op`` apply to every op.
        shape_needs_receiver: The ``shape`` variant exists on receivers only.
    """

    name: str
    methods: tuple[str, ...]
    call: Callable[[Any, int, int, str | None], Any]
    expect: Callable[[int, int], Any]
    route: str = "comm"
    paired: bool = False
    mismatches: tuple[str, ...] = ("dtype", "shape")
    shape_needs_receiver: bool = False
    notes: str = field(default="", compare=False)

    def partner(self, rank: int, n: int) -> int | None:
        """The rank ``rank`` talks to in a paired op (None for a collective)."""
        if not self.paired:
            return None
        return rank + 1 if rank % 2 == 0 else rank - 1


# ---------------------------------------------------------------------- collectives
def _all_reduce(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.all_reduce(x_of(r, (4, 3 if bad == "shape" else 2), _dt(bad)))


def _all_gather(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.all_gather(x_of(r, (2, 4 if bad == "shape" else 3), _dt(bad)), dim=0)


def _all_gatherv(g: Any, r: int, n: int, bad: str | None) -> Any:
    sizes = [i + 1 for i in range(n)]
    if bad == "shape":  # its own entry still matches its input: only the lists differ
        sizes = [s + (0 if i == r else 1) for i, s in enumerate(sizes)]
    return g.all_gatherv(x_of(r, (sizes[r], 3), _dt(bad)), 0, sizes)


def _reduce_scatter(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.reduce_scatter(x_of(r, (2 * n, 5 if bad == "shape" else 3), _dt(bad)), dim=0)


def _reduce_scatterv(g: Any, r: int, n: int, bad: str | None) -> Any:
    sizes = [i + 1 for i in range(n)]
    if bad == "shape":  # same total, another split
        sizes = sizes[::-1]
    return g.reduce_scatterv(x_of(r, (sum(sizes), 3), _dt(bad)), 0, sizes)


def _gather(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.gather(x_of(r, (3 if bad == "shape" else 2, 2), _dt(bad)), dst=0, dim=0)


def _reduce(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.reduce(x_of(r, (5 if bad == "shape" else 4,), _dt(bad)), dst=0)


def _scatter(g: Any, r: int, n: int, bad: str | None) -> Any:
    src = x_of(0, (2 * n, 2 * n)) if r == 0 else None
    return g.scatter(src, 0, dim=1 if bad == "shape" else 0)


def _all_to_all(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.all_to_all(x_of(r, (2 * n, 4 if bad == "shape" else 3), _dt(bad)), 0, 0)


def _broadcast(g: Any, r: int, n: int, bad: str | None) -> Any:
    shape = (6,) if bad == "shape" else (5,)
    buf = x_of(0, shape, _dt(bad)) if r == 0 else torch.zeros(shape, dtype=_dt(bad))
    return g.broadcast(buf, src=0)


def _barrier(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.barrier()


# ---------------------------------------------------------------------- objects and dicts
def _object(src: int) -> dict[str, Any]:
    return {"from": src, "ids": [1, 2, 3], "text": "step metadata"}


def _broadcast_object(src: int) -> Callable[[Any, int, int, str | None], Any]:
    def call(g: Any, r: int, n: int, bad: str | None) -> Any:
        s = src if src >= 0 else n + src
        return g.broadcast_object(_object(s) if r == s else None, src=s)
    return call


def _broadcast_object_list(g: Any, r: int, n: int, bad: str | None) -> Any:
    if r == 0:
        return g.broadcast_object_list([_object(0), "x", 3], src=0)
    return g.broadcast_object_list([None] * (4 if bad == "shape" else 3), src=0)


def _tensor_dict(src: int) -> dict[str, Any]:
    return {"step": 3, "x": x_of(src, (4,)), "ids": [src, 7], "none": None}


def _broadcast_tensor_dict(src: int) -> Callable[[Any, int, int, str | None], Any]:
    def call(g: Any, r: int, n: int, bad: str | None) -> Any:
        s = src if src >= 0 else n + src
        return g.broadcast_tensor_dict(_tensor_dict(s) if r == s else None, src=s)
    return call


# ---------------------------------------------------------------------- point to point
def _send_recv(g: Any, r: int, n: int, bad: str | None) -> Any:
    shape = (5,) if bad == "shape" else (4,)
    if r % 2 == 0:
        return g.send(x_of(r, shape, _dt(bad)), dst=r + 1)
    return g.recv(shape, _dt(bad), src=r - 1)


def _send_recv_object(g: Any, r: int, n: int, bad: str | None) -> Any:
    if r % 2 == 0:
        return g.send_object(_object(r), dst=r + 1)
    return g.recv_object(src=r - 1)


def _send_recv_tensor_dict(g: Any, r: int, n: int, bad: str | None) -> Any:
    if r % 2 == 0:
        return g.send_tensor_dict(_tensor_dict(r), dst=r + 1)
    return g.recv_tensor_dict(src=r - 1)


def _dispatch(g: Any, r: int, n: int, bad: str | None) -> Any:
    rows = r % 3  # uneven, some ranks with none
    logits = x_of(r, (rows, 4 if bad == "shape" else 2))
    return g.dispatch(x_of(r, (rows, 3), _dt(bad)), logits)


def _combine(g: Any, r: int, n: int, bad: str | None) -> Any:
    h, _ = g.dispatch(x_of(r, (r % 3, 3)), x_of(r, (r % 3, 2)))
    if bad == "shape":  # the same rows, wider: the transport's signature differs
        h = torch.cat([h, h[:, :1]], 1)
    return g.combine(h.to(_dt(bad)) * (r + 1))


def _exp_dispatch(r: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([x_of(i, (i % 3, 3)) for i in range(n)], 0),
            torch.cat([x_of(i, (i % 3, 2)) for i in range(n)], 0))


def _exp_combine(r: int, n: int) -> torch.Tensor:
    return x_of(r, (r % 3, 3)) * sum(range(1, n + 1))


# ---------------------------------------------------------------------- expectations
def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[start : start + count]


def _exp_all_gatherv(r: int, n: int) -> torch.Tensor:
    return torch.cat([x_of(i, (i + 1, 3)) for i in range(n)], 0)


def _exp_reduce_scatterv(r: int, n: int) -> torch.Tensor:
    sizes = [i + 1 for i in range(n)]
    return _rows(_sum(n, (sum(sizes), 3)), sum(sizes[:r]), sizes[r])


def _exp_all_to_all(r: int, n: int) -> torch.Tensor:
    return torch.cat([_rows(x_of(j, (2 * n, 3)), 2 * r, 2) for j in range(n)], 0)


def _p2p_expect(value: Callable[[int], Any]) -> Callable[[int, int], Any]:
    return lambda r, n: None if r % 2 == 0 else value(r - 1)


OPS: dict[str, Op] = {op.name: op for op in [
    Op("all_reduce", ("all_reduce",), _all_reduce, lambda r, n: _sum(n, (4, 2))),
    Op("all_gather", ("all_gather",), _all_gather,
       lambda r, n: torch.cat([x_of(i, (2, 3)) for i in range(n)], 0)),
    Op("all_gatherv", ("all_gatherv",), _all_gatherv, _exp_all_gatherv),
    Op("reduce_scatter", ("reduce_scatter",), _reduce_scatter,
       lambda r, n: _rows(_sum(n, (2 * n, 3)), 2 * r, 2)),
    Op("reduce_scatterv", ("reduce_scatterv",), _reduce_scatterv, _exp_reduce_scatterv),
    Op("gather", ("gather",), _gather,
       lambda r, n: torch.cat([x_of(i, (2, 2)) for i in range(n)], 0) if r == 0 else None),
    Op("reduce", ("reduce",), _reduce, lambda r, n: _sum(n, (4,)) if r == 0 else None),
    Op("scatter", ("scatter",), _scatter,
       lambda r, n: _rows(x_of(0, (2 * n, 2 * n)), 2 * r, 2), mismatches=("shape",)),
    Op("all_to_all", ("all_to_all",), _all_to_all, _exp_all_to_all),
    Op("broadcast", ("broadcast",), _broadcast, lambda r, n: x_of(0, (5,))),
    Op("dispatch", ("all_gatherv_rows",), _dispatch, _exp_dispatch),
    Op("combine", ("all_gatherv_rows", "reduce_scatterv"), _combine, _exp_combine),
    Op("send_recv", ("send", "recv"), _send_recv, _p2p_expect(lambda s: x_of(s, (4,))),
       paired=True),
    Op("broadcast_object-mq", ("broadcast_object",), _broadcast_object(0),
       lambda r, n: _object(0), route="mq", mismatches=()),
    Op("broadcast_object-cpu", ("broadcast_object",), _broadcast_object(-1),
       lambda r, n: _object(n - 1), route="cpu", mismatches=()),
    Op("broadcast_object_list", ("broadcast_object_list",), _broadcast_object_list,
       lambda r, n: [_object(0), "x", 3], route="cpu", mismatches=("shape",),
       shape_needs_receiver=True),
    Op("send_recv_object", ("send_object", "recv_object"), _send_recv_object,
       _p2p_expect(_object), route="cpu", paired=True, mismatches=()),
    Op("broadcast_tensor_dict-mq", ("broadcast_tensor_dict",), _broadcast_tensor_dict(0),
       lambda r, n: _tensor_dict(0), route="mq", mismatches=()),
    Op("broadcast_tensor_dict-cpu", ("broadcast_tensor_dict",), _broadcast_tensor_dict(-1),
       lambda r, n: _tensor_dict(n - 1), route="cpu", mismatches=()),
    Op("send_recv_tensor_dict", ("send_tensor_dict", "recv_tensor_dict"), _send_recv_tensor_dict,
       _p2p_expect(_tensor_dict), route="cpu", paired=True, mismatches=()),
    Op("barrier", ("barrier",), _barrier, lambda r, n: None, route="barrier", mismatches=()),
]}


def _follow_up(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.all_reduce(torch.ones(7, dtype=torch.int16))


#: The call every rank makes after the op under test (a skipping culprit makes
#: it in place of the op): it differs from every op's call in op, dtype or shape.
FOLLOW_UP = Op("follow-up all_reduce", ("all_reduce",), _follow_up,
               lambda r, n: torch.full((7,), n, dtype=torch.int16))


def _other_gather(g: Any, r: int, n: int, bad: str | None) -> Any:
    return g.all_gather(x_of(r, (2, 3)), dim=0)


def other_op(op: Op) -> Op:
    """What a culprit calls in place of ``op`` in the ``other-op`` fault."""
    if op.name == "all_gather":
        return Op("all_reduce (other op)", ("all_reduce",), _all_reduce, OPS["all_reduce"].expect)
    return Op("all_gather (other op)", ("all_gather",), _other_gather, OPS["all_gather"].expect)


def same_result(got: Any, want: Any) -> bool:
    """Exact equality of results: tensors (values, dtype, shape), dicts, lists, plain values."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and torch.equal(got, want))
    if isinstance(want, dict):
        return (isinstance(got, dict) and list(got) == list(want)
                and all(same_result(got[k], want[k]) for k in want))
    if isinstance(want, (list, tuple)):
        return (type(got) is type(want) and len(got) == len(want)
                and all(same_result(a, b) for a, b in zip(got, want, strict=True)))
    return type(got) is type(want) and got == want
