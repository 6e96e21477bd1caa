"""GroupCoordinator's collectives on real gloo process groups, checked against local references.

World sizes 1, 2 and 4 run every method on the world group (whose tensors go
through the registry's CPU communicator) and, from 2 ranks up, on a group forced
onto plain gloo (``device_communicator="torch"``, the portable fallback);
TP=2 x PP=2 runs them again on the TP and PP groups (group-local ranks that are
not global ranks) and on the size-1 DP group.

Each case (one method with one dtype, destination, source or rank pair) is its
own test id, run on the shared pool ranks (``dist_pool``): a broken case fails
that id alone, and the pool starts fresh ranks for the next one. The TP/PP ids
are one per method, because every run builds the model-parallel groups again
(the pool tears them down after each run, ~0.3 s).

The functions below run on the ranks as ``fn(rank, world_size, *args)`` (the
pool pickles them by reference; inputs and references come from
``tests/coordinator/rank_checks.py``). Every case returns the names of the
checks it made, identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from device_comms import ReduceOp
from tests.coordinator.rank_checks import (
    DIMS,
    DTYPES,
    EXOTIC,
    allowed,
    expect_equal,
    expect_raises,
    make,
    ref_reduce,
    with_size,
)

WORLD_SIZES = [1, 2, 4]


# ---------------------------------------------------------------------- the case tables
@dataclass(frozen=True)
class Case:
    """One test id: ``check(g, tag, *args)`` runs on every rank of group ``g``."""

    name: str
    check: Callable[..., list[str]]
    args: tuple[Any, ...] = ()

    @property
    def method(self) -> str:
        return self.name.split("/")[0]


def _dt(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def collective_cases(n: int) -> list[Case]:
    """Every tensor collective of a group of ``n`` ranks."""
    c = [Case(f"all_reduce/{_dt(dt)}", _all_reduce, (dt,)) for dt in DTYPES]
    c += [Case("all_reduce/noncontiguous", _all_reduce_noncontiguous),
          Case("all_reduce/op-by-name", _all_reduce_op_by_name),
          Case("all_reduce/large-odd", _all_reduce_large_odd),
          Case("all_reduce/0-dim", _all_reduce_0_dim)]
    c += [Case(f"all_gather/{_dt(dt)}", _all_gather, (dt,)) for dt in DTYPES]
    c += [Case("all_gather/default-dim", _all_gather_default_dim),
          Case("all_gather/large-odd", _all_gather_large_odd)]
    c += [Case(f"all_gatherv/{_dt(dt)}", _all_gatherv, (dt,)) for dt in DTYPES]
    c += [Case("all_gatherv/list-input", _all_gatherv_list_input),
          Case("all_gatherv/sizes-None", _all_gatherv_sizes_none)]
    c += [Case(f"reduce_scatter/{_dt(dt)}", _reduce_scatter, (dt,)) for dt in DTYPES]
    c += [Case(f"reduce_scatterv/{_dt(dt)}", _reduce_scatterv, (dt,)) for dt in DTYPES]
    c += [Case("reduce_scatterv/large", _reduce_scatterv_large)]
    c += [Case(f"gather/dst{dst}", _gather, (dst,)) for dst in range(n)]
    c += [Case(f"reduce/dst{dst}", _reduce, (dst,)) for dst in range(n)]
    c += [Case(f"scatter/src{src}", _scatter, (src,)) for src in range(n)]
    c += [Case(f"all_to_all/{_dt(dt)}", _all_to_all, (dt,)) for dt in DTYPES]
    c += [Case(f"all_to_allv/{_dt(dt)}", _all_to_allv, (dt,)) for dt in DTYPES + (torch.bool,)]
    c += [Case("all_to_allv/mismatch", _all_to_allv_mismatch)]
    c += [Case(f"broadcast/src{src}", _broadcast, (src,)) for src in range(n)]
    c += [Case("empty", _empty)]
    c += [Case(f"exotic/{_dt(dt)}", _exotic, (dt,)) for dt in EXOTIC]
    if n > 1:  # point to point: explicit pairs, then the default next/prev ring
        c += [Case(f"send/{a}->{b}", _send, (a, b)) for a in range(n) for b in range(n) if a != b]
        c += [Case("send/default-ring", _send_default_ring)]
    return c


def object_cases(n: int) -> list[Case]:
    """Object collectives, barrier and graph capture of a group of ``n`` ranks."""
    c = [Case(f"broadcast_object/src{src}", _broadcast_object, (src,)) for src in range(n)]
    if n > 1:
        c += [Case(f"send_object/{a}->{b}", _send_object, (a, b))
              for a in range(n) for b in range(n) if a != b]
        c += [Case("send_object/None", _send_object_none),
              Case("send_object/empty-encoding", _send_object_empty_encoding)]
    c += [Case("barrier", _barrier), Case("graph_capture", _graph_capture)]
    return c


def world_cases(n: int) -> list[Case]:
    """Everything the world group of ``n`` ranks is checked on."""
    single = [Case("single-rank", _single_rank)] if n == 1 else []
    return collective_cases(n) + object_cases(n) + single


# ---------------------------------------------------------------------- on the ranks: entry points
_FORCED_GLOO: dict[int, Any] = {}  # this rank's group forced onto plain gloo, built once


def _group(kind: str) -> Any:
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group

    world = get_world_group()
    if kind == "world":
        return world
    assert kind == "gloo", kind
    if world.world_size not in _FORCED_GLOO:
        # The portable path (plain torch.distributed / gloo) that faster
        # communicators fall back to, forced through the registry name. It
        # lives as long as the pool's ranks (a failed run restarts them).
        g = GroupCoordinator([list(range(world.world_size))], world.rank, "gloo", True,
                             group_name="gloo", device_communicator="torch")
        assert type(g.comm).__name__ == "TorchDistributedCommunicator"
        _FORCED_GLOO[world.world_size] = g
    return _FORCED_GLOO[world.world_size]


def _run_cases(rank: int, world_size: int, kind: str, cases: list[Case]) -> list[str]:
    """``cases`` on the world group (``kind="world"``) or the forced-gloo group."""
    g = _group(kind)
    assert g.rank == rank and g.world_size == world_size
    return [name for c in cases for name in c.check(g, kind, *c.args)]


def _run_cases_on_tp_and_pp(rank: int, world_size: int, cases: list[Case]) -> list[str]:
    """``cases`` on the TP group, then on the PP group, of TP=2 x PP=2."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    done: list[str] = []
    for tag, g in (("tp", ps.get_tp_group()), ("pp", ps.get_pp_group())):
        done += [name for c in cases for name in c.check(g, tag, *c.args)]
    return done


