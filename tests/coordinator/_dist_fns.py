"""Every GroupCoordinator method, checked on the ranks against local references."""

from __future__ import annotations

from typing import Any

import torch

from device_comms import ReduceOp
from tests.coordinator._dist_checks import (
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


# ---------------------------------------------------------------------- the suites
def collective_suite(g: Any, tag: str) -> list[str]:
    """Every tensor collective of GroupCoordinator ``g`` against local references.

    Returns the names of the cases checked (identical on every rank).
    """
    n, me = g.world_size, g.rank_in_group
    done: list[str] = []

    # all_reduce: every op x dtype; forbidden combinations are TypeErrors.
    for dt in DTYPES:
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
    case = f"{tag}/all_reduce/noncontiguous"
    x = make(me, (4, 3, 2), torch.float32, case).transpose(0, 2)
    want = ref_reduce([make(r, (4, 3, 2), torch.float32, case).transpose(0, 2) for r in range(n)],
                      ReduceOp.SUM)
    expect_equal(case, g.all_reduce(x), want)
    case = f"{tag}/all_reduce/op-by-name"
    x = make(me, (5,), torch.int64, case)
    expect_equal(case, g.all_reduce(x, "max"),
                 ref_reduce([make(r, (5,), torch.int64, case) for r in range(n)], ReduceOp.MAX))
    # Larger than a shared-memory slot (32 MiB workspace by default, split in
    # 2 x local ranks) and odd-sized, so chunked / big-message paths run too.
    case = f"{tag}/all_reduce/large-odd"
    big = (9 << 20) // 4 + 3
    x = make(me, (big,), torch.float32, case)
    expect_equal(case, g.all_reduce(x),
                 ref_reduce([make(r, (big,), torch.float32, case) for r in range(n)], ReduceOp.SUM))
    case = f"{tag}/all_reduce/0-dim"
    expect_equal(case, g.all_reduce(torch.tensor(float(me + 1))), torch.tensor(n * (n + 1) / 2))
    done += ["noncontiguous", "op-by-name", "large-odd", "0-dim"]

    # all_gather: 3 dtypes x dims 0, 1, -1 of a 3-D tensor.
    for dt in DTYPES:
        for dim in DIMS:
            case = f"{tag}/all_gather/{dt}/{dim}"
            x = make(me, (2, 3, 4), dt, case)
            want = torch.cat([make(r, (2, 3, 4), dt, case) for r in range(n)], dim)
            expect_equal(case, g.all_gather(x, dim), want)
            done.append(case)
    case = f"{tag}/all_gather/default-dim"
    expect_equal(case, g.all_gather(torch.full((2, 2), float(me))),
                 torch.cat([torch.full((2, 2), float(r)) for r in range(n)], -1))
    case = f"{tag}/all_gather/large-odd"
    big = (9 << 20) // 2 + 1
    x = make(me, (big,), torch.bfloat16, case)
    expect_equal(case, g.all_gather(x, 0),
                 torch.cat([make(r, (big,), torch.bfloat16, case) for r in range(n)]))
    case = f"{tag}/reduce_scatterv/large"
    rows = [(1 << 20) + 1, 7, 0, 5][:n] if n > 1 else [(1 << 20) + 1]
    x = make(me, (sum(rows), 3), torch.float32, case)
    full = ref_reduce([make(r, (sum(rows), 3), torch.float32, case) for r in range(n)], ReduceOp.SUM)
    expect_equal(case, g.reduce_scatterv(x, 0, rows), full.split(rows, 0)[me])

    # all_gatherv: uneven sizes (one rank contributes nothing at world size 4).
    sizes = [1, 3, 0, 2][:n] if n > 1 else [3]
    for dt in DTYPES:
        for dim in DIMS:
            case = f"{tag}/all_gatherv/{dt}/{dim}"
            shapes = [with_size((2, 3, 4), dim, s) for s in sizes]
            x = make(me, shapes[me], dt, case)
            want = torch.cat([make(r, shapes[r], dt, case) for r in range(n)], dim)
            expect_equal(case, g.all_gatherv(x, dim, sizes), want)
            expect_equal(case + "/tuple-sizes", g.all_gatherv(x, dim, tuple(sizes)), want)
            done.append(case)
    case = f"{tag}/all_gatherv/list-input"
    xs = [make(me, (sizes[me], 2), torch.float32, case), make(me, (sizes[me],), torch.int64, case + "i")]
    got = g.all_gatherv(xs, 0, sizes)
    assert isinstance(got, list) and len(got) == 2, f"{case}: got {type(got).__name__}"
    expect_equal(case + "[0]", got[0],
                 torch.cat([make(r, (sizes[r], 2), torch.float32, case) for r in range(n)]))
    expect_equal(case + "[1]", got[1],
                 torch.cat([make(r, (sizes[r],), torch.int64, case + "i") for r in range(n)]))
    case = f"{tag}/all_gatherv/sizes-None"
    x = make(me, (2, 2), torch.float32, case)
    expect_equal(case, g.all_gatherv(x, 1),
                 torch.cat([make(r, (2, 2), torch.float32, case) for r in range(n)], 1))
    done += ["all_gatherv/list-input", "all_gatherv/sizes-None"]

    # reduce_scatter: 3 dtypes x dims x a few ops; every dim divisible by n.
    shape = (2 * n, 3 * n, n)
    for dt in DTYPES:
        ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX) if dt.is_floating_point else (
            ReduceOp.SUM, ReduceOp.MIN, ReduceOp.BXOR)
        for dim in DIMS:
            for op in ops:
                case = f"{tag}/reduce_scatter/{dt}/{dim}/{op.name}"
                x = make(me, shape, dt, case)
                x0 = x.clone()
                full = ref_reduce([make(r, shape, dt, case) for r in range(n)], op)
                expect_equal(case, g.reduce_scatter(x, dim, op), full.chunk(n, dim)[me].contiguous())
                expect_equal(case + "/input-untouched", x, x0)
                done.append(case)

    # reduce_scatterv: uneven sizes summing to the dim.
    vsizes = [2, 1, 0, 3][:n] if n > 1 else [2]
    total = sum(vsizes)
    for dt in DTYPES:
        ops = (ReduceOp.SUM, ReduceOp.MAX) if dt.is_floating_point else (ReduceOp.SUM, ReduceOp.BOR)
        for dim in DIMS:
            for op in ops:
                case = f"{tag}/reduce_scatterv/{dt}/{dim}/{op.name}"
                shp = with_size((2, 3, 4), dim, total)
                x = make(me, shp, dt, case)
                full = ref_reduce([make(r, shp, dt, case) for r in range(n)], op)
                want = full.split(vsizes, dim)[me].contiguous()
                expect_equal(case, g.reduce_scatterv(x, dim, vsizes, op), want)
                done.append(case)

    # gather: every dst, dims rotate over dtypes.
    for dst in range(n):
        for i, dim in enumerate(DIMS):
            dt = DTYPES[(dst + i) % 3]
            case = f"{tag}/gather/{dst}/{dim}/{dt}"
            x = make(me, (2, 3, 4), dt, case)
            got = g.gather(x, dst, dim)
            if me == dst:
                expect_equal(case, got, torch.cat([make(r, (2, 3, 4), dt, case) for r in range(n)], dim))
            else:
                assert got is None, f"{case}: non-dst rank got {type(got).__name__}, want None"
            done.append(case)

    # reduce: every dst, a few ops per dtype.
    for dst in range(n):
        for dt in DTYPES:
            for op in ((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN) if dt.is_floating_point
                       else (ReduceOp.SUM, ReduceOp.BAND, ReduceOp.MAX)):
                case = f"{tag}/reduce/{dst}/{dt}/{op.name}"
                x = make(me, (3, 4), dt, case)
                x0 = x.clone()
                got = g.reduce(x, dst, op)
                if me == dst:
                    expect_equal(case, got, ref_reduce([make(r, (3, 4), dt, case) for r in range(n)], op))
                else:
                    assert got is None, f"{case}: non-dst rank got {type(got).__name__}"
                expect_equal(case + "/input-untouched", x, x0)
                done.append(case)

    # scatter: every src; non-src ranks pass None.
    for src in range(n):
        for i, dim in enumerate(DIMS):
            dt = DTYPES[(src + i) % 3]
            case = f"{tag}/scatter/{src}/{dim}/{dt}"
            full = make(src, (2 * n, 3 * n, 2 * n), dt, case)
            got = g.scatter(full if me == src else None, src, dim)
            expect_equal(case, got, full.chunk(n, dim)[me].contiguous())
            done.append(case)

    # all_to_all: several (scatter_dim, gather_dim) pairs, all dtypes.
    shape = (2 * n, 3 * n, n)
    for dt in DTYPES:
        for sd, gd in ((0, 0), (0, 1), (1, -1), (-1, 0), (2, 2)):
            case = f"{tag}/all_to_all/{dt}/{sd}/{gd}"
            x = make(me, shape, dt, case)
            want = torch.cat([make(r, shape, dt, case).chunk(n, sd)[me] for r in range(n)], gd)
            expect_equal(case, g.all_to_all(x, sd, gd), want)
            done.append(case)

    # broadcast: in place, from every src; also a 0-dim tensor.
    for src in range(n):
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

    # empty tensors through every collective
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
    done.append(case)

    # data movement of types without backend kernels (moved as raw bytes)
    for dt in EXOTIC:
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
        done.append(case)

    # point to point (groups of 2+): explicit pairs, then defaults next/prev
    # (the even/odd schedule below needs an even group size: 2 or 4 here).
    if n > 1:
        for a in range(n):
            for b in range(n):
                if a == b:
                    continue
                case = f"{tag}/send/{a}->{b}"
                dt = DTYPES[(a + b) % 3]
                if me == a:
                    g.send(make(a, (2, 3), dt, case), b)
                elif me == b:
                    expect_equal(case, g.recv((2, 3), dt, a), make(a, (2, 3), dt, case))
                done.append(case)
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
        done.append(case)
    return done