def _run_single_rank_on_dp(rank: int, world_size: int) -> list[str]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    return _single_rank(ps.get_dp_group(), "dp")


def _topology_of(g: Any) -> dict[str, Any]:
    """The topology properties of ``g`` (checked against an expected layout by the test)."""
    return {
        "ranks": list(g.ranks), "rank": g.rank, "world_size": g.world_size,
        "rank_in_group": g.rank_in_group, "first_rank": g.first_rank, "last_rank": g.last_rank,
        "is_first_rank": g.is_first_rank, "is_last_rank": g.is_last_rank,
        "next_rank": g.next_rank, "prev_rank": g.prev_rank,
    }


def _tp2_pp2_topologies(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    return {"tp": _topology_of(ps.get_tp_group()), "pp": _topology_of(ps.get_pp_group()),
            "dp": _topology_of(ps.get_dp_group())}


def _world_topology_and_destroyed_group(rank: int, world_size: int) -> dict[str, Any]:
    """The world group's topology; a temporary group's destroy() is idempotent,
    unregisters the group, and the destroyed group refuses work."""
    from coordinator import GroupCoordinator, NotInitializedError, get_group_by_name
    from coordinator.errors import ClosedError
    from coordinator.parallel_state import get_world_group

    tmp = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="tmpgroup")
    assert get_group_by_name(tmp.unique_name) is tmp
    expect_equal("tmp/all_reduce", tmp.all_reduce(torch.ones(3)),
                 torch.full((3,), float(world_size)))
    tmp.destroy()
    tmp.destroy()
    expect_raises("tmp/after-destroy", ValueError, lambda: get_group_by_name(tmp.unique_name),
                  tmp.unique_name)
    # A destroyed group refuses work (instead of falling back to the world group).
    # At every world size: a group of one rank refuses as well (it does not just return).
    dead = [("all_reduce", lambda: tmp.all_reduce(torch.ones(2))),
            ("graph_capture", lambda: tmp.graph_capture().__enter__()),
            ("broadcast_object", lambda: tmp.broadcast_object(1, 0)),
            ("broadcast_object_list", lambda: tmp.broadcast_object_list([1], 0)),
            ("barrier", tmp.barrier),
            ("broadcast_tensor_dict", lambda: tmp.broadcast_tensor_dict({"a": 1}, 0)),
            ("send_tensor_dict", lambda: tmp.send_tensor_dict({"a": 1})),
            ("recv_tensor_dict", lambda: tmp.recv_tensor_dict()),
            ("isend_tensor_dict", lambda: tmp.isend_tensor_dict({"a": 1})),
            ("irecv_tensor_dict", lambda: tmp.irecv_tensor_dict())]
    if world_size > 1:
        dead += [("send_object", lambda: tmp.send_object(1, (rank + 1) % world_size))]
    for name, call in dead:
        # ClosedError: a point-to-point call of a larger group finds it closed in its turn
        expect_raises(f"tmp/dead/{name}", (NotInitializedError, ClosedError), call, "destroyed",
                      tmp.unique_name)
    return _topology_of(get_world_group())


# ---------------------------------------------------------------------- on the ranks: the cases
# Each takes the group ``g`` and a ``tag`` naming it (it seeds the inputs), and
# returns the names of the checks it made.
def _all_reduce(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Every op on ``dt``; forbidden combinations are TypeErrors."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for op in ReduceOp:
        case = f"{tag}/all_reduce/{dt}/{op.name}"
        x = make(me, (2, 3, 4), dt, case)
        x0 = x.clone()
        if not allowed(op, dt):
            expect_raises(case, TypeError, lambda: g.all_reduce(x, op), "op", str(dt))
        else:
            y = g.all_reduce(x, op)
            expect_equal(case, y, ref_reduce([make(r, (2, 3, 4), dt, case) for r in range(n)], op))
            assert y.data_ptr() != x.data_ptr(), f"{case}: result aliases the input"
        expect_equal(case + "/input-untouched", x, x0)
        done.append(case)
    assert len(done) == 8, done
    return done


def _all_reduce_noncontiguous(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_reduce/noncontiguous"
    x = make(me, (4, 3, 2), torch.float32, case).transpose(0, 2)
    want = ref_reduce([make(r, (4, 3, 2), torch.float32, case).transpose(0, 2) for r in range(n)],
                      ReduceOp.SUM)
    expect_equal(case, g.all_reduce(x), want)
    return [case]


def _all_reduce_op_by_name(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_reduce/op-by-name"
    x = make(me, (5,), torch.int64, case)
    expect_equal(case, g.all_reduce(x, "max"),
                 ref_reduce([make(r, (5,), torch.int64, case) for r in range(n)], ReduceOp.MAX))
    return [case]


def _all_reduce_large_odd(g: Any, tag: str) -> list[str]:
    """Larger than a shared-memory slot (32 MiB workspace by default, split in
    2 x local ranks) and odd-sized, so chunked / big-message paths run too."""
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_reduce/large-odd"
    big = (9 << 20) // 4 + 3
    x = make(me, (big,), torch.float32, case)
    expect_equal(case, g.all_reduce(x),
                 ref_reduce([make(r, (big,), torch.float32, case) for r in range(n)], ReduceOp.SUM))
    return [case]


def _all_reduce_0_dim(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_reduce/0-dim"
    expect_equal(case, g.all_reduce(torch.tensor(float(me + 1))), torch.tensor(n * (n + 1) / 2))
    return [case]


def _all_gather(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Dims 0, 1 and -1 of a 3-D tensor."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for dim in DIMS:
        case = f"{tag}/all_gather/{dt}/{dim}"
        x = make(me, (2, 3, 4), dt, case)
        want = torch.cat([make(r, (2, 3, 4), dt, case) for r in range(n)], dim)
        expect_equal(case, g.all_gather(x, dim), want)
        done.append(case)
    return done


def _all_gather_default_dim(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_gather/default-dim"
    expect_equal(case, g.all_gather(torch.full((2, 2), float(me))),
                 torch.cat([torch.full((2, 2), float(r)) for r in range(n)], -1))
    return [case]


def _all_gather_large_odd(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_gather/large-odd"
    big = (9 << 20) // 2 + 1
    x = make(me, (big,), torch.bfloat16, case)
    expect_equal(case, g.all_gather(x, 0),
                 torch.cat([make(r, (big,), torch.bfloat16, case) for r in range(n)]))
    return [case]


def _reduce_scatterv_large(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/reduce_scatterv/large"
    rows = [(1 << 20) + 1, 7, 0, 5][:n] if n > 1 else [(1 << 20) + 1]
    x = make(me, (sum(rows), 3), torch.float32, case)
    full = ref_reduce([make(r, (sum(rows), 3), torch.float32, case) for r in range(n)],
                      ReduceOp.SUM)
    expect_equal(case, g.reduce_scatterv(x, 0, rows), full.split(rows, 0)[me])
    return [case]


def _gatherv_sizes(n: int) -> list[int]:
    """Uneven all_gatherv sizes (one rank contributes nothing at world size 4)."""
    return [1, 3, 0, 2][:n] if n > 1 else [3]


def _all_gatherv(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    sizes = _gatherv_sizes(n)
    done = []
    for dim in DIMS:
        case = f"{tag}/all_gatherv/{dt}/{dim}"
        shapes = [with_size((2, 3, 4), dim, s) for s in sizes]
        x = make(me, shapes[me], dt, case)
        want = torch.cat([make(r, shapes[r], dt, case) for r in range(n)], dim)
        expect_equal(case, g.all_gatherv(x, dim, sizes), want)
        expect_equal(case + "/tuple-sizes", g.all_gatherv(x, dim, tuple(sizes)), want)
        done.append(case)
    return done


def _all_gatherv_list_input(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    sizes = _gatherv_sizes(n)
    case = f"{tag}/all_gatherv/list-input"
    xs = [make(me, (sizes[me], 2), torch.float32, case),
          make(me, (sizes[me],), torch.int64, case + "i")]
    got = g.all_gatherv(xs, 0, sizes)
    assert isinstance(got, list) and len(got) == 2, f"{case}: got {type(got).__name__}"
    expect_equal(case + "[0]", got[0],
                 torch.cat([make(r, (sizes[r], 2), torch.float32, case) for r in range(n)]))
    expect_equal(case + "[1]", got[1],
                 torch.cat([make(r, (sizes[r],), torch.int64, case + "i") for r in range(n)]))
    return [case]


def _all_gatherv_sizes_none(g: Any, tag: str) -> list[str]:
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/all_gatherv/sizes-None"
    x = make(me, (2, 2), torch.float32, case)
    expect_equal(case, g.all_gatherv(x, 1),
                 torch.cat([make(r, (2, 2), torch.float32, case) for r in range(n)], 1))
    return [case]


def _reduce_scatter(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Dims x a few ops; every dim divisible by n."""
    n, me = g.world_size, g.rank_in_group
    shape = (2 * n, 3 * n, n)
    ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX) if dt.is_floating_point else (
        ReduceOp.SUM, ReduceOp.MIN, ReduceOp.BXOR)
    done = []
    for dim in DIMS:
        for op in ops:
            case = f"{tag}/reduce_scatter/{dt}/{dim}/{op.name}"
            x = make(me, shape, dt, case)
            x0 = x.clone()
            full = ref_reduce([make(r, shape, dt, case) for r in range(n)], op)
            expect_equal(case, g.reduce_scatter(x, dim, op), full.chunk(n, dim)[me].contiguous())
            expect_equal(case + "/input-untouched", x, x0)
            done.append(case)
    return done


def _reduce_scatterv(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Uneven sizes summing to the dim."""
    n, me = g.world_size, g.rank_in_group
    vsizes = [2, 1, 0, 3][:n] if n > 1 else [2]
    total = sum(vsizes)
    ops = (ReduceOp.SUM, ReduceOp.MAX) if dt.is_floating_point else (ReduceOp.SUM, ReduceOp.BOR)
    done = []
    for dim in DIMS:
        for op in ops:
            case = f"{tag}/reduce_scatterv/{dt}/{dim}/{op.name}"
            shp = with_size((2, 3, 4), dim, total)
            x = make(me, shp, dt, case)
            full = ref_reduce([make(r, shp, dt, case) for r in range(n)], op)
            want = full.split(vsizes, dim)[me].contiguous()
            expect_equal(case, g.reduce_scatterv(x, dim, vsizes, op), want)
            done.append(case)
    return done


def _gather(g: Any, tag: str, dst: int) -> list[str]:
    """To ``dst``; dims rotate over dtypes."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for i, dim in enumerate(DIMS):
        dt = DTYPES[(dst + i) % 3]
        case = f"{tag}/gather/{dst}/{dim}/{dt}"
        x = make(me, (2, 3, 4), dt, case)
        got = g.gather(x, dst, dim)
        if me == dst:
            expect_equal(case, got,
                         torch.cat([make(r, (2, 3, 4), dt, case) for r in range(n)], dim))
        else:
            assert got is None, f"{case}: non-dst rank got {type(got).__name__}, want None"
        done.append(case)
    return done


def _reduce(g: Any, tag: str, dst: int) -> list[str]:
    """To ``dst``, a few ops per dtype."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for dt in DTYPES:
        for op in ((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN) if dt.is_floating_point
                   else (ReduceOp.SUM, ReduceOp.BAND, ReduceOp.MAX)):
            case = f"{tag}/reduce/{dst}/{dt}/{op.name}"
            x = make(me, (3, 4), dt, case)
            x0 = x.clone()
            got = g.reduce(x, dst, op)
            if me == dst:
                expect_equal(case, got,
                             ref_reduce([make(r, (3, 4), dt, case) for r in range(n)], op))
            else:
                assert got is None, f"{case}: non-dst rank got {type(got).__name__}"
            expect_equal(case + "/input-untouched", x, x0)
            done.append(case)
    return done


def _scatter(g: Any, tag: str, src: int) -> list[str]:
    """From ``src``; non-src ranks pass None."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for i, dim in enumerate(DIMS):
        dt = DTYPES[(src + i) % 3]
        case = f"{tag}/scatter/{src}/{dim}/{dt}"
        full = make(src, (2 * n, 3 * n, 2 * n), dt, case)
        got = g.scatter(full if me == src else None, src, dim)
        expect_equal(case, got, full.chunk(n, dim)[me].contiguous())
        done.append(case)
    return done


def _all_to_all(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Several (scatter_dim, gather_dim) pairs."""
    n, me = g.world_size, g.rank_in_group
    shape = (2 * n, 3 * n, n)
    done = []
    for sd, gd in ((0, 0), (0, 1), (1, -1), (-1, 0), (2, 2)):
        case = f"{tag}/all_to_all/{dt}/{sd}/{gd}"
        x = make(me, shape, dt, case)
        want = torch.cat([make(r, shape, dt, case).chunk(n, sd)[me] for r in range(n)], gd)
        expect_equal(case, g.all_to_all(x, sd, gd), want)
        done.append(case)
    return done


def _all_to_allv(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Uneven splits (zeros included), sizes given or exchanged, 1-D and 3-D rows."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for k, row in enumerate(((), (3,), (2, 1, 4))):
        case = f"{tag}/all_to_allv/{dt}/{k}"
        # sizes[i][j]: rows from rank i to rank j
        sizes = [[(3 * i + 5 * j + k) % 4 for j in range(n)] for i in range(n)]
        x = make(me, (sum(sizes[me]),) + row, dt, case)
        want = torch.cat([make(r, (sum(sizes[r]),) + row, dt, case).split(sizes[r])[me]
                          for r in range(n)])
        recv = [sizes[r][me] for r in range(n)] if k % 2 else None
        expect_equal(case, g.all_to_allv(x, sizes[me], recv), want)
        done.append(case)
    return done


def _all_to_allv_mismatch(g: Any, tag: str) -> list[str]:
    """recv_sizes that disagree with a sender raise CollectiveMismatch on every rank."""
    from coordinator import CollectiveMismatch

    n, me = g.world_size, g.rank_in_group
    x = torch.ones(n, 2)
    recv = [1] * n
    if me == n - 1:
        recv[0] = 2
    case = f"{tag}/all_to_allv/mismatch"
    if n == 1:
        expect_raises(case, CollectiveMismatch, lambda: g.all_to_allv(x, [1], [2]), "recv_sizes")
    else:
        expect_raises(case, CollectiveMismatch, lambda: g.all_to_allv(x, [1] * n, recv),
                      f"rank {n - 1} expects 2 row(s) from rank 0")
    expect_equal(f"{case}/after", g.all_to_allv(x, [1] * n), torch.ones(n, 2))
    return [case]


def _broadcast(g: Any, tag: str, src: int) -> list[str]:
    """In place, from ``src``; also a 0-dim tensor."""
    me = g.rank_in_group
    done = []
    for dt in DTYPES:
        case = f"{tag}/broadcast/{src}/{dt}"
        want = make(src, (3, 5), dt, case)
        buf = want.clone() if me == src else torch.zeros(3, 5, dtype=dt)
        out = g.broadcast(buf, src)
        assert out is buf, f"{case}: broadcast must fill and return the caller's tensor"
        expect_equal(case, buf, want)
        done.append(case)
    buf = torch.tensor(7.0 + src) if me == src else torch.tensor(0.0)
    g.broadcast(buf, src)
    expect_equal(f"{tag}/broadcast/0-dim/{src}", buf, torch.tensor(7.0 + src))
    return done


def _empty(g: Any, tag: str) -> list[str]:
    """Empty tensors through every collective."""
    n, me = g.world_size, g.rank_in_group
    case = f"{tag}/empty"
    e = torch.empty(0, 2 * n)
    expect_equal(case + "/all_reduce", g.all_reduce(e), e)
    expect_equal(case + "/all_gather", g.all_gather(e, 1), torch.empty(0, 2 * n * n))
    expect_equal(case + "/all_gatherv", g.all_gatherv(e, 0, [0] * n), e)
    expect_equal(case + "/reduce_scatter", g.reduce_scatter(e, 1), torch.empty(0, 2))
    expect_equal(case + "/reduce_scatterv", g.reduce_scatterv(e, 0, [0] * n), e)
    expect_equal(case + "/broadcast", g.broadcast(e.clone(), 0), e)
    expect_equal(case + "/scatter", g.scatter(e if me == 0 else None, 0, 1), torch.empty(0, 2))
    expect_equal(case + "/all_to_all", g.all_to_all(e.t().contiguous(), 0, 1), torch.empty(2, 0))
    got = g.gather(e, 0, 1)
    assert (got is None) == (me != 0), f"{case}/gather"
    return [case]


def _exotic(g: Any, tag: str, dt: torch.dtype) -> list[str]:
    """Data movement of a type without backend kernels (moved as raw bytes)."""
    n, me = g.world_size, g.rank_in_group
    sizes = _gatherv_sizes(n)
    case = f"{tag}/exotic/{dt}"
    shape = (2, 2 * n, 3)
    xs = [make(r, shape, dt, case) for r in range(n)]
    expect_equal(case + "/all_gather", g.all_gather(xs[me], 1), torch.cat(xs, 1))
    vs = [make(r, (sizes[r], 2), dt, case + "v") for r in range(n)]
    expect_equal(case + "/all_gatherv", g.all_gatherv(vs[me], 0, sizes), torch.cat(vs, 0))
    got = g.gather(xs[me], n - 1, -1)
    if me == n - 1:
        expect_equal(case + "/gather", got, torch.cat(xs, -1))
    expect_equal(case + "/scatter", g.scatter(xs[0] if me == 0 else None, 0, 1),
                 xs[0].chunk(n, 1)[me].contiguous())
    expect_equal(case + "/all_to_all", g.all_to_all(xs[me], 1, 0),
                 torch.cat([x.chunk(n, 1)[me] for x in xs], 0))
    buf = xs[me].clone() if me == n - 1 else torch.zeros(shape, dtype=dt)
    g.broadcast(buf, n - 1)
    expect_equal(case + "/broadcast", buf, xs[n - 1])
    if n > 1:
        if me == 0:
            g.send(xs[0], n - 1)
        elif me == n - 1:
            expect_equal(case + "/send", g.recv(shape, dt, 0), xs[0])
    return [case]


def _send(g: Any, tag: str, a: int, b: int) -> list[str]:
    """Rank ``a`` sends to rank ``b`` (the others stand by)."""
    me = g.rank_in_group
    case = f"{tag}/send/{a}->{b}"
    dt = DTYPES[(a + b) % 3]
    if me == a:
        g.send(make(a, (2, 3), dt, case), b)
    elif me == b:
        expect_equal(case, g.recv((2, 3), dt, a), make(a, (2, 3), dt, case))
    return [case]


def _send_default_ring(g: Any, tag: str) -> list[str]:
    """Default next/prev peers (the even/odd schedule needs an even group size)."""
    n, me = g.world_size, g.rank_in_group
    assert n % 2 == 0, n
    case = f"{tag}/send/default-ring"
    x = make(me, (4,), torch.bfloat16, case)
    prev = (me - 1) % n
    if me % 2 == 0:
        g.send(x)
        got = g.recv((4,), torch.bfloat16)
    else:
        got = g.recv((4,), torch.bfloat16)
        g.send(x)
    expect_equal(case, got, make(prev, (4,), torch.bfloat16, case))
    return [case]


def _broadcast_object(g: Any, tag: str, src: int) -> list[str]:
    me = g.rank_in_group
    obj = {"src": src, "tag": tag, "nested": [1, "two", None, (3.5,)], "bytes": b"\x00\xff"}
    got = g.broadcast_object(obj if me == src else None, src)
    assert got == obj, f"{tag}/broadcast_object/{src}: got {got!r}"
    lst = [src, "x" * src, {"k": [src]}] if me == src else [None, None, None]
    out = g.broadcast_object_list(lst, src)
    assert out is lst, f"{tag}/broadcast_object_list/{src}: must fill the caller's list"
    assert lst == [src, "x" * src, {"k": [src]}], f"{tag}/broadcast_object_list/{src}: {lst!r}"
    return [f"{tag}/broadcast_object/{src}", f"{tag}/broadcast_object_list/{src}"]


def _send_object(g: Any, tag: str, a: int, b: int) -> list[str]:
    me = g.rank_in_group
    if me in (a, b):
        payload = {"from": a, "to": b, "t": torch.arange(3) * a, "big": "z" * 5000}
        if me == a:
            g.send_object(payload, b)
        else:
            got = g.recv_object(a)
            assert got["from"] == a and got["to"] == b and got["big"] == payload["big"]
            assert torch.equal(got["t"], payload["t"])
    return [f"{tag}/send_object/{a}->{b}"]


def _send_object_none(g: Any, tag: str) -> list[str]:
    me = g.rank_in_group
    if me == 0:
        g.send_object(None, 1)
    elif me == 1:
        assert g.recv_object(0) is None, "send_object(None) must arrive as None"
    return [f"{tag}/send_object/None"]


def _send_object_empty_encoding(g: Any, tag: str) -> list[str]:
    """A codec may encode an object as zero bytes."""
    me = g.rank_in_group
    old, g.codec = g.codec, EmptyForNoneCodec()
    try:
        if me == 0:
            g.send_object(None, 1)
            g.send_object([1, 2], 1)
        elif me == 1:
            assert g.recv_object(0) is None
            assert g.recv_object(0) == [1, 2]
    finally:
        g.codec = old
    return [f"{tag}/send_object/empty-encoding"]


class EmptyForNoneCodec:
    """An object codec that encodes None as zero bytes."""

    def dumps(self, obj: Any) -> bytes:
        import pickle

        return b"" if obj is None else pickle.dumps(obj)

    def loads(self, data: Any) -> Any:
        import pickle

        return None if not len(data) else pickle.loads(data)


def _barrier(g: Any, tag: str) -> list[str]:
    g.barrier()
    g.barrier(timeout=60.0)
    return [f"{tag}/barrier"]


def _graph_capture(g: Any, tag: str) -> list[str]:
    n = g.world_size
    with g.graph_capture() as ctx:
        assert ctx.stream is None, f"graph_capture on CPU must yield stream None, got {ctx.stream}"
        with g.graph_capture(ctx) as inner:
            assert inner is ctx, "a nested graph_capture must reuse the outer context"
            expect_equal(f"{tag}/graph_capture/all_reduce", g.all_reduce(torch.ones(2)),
                         torch.full((2,), float(n)))
    return [f"{tag}/graph_capture"]


def _single_rank(g: Any, tag: str) -> list[str]:
    """A group of one answers every call locally (and refuses point-to-point to itself)."""
    assert g.world_size == 1
    x = make(0, (2, 3, 4), torch.bfloat16, tag)
    for name, got in (
        ("all_reduce", g.all_reduce(x)), ("all_gather", g.all_gather(x, 1)),
        ("all_gatherv", g.all_gatherv(x, 1, [3])), ("reduce_scatter", g.reduce_scatter(x, 0)),
        ("reduce_scatterv", g.reduce_scatterv(x, -1, [4])), ("gather", g.gather(x, 0, 2)),
        ("reduce", g.reduce(x, 0, ReduceOp.MAX)), ("scatter", g.scatter(x, 0, 1)),
        ("all_to_all", g.all_to_all(x, 0, 2)),
    ):
        expect_equal(f"{tag}/{name}", got, x)
        assert got.data_ptr() != x.data_ptr(), f"{tag}/{name}: must return a new tensor"
    assert g.broadcast(x, 0) is x
    obj = {"a": [1]}
    assert g.broadcast_object(obj, 0) is obj
    lst = [1, 2]
    assert g.broadcast_object_list(lst, 0) is lst
    d = {"t": x, "s": "str", "n": None}
    got = g.broadcast_tensor_dict(d, 0)
    assert got == d and got["t"] is x
    assert g.send_tensor_dict(d) is d  # as vLLM: a one-rank group hands the dict back
    assert g.recv_tensor_dict() is None
    g.barrier()
    g.barrier(timeout=5.0)
    expect_raises(f"{tag}/graph_capture", TypeError,
                  lambda: g.graph_capture("x").__enter__(), "graph_capture_context")
    for name, fn in (("send", lambda: g.send(x)), ("recv", lambda: g.recv((2,), torch.float32)),
                     ("send_object", lambda: g.send_object(1, 0)),
                     ("recv_object", lambda: g.recv_object(0))):
        expect_raises(f"{tag}/{name}", ValueError, fn, "this rank")
    assert (g.first_rank, g.last_rank, g.next_rank, g.prev_rank) == (g.rank,) * 4
    assert g.is_first_rank and g.is_last_rank
    with g.graph_capture() as ctx:
        assert ctx.stream is None
    return [f"{tag}/single-rank"]


# ---------------------------------------------------------------------- tests
def _ran_the_same_checks(results: list[list[str]]) -> list[str]:
    assert results[0], "the case checked nothing"
    assert all(r == results[0] for r in results), "ranks checked different case lists"
    return results[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,case", [
    pytest.param(ws, c, id=f"ws{ws}-{c.name}") for ws in WORLD_SIZES for c in world_cases(ws)
])
def test_world_group(dist_pool, world_size, case):
    _ran_the_same_checks(dist_pool(world_size).run(_run_cases, "world", [case], timeout=90))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,case", [
    pytest.param(ws, c, id=f"ws{ws}-{c.name}")
    for ws in WORLD_SIZES[1:] for c in collective_cases(ws)
])
def test_group_forced_onto_plain_gloo(dist_pool, world_size, case):
    _ran_the_same_checks(dist_pool(world_size).run(_run_cases, "gloo", [case], timeout=90))


def _by_method(cases: list[Case]) -> dict[str, list[Case]]:
    out: dict[str, list[Case]] = {}
    for c in cases:
        out.setdefault(c.method, []).append(c)
    return out


TP_PP_METHODS = _by_method(collective_cases(2) + object_cases(2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", list(TP_PP_METHODS))
def test_tp_and_pp_groups_of_tp2_pp2(dist_pool, method):
    checked = _ran_the_same_checks(
        dist_pool(4).run(_run_cases_on_tp_and_pp, TP_PP_METHODS[method], timeout=90))
    assert {c.split("/")[0] for c in checked} == {"tp", "pp"}


@pytest.mark.timeout(120)
def test_size_1_dp_group_of_tp2_pp2_answers_locally(dist_pool):
    _ran_the_same_checks(dist_pool(4).run(_run_single_rank_on_dp, timeout=90))


def test_case_tables_cover_every_method():
    for n in WORLD_SIZES:
        methods = {c.method for c in world_cases(n)}
        assert {"all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
                "gather", "reduce", "scatter", "all_to_all", "all_to_allv", "broadcast", "empty",
                "exotic",
                "broadcast_object", "barrier", "graph_capture"} <= methods
        assert ("send" in methods) == ("send_object" in methods) == (n > 1)
        assert ("single-rank" in methods) == (n == 1)
        names = [c.name for c in world_cases(n)]
        assert len(names) == len(set(names)), "duplicate test ids"
    assert "send/1->0" in [c.name for c in TP_PP_METHODS["send"]]
    assert len(ReduceOp) == 8  # x 3 dtypes: 24 all_reduce checks, the refused ones included


def _topology(ranks: list[int], me: int) -> dict:
    """Expected topology properties of global rank ``me`` in a group of ``ranks``."""
    i = ranks.index(me)
    return {
        "ranks": ranks, "rank": me, "world_size": len(ranks), "rank_in_group": i,
        "first_rank": ranks[0], "last_rank": ranks[-1],
        "is_first_rank": i == 0, "is_last_rank": i == len(ranks) - 1,
        "next_rank": ranks[(i + 1) % len(ranks)], "prev_rank": ranks[(i - 1) % len(ranks)],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_world_group_topology_and_a_destroyed_group(dist_pool, world_size):
    """Topology of the world group; a destroyed group is unregistered and refuses work."""
    results = dist_pool(world_size).run(_world_topology_and_destroyed_group, timeout=90)
    for rank, topology in enumerate(results):
        assert topology == _topology(list(range(world_size)), rank)


@pytest.mark.timeout(120)
def test_topology_of_tp_pp_and_dp_groups_of_tp2_pp2(dist_pool):
    results = dist_pool(4).run(_tp2_pp2_topologies, timeout=90)
    tp_groups, pp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for rank, r in enumerate(results):
        tp = next(g for g in tp_groups if rank in g)
        pp = next(g for g in pp_groups if rank in g)
        assert r["tp"] == _topology(tp, rank)
        assert r["pp"] == _topology(pp, rank)
        assert r["dp"] == _topology([rank], rank)