def object_suite(g: Any, tag: str) -> list[str]:
    """Object collectives, barrier, graph capture and topology properties of ``g``."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for src in range(n):
        obj = {"src": src, "tag": tag, "nested": [1, "two", None, (3.5,)], "bytes": b"\x00\xff"}
        got = g.broadcast_object(obj if me == src else None, src)
        assert got == obj, f"{tag}/broadcast_object/{src}: got {got!r}"
        lst = [src, "x" * src, {"k": [src]}] if me == src else [None, None, None]
        out = g.broadcast_object_list(lst, src)
        assert out is lst, f"{tag}/broadcast_object_list/{src}: must fill the caller's list"
        assert lst == [src, "x" * src, {"k": [src]}], f"{tag}/broadcast_object_list/{src}: {lst!r}"
        done += [f"broadcast_object/{src}", f"broadcast_object_list/{src}"]
    if n > 1:
        for a in range(n):
            for b in range(n):
                if a != b and me in (a, b):
                    payload = {"from": a, "to": b, "t": torch.arange(3) * a, "big": "z" * 5000}
                    if me == a:
                        g.send_object(payload, b)
                    else:
                        got = g.recv_object(a)
                        assert got["from"] == a and got["to"] == b and got["big"] == payload["big"]
                        assert torch.equal(got["t"], payload["t"])
                done.append(f"send_object/{a}->{b}")
        if me == 0:
            g.send_object(None, 1)
        elif me == 1:
            assert g.recv_object(0) is None, "send_object(None) must arrive as None"
        # A codec may encode an object as zero bytes.
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
    g.barrier()
    g.barrier(timeout=60.0)
    with g.graph_capture() as ctx:
        assert ctx.stream is None, f"graph_capture on CPU must yield stream None, got {ctx.stream}"
        with g.graph_capture(ctx) as inner:
            assert inner is ctx, "a nested graph_capture must reuse the outer context"
            expect_equal(f"{tag}/graph_capture/all_reduce", g.all_reduce(torch.ones(2)),
                         torch.full((2,), float(n)))
    done += ["barrier", "graph_capture"]
    return done


class EmptyForNoneCodec:
    """An object codec that encodes None as zero bytes."""

    def dumps(self, obj: Any) -> bytes:
        import pickle

        return b"" if obj is None else pickle.dumps(obj)

    def loads(self, data: Any) -> Any:
        import pickle

        return None if not len(data) else pickle.loads(data)


def topology_of(g: Any) -> dict[str, Any]:
    """The topology properties of ``g`` (checked against an expected layout by the test)."""
    return {
        "ranks": list(g.ranks), "rank": g.rank, "world_size": g.world_size,
        "rank_in_group": g.rank_in_group, "first_rank": g.first_rank, "last_rank": g.last_rank,
        "is_first_rank": g.is_first_rank, "is_last_rank": g.is_last_rank,
        "next_rank": g.next_rank, "prev_rank": g.prev_rank,
    }


def single_rank_suite(g: Any, tag: str) -> list[str]:
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
    assert g.send_tensor_dict(d) is None
    assert g.recv_tensor_dict() is None
    g.barrier()
    g.barrier(timeout=5.0)
    for name, fn in (("send", lambda: g.send(x)), ("recv", lambda: g.recv((2,), torch.float32)),
                     ("send_object", lambda: g.send_object(1, 0)),
                     ("recv_object", lambda: g.recv_object(0))):
        expect_raises(f"{tag}/{name}", ValueError, fn, "this rank")
    assert (g.first_rank, g.last_rank, g.next_rank, g.prev_rank) == (g.rank,) * 4
    assert g.is_first_rank and g.is_last_rank
    with g.graph_capture() as ctx:
        assert ctx.stream is None
    return ["single-rank"]


# ---------------------------------------------------------------------- entry points
def run_world_suites(rank: int, world_size: int) -> dict[str, Any]:
    """The full suite on the world group (plus a temporary group's lifecycle)."""
    from coordinator import GroupCoordinator, NotInitializedError, get_group_by_name
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    assert g.rank == rank and g.world_size == world_size
    cases = collective_suite(g, "world") + object_suite(g, "world")
    if world_size == 1:
        cases += single_rank_suite(g, "world1")
    else:
        # The portable path (plain torch.distributed / gloo) that faster
        # communicators fall back to, forced through the registry name.
        gloo = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                group_name="gloo", device_communicator="torch")
        assert type(gloo.comm).__name__ == "TorchDistributedCommunicator"
        cases += collective_suite(gloo, "gloo")
        gloo.destroy()
    # destroy() is idempotent and unregisters the group.
    tmp = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="tmpgroup")
    assert get_group_by_name(tmp.unique_name) is tmp
    expect_equal("tmp/all_reduce", tmp.all_reduce(torch.ones(3)), torch.full((3,), float(world_size)))
    tmp.destroy()
    tmp.destroy()
    expect_raises("tmp/after-destroy", ValueError, lambda: get_group_by_name(tmp.unique_name),
                  tmp.unique_name)
    # A destroyed group refuses work (instead of falling back to the world group).
    dead = [("all_reduce", lambda: tmp.all_reduce(torch.ones(2))),
            ("graph_capture", lambda: tmp.graph_capture().__enter__())]
    if world_size > 1:
        dead += [("broadcast_object", lambda: tmp.broadcast_object(1, 0)),
                 ("barrier", tmp.barrier),
                 ("broadcast_tensor_dict", lambda: tmp.broadcast_tensor_dict({"a": 1}, 0)),
                 ("send_object", lambda: tmp.send_object(1, (rank + 1) % world_size))]
    for name, call in dead:
        expect_raises(f"tmp/dead/{name}", NotInitializedError, call, "destroyed", tmp.unique_name)
    return {"cases": cases, "topology": topology_of(g), "comm": type(g.comm).__name__}


def run_tp2_pp2_suites(rank: int, world_size: int) -> dict[str, Any]:
    """The suites on the TP, PP and (size-1) DP groups of TP=2 x PP=2."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    tp, pp, dp = ps.get_tp_group(), ps.get_pp_group(), ps.get_dp_group()
    cases = collective_suite(tp, "tp") + object_suite(tp, "tp")
    cases += collective_suite(pp, "pp") + object_suite(pp, "pp")
    cases += single_rank_suite(dp, "dp")
    return {"cases": cases, "tp": topology_of(tp), "pp": topology_of(pp), "dp": topology_of(dp)}
