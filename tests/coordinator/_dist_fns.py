"""Functions that run on the ranks of a :class:`~coordinator.testing.DistributedPool`.

Every function here is module-level (the pool pickles it by reference) and is
called as ``fn(rank, world_size, *args)`` on every rank. The checks compute
their reference results locally: every rank can build every other rank's input
(inputs are a deterministic function of the group rank and a case tag), so no
reference data has to travel. A failed check raises ``AssertionError`` on the
rank, which the pool re-raises in the test with the remote traceback.

Inputs are small integers stored in the tested dtype, so sums, products and
averages of up to four ranks are exact in float32 *and* bfloat16: results are
compared with ``torch.equal`` whatever order the transport reduces in.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from typing import Any, Callable, Sequence

import torch

from device_comms import ReduceOp

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
FLOAT_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
INT_OPS = (
    ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
    ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR,
)
DIMS = (0, 1, -1)
# Types without (full) backend kernels: data movement must still carry them.
EXOTIC = (torch.uint16, torch.float8_e4m3fn, torch.complex64, torch.int16, torch.bool)


# ---------------------------------------------------------------------- helpers
def make(rank: int, shape: Sequence[int], dtype: torch.dtype, tag: str) -> torch.Tensor:
    """The deterministic input of group rank ``rank`` for case ``tag``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{tag}|{rank}".encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randint(-4, 5, tuple(shape), generator=g).to(dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def ref_reduce(ts: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Reference reduction, written independently of ``device_comms.reduce_local``."""
    s = torch.stack(list(ts))
    if op is ReduceOp.SUM:
        return s.sum(0)
    if op is ReduceOp.AVG:
        return s.sum(0) / len(ts)
    if op is ReduceOp.PRODUCT:
        return s.prod(0)
    if op is ReduceOp.MIN:
        return s.amin(0)
    if op is ReduceOp.MAX:
        return s.amax(0)
    fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or,
          ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(fn, ts)


def expect_equal(case: str, got: Any, want: torch.Tensor) -> None:
    """Assert ``got`` is a tensor equal to ``want`` in dtype, shape and every value."""
    assert isinstance(got, torch.Tensor), f"{case}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{case}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype in EXOTIC and not got.dtype.is_complex and got.dtype != torch.bool:
        got, want = (x.contiguous().reshape(-1).view(torch.uint8) for x in (got, want))
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].tolist()
        raise AssertionError(f"{case}: values differ at {bad}: got {got.flatten()[:8]}, "
                             f"want {want.flatten()[:8]}")


def expect_raises(case: str, exc: type[BaseException] | tuple, fn: Callable[[], Any],
                  *words: str) -> str:
    """Assert ``fn()`` raises ``exc`` whose message contains every one of ``words``."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        for w in words:
            assert w in msg, f"{case}: message {msg!r} does not mention {w!r}"
        return msg
    raise AssertionError(f"{case}: expected {exc}, nothing was raised")


def _allowed(op: ReduceOp, dtype: torch.dtype) -> bool:
    return op in (FLOAT_OPS if dtype.is_floating_point else INT_OPS)


def _with(shape: Sequence[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


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
            if not _allowed(op, dt):
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
    case = f"{tag}/all_reduce/large-odd"
    big = (1 << 18) + 3
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
    x = make(me, ((1 << 17) + 1,), torch.bfloat16, case)
    expect_equal(case, g.all_gather(x, 0),
                 torch.cat([make(r, ((1 << 17) + 1,), torch.bfloat16, case) for r in range(n)]))

    # all_gatherv: uneven sizes (one rank contributes nothing at world size 4).
    sizes = [1, 3, 0, 2][:n] if n > 1 else [3]
    for dt in DTYPES:
        for dim in DIMS:
            case = f"{tag}/all_gatherv/{dt}/{dim}"
            shapes = [_with((2, 3, 4), dim, s) for s in sizes]
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
                shp = _with((2, 3, 4), dim, total)
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


def sleep_then(rank: int, world_size: int, seconds: float, value: Any) -> Any:
    """Sleep, then return ``value`` (harness tests)."""
    time.sleep(seconds)
    return value


def getpid(rank: int, world_size: int) -> int:
    """This rank's pid."""
    return os.getpid()


# ---------------------------------------------------------------------- tensor dicts
def mixed_dict(owner: int, tag: str) -> dict[Any, Any]:
    """A tensor dict mixing every kind of value, deterministic in ``owner``."""
    base = make(owner, (4, 6), torch.float32, tag + "nc")
    return {
        "f32": make(owner, (2, 3, 4), torch.float32, tag + "f32"),
        "bf16": make(owner, (3, 4), torch.bfloat16, tag + "bf16"),
        "i64": make(owner, (5,), torch.int64, tag + "i64"),
        "f16": make(owner, (2, 2), torch.float16, tag + "f16"),
        "bool": make(owner, (6,), torch.int64, tag + "bool") > 0,
        "none": None,
        "str": f"hello from {owner}",
        "list": [owner, "two", [3.5, None], {"k": owner}],
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
        "zero_dim": torch.tensor(float(owner) + 0.5),
        "zero_dim_i64": torch.tensor(owner * 11),
        "noncontig": base.t(),  # (6, 4), strides (1, 6)
        "noncontig_bf16": make(owner, (4, 6), torch.bfloat16, tag + "ncb")[:, ::2],
        "u16": make(owner, (2, 3), torch.uint16, tag + "u16"),
        "f8": make(owner, (5,), torch.float8_e4m3fn, tag + "f8"),
        "c64": make(owner, (2, 2), torch.complex64, tag + "c64"),
        7: "an int key",
        "float": 2.25,
    }


def expect_same_dict(case: str, got: Any, want: dict[Any, Any]) -> None:
    """Same keys in the same order; tensors equal (dtype, shape, values); the rest ==."""
    assert isinstance(got, dict), f"{case}: got {type(got).__name__}, want a dict"
    assert list(got) == list(want), f"{case}: keys {list(got)} != {list(want)}"
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            expect_equal(f"{case}[{k!r}]", got[k], w)
            assert got[k].device.type == "cpu"
        else:
            assert got[k] == w and type(got[k]) is type(w), f"{case}[{k!r}]: {got[k]!r} != {w!r}"


def tensor_dict_broadcast_suite(g: Any, tag: str) -> list[str]:
    """broadcast_tensor_dict from every src (and through explicit groups)."""
    n, me = g.world_size, g.rank_in_group
    done = []
    for src in range(n):
        want = mixed_dict(src, f"{tag}/{src}")
        got = g.broadcast_tensor_dict(want if me == src else None, src)
        expect_same_dict(f"{tag}/broadcast_tensor_dict/src{src}", got, want)
        if me != src:
            assert all(t.is_contiguous() for t in got.values() if isinstance(t, torch.Tensor))
        done.append(f"broadcast_tensor_dict/{src}")
        # Non-src ranks may pass a dict; it is ignored.
        got = g.broadcast_tensor_dict({"ignored": 1} if me != src else want, src)
        expect_same_dict(f"{tag}/broadcast_tensor_dict/src{src}/ignored", got, want)
    src = n - 1
    want = mixed_dict(src, f"{tag}/explicit")
    got = g.broadcast_tensor_dict(want if me == src else None, src, group=g.device_group,
                                  metadata_group=g.cpu_group)
    expect_same_dict(f"{tag}/broadcast_tensor_dict/explicit-groups", got, want)
    got = g.broadcast_tensor_dict({} if me == 0 else None, 0)
    assert got == {}, f"{tag}: an empty dict must arrive empty, got {got!r}"
    done += ["explicit-groups", "empty-dict"]
    return done


def run_broadcast_tensor_dict(rank: int, world_size: int) -> list[str]:
    """broadcast_tensor_dict on the world group (and on TP/PP at world size 4)."""
    from coordinator import parallel_state as ps

    done = tensor_dict_broadcast_suite(ps.get_world_group(), "world")
    if world_size == 4:
        ps.initialize_model_parallel(2, 2)
        done += tensor_dict_broadcast_suite(ps.get_tp_group(), "tp")
        # The parallel_state wrapper broadcasts over the TP group.
        tp = ps.get_tp_group()
        for src in range(2):
            want = mixed_dict(tp.ranks[src], f"wrapper{src}")
            got = ps.broadcast_tensor_dict(want if tp.rank_in_group == src else None, src)
            expect_same_dict(f"wrapper/src{src}", got, want)
        done.append("wrapper")
    return done


def run_send_recv_tensor_dict(rank: int, world_size: int) -> list[str]:
    """Pipeline send/recv of tensor dicts at TP=2 x PP=2, incl. the all-gather optimisation.

    Rank layout: TP groups [0, 1] and [2, 3]; PP groups [0, 2] and [1, 3];
    stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.

    To *see* the optimisation, the "replicated" tensors deliberately differ
    between the two senders: a sliced tensor arrives as [half of sender tp0's,
    half of sender tp1's]; an unsliced one arrives as the peer sender's whole
    tensor.
    """
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    t_rank, stage = tp.rank_in_group, pp.rank_in_group
    done = []

    def sender_dict(sender_global: int) -> dict[Any, Any]:
        d = mixed_dict(sender_global, "p2p")
        d["rep"] = make(sender_global, (4, 6), torch.float32, "rep")  # numel 24: sliced
        d["rep_bf16"] = make(sender_global, (2, 3, 2), torch.bfloat16, "repb")  # 12: sliced
        d["rep_nc"] = make(sender_global, (6, 4), torch.int64, "repnc").t()  # non-contig, sliced
        d["odd"] = make(sender_global, (7,), torch.float32, "odd")  # 7: not divisible
        d["off"] = make(sender_global, (8,), torch.float32, "off")  # disabled per key
        return d

    sliced_keys = {"rep", "rep_bf16", "rep_nc", "f32", "bf16", "bool", "f16", "noncontig",
                   "noncontig_bf16", "u16", "c64"}

    def expected(peer_global: int, peer_tp_globals: list[int], optimised: bool) -> dict[Any, Any]:
        want = sender_dict(peer_global)
        if not optimised:
            return want
        for k in sliced_keys:
            whole = want[k]
            parts = [sender_dict(s)[k].reshape(2, -1)[i] for i, s in enumerate(peer_tp_globals)]
            want[k] = torch.cat(parts).reshape(whole.shape)
        return want

    # Every tensor of the mix with an even, non-zero numel is sliced by default.
    numel_even = {k for k, v in sender_dict(0).items()
                  if isinstance(v, torch.Tensor) and v.numel() and v.numel() % 2 == 0}
    assert numel_even - {"off"} == sliced_keys, sorted(numel_even)
    stage0_tp = [0, 1]
    peer = pp.ranks[1 - stage]
    # 1) no all_gather_group: whole tensors.
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), dst=1)
    else:
        got = pp.recv_tensor_dict(src=0)
        expect_same_dict("p2p/plain", got, expected(peer, stage0_tp, False))
    done.append("plain")
    # 2) all_gather_group=tp: 1/2 slices rebuilt by an all-gather; "off" disabled.
    flags = {"off": False}
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=flags)
        expect_same_dict("p2p/all-gather", got, expected(peer, stage0_tp, True))
    done.append("all-gather")
    # 3) the other direction, default dst/src (next/prev wrap around).
    if stage == 1:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp)
        expect_same_dict("p2p/all-gather/back", got, expected(peer, [2, 3], True))
    done.append("all-gather-back")
    # 4) forcing a non-divisible tensor is refused on the sender before anything is sent.
    if stage == 0:
        expect_raises("p2p/force-odd", ValueError,
                      lambda: pp.send_tensor_dict({"odd": torch.ones(7)}, 1, tp, {"odd": True}),
                      "odd", "7")
        expect_raises("p2p/force-no-group", ValueError,
                      lambda: pp.send_tensor_dict({"x": torch.ones(8)}, 1, None, {"x": True}),
                      "no all_gather_group")
        expect_raises("p2p/bad-group", TypeError,
                      lambda: pp.send_tensor_dict({"x": torch.ones(8)}, 1, tp.cpu_group),
                      "all_gather_group")
        expect_raises("p2p/not-a-dict", TypeError,
                      lambda: pp.send_tensor_dict([torch.ones(2)], 1), "tensor_dict")
        expect_raises("p2p/to-self", ValueError,
                      lambda: pp.send_tensor_dict({"x": 1}, 0), "dst")
        expect_raises("p2p/dst-range", ValueError,
                      lambda: pp.send_tensor_dict({"x": 1}, 2), "dst")
    else:
        expect_raises("p2p/src-range", ValueError, lambda: pp.recv_tensor_dict(src=5), "src")
    done.append("errors")
    # 5) a receiver without the sender's all_gather_group (none, or one of another
    # size) gets a clear error after draining the message, so both sides stay in step.
    dp = ps.get_dp_group()  # size 1
    for case, group, words in (("missing-group", None, ("no all_gather_group",)),
                               ("wrong-size-group", dp, ("size 1", "2 parts"))):
        if stage == 0:
            pp.send_tensor_dict({"rep": torch.ones(4), "s": "x", "w": torch.ones(3)},
                                all_gather_group=tp)
        else:
            expect_raises(f"p2p/{case}", ValueError,
                          lambda: pp.recv_tensor_dict(all_gather_group=group), "'rep'", *words)
        done.append(case)
    if stage == 0:
        pp.send_tensor_dict(sender_dict(rank), all_gather_group=tp, all_gather_tensors=flags)
    else:
        got = pp.recv_tensor_dict(all_gather_group=tp, all_gather_tensors=flags)
        expect_same_dict("p2p/in-step-after-errors", got, expected(peer, stage0_tp, True))
    return done


def run_send_recv_tensor_dict_world(rank: int, world_size: int) -> list[str]:
    """send/recv_tensor_dict between every ordered pair of the world group."""
    from coordinator import parallel_state as ps

    g = ps.get_world_group()
    for a in range(world_size):
        for b in range(world_size):
            if a != b and rank in (a, b):
                want = mixed_dict(a, f"w{a}{b}")
                if rank == a:
                    g.send_tensor_dict(want, b)
                else:
                    expect_same_dict(f"world/{a}->{b}", g.recv_tensor_dict(a), want)
    return ["pairs"]


# ---------------------------------------------------------------------- parallel state
def run_layouts(rank: int, world_size: int, configs: list[tuple[int, int, int]]) -> list[dict]:
    """Initialise, inspect, use and destroy model parallelism for each (tp, pp, dp)."""
    from coordinator import NotInitializedError
    from coordinator import parallel_state as ps

    out = []
    for tp, pp, dp in configs:
        assert not ps.model_parallel_is_initialized()
        ps.initialize_model_parallel(tp, pp, dp)
        assert ps.model_parallel_is_initialized()
        groups = {"tp": ps.get_tp_group(), "pp": ps.get_pp_group(), "dp": ps.get_dp_group()}
        rec: dict[str, Any] = {k: list(g.ranks) for k, g in groups.items()}
        rec["getters"] = (
            ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
        )
        # Each group really connects the ranks it lists.
        for k, g in groups.items():
            got = g.all_reduce(torch.tensor([rank], dtype=torch.int64))
            assert got.item() == sum(g.ranks), f"{(tp, pp, dp)} {k}: {got.item()} != sum{g.ranks}"
            gathered = g.all_gather(torch.tensor([rank]), 0)
            assert gathered.tolist() == list(g.ranks), f"{k}: gathered {gathered.tolist()}"
        # ensure_...: a no-op with the same sizes, an error with others.
        ps.ensure_model_parallel_initialized(tp, pp, dp)
        assert ps.get_tp_group() is groups["tp"], "ensure_model_parallel_initialized rebuilt groups"
        other = (pp, tp, dp) if tp != pp else (tp * dp, pp, 1) if dp > 1 else (1, pp * tp, 1)
        expect_raises("ensure/other-sizes", ValueError,
                      lambda: ps.ensure_model_parallel_initialized(*other), "destroy_model_parallel")
        expect_raises("init-twice", RuntimeError,
                      lambda: ps.initialize_model_parallel(tp, pp, dp), "already")
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
        expect_raises("after-destroy", NotInitializedError, ps.get_tp_group, "initialize_model_parallel")
        out.append(rec)
    ps.destroy_model_parallel()  # no-op when absent
    # ensure_... initialises when nothing exists.
    ps.ensure_model_parallel_initialized(world_size, 1)
    assert ps.get_tensor_model_parallel_world_size() == world_size
    ps.destroy_model_parallel()
    # Sizes that do not multiply to the world size, or are not positive ints.
    for args, exc, words in (
        ((3, 1, 1), ValueError, ("world size", str(world_size))),
        ((world_size, 2, 1), ValueError, ("world size",)),
        ((0, 1, 1), ValueError, ("tensor_model_parallel_size",)),
        ((1, -1, 1), ValueError, ("pipeline_model_parallel_size",)),
        (("2", 1, 1), TypeError, ("tensor_model_parallel_size",)),
        ((1, 1, 2.0), TypeError, ("data_parallel_size",)),
    ):
        expect_raises(f"sizes{args}", exc, lambda: ps.initialize_model_parallel(*args), *words)
        assert not ps.model_parallel_is_initialized()
    return out


def run_reinit_world(rank: int, world_size: int) -> dict[str, Any]:
    """destroy_distributed_environment, then init again in the same processes."""
    import torch.distributed as dist

    from coordinator import NotInitializedError
    from coordinator import parallel_state as ps
    from coordinator.testing import free_port

    old = ps.get_world_group()
    port = old.broadcast_object(free_port() if rank == 0 else None, 0)
    ps.initialize_model_parallel(world_size, 1)
    ps.destroy_distributed_environment()
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    expect_raises("world-after-destroy", NotInitializedError, ps.get_world_group,
                  "init_distributed_environment")
    ps.destroy_distributed_environment()  # idempotent
    g = ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank,
                                        timeout=60.0)
    assert g is not old and g is ps.get_world_group() and g.world_size == world_size
    assert g.unique_name != old.unique_name
    total = g.all_reduce(torch.tensor([rank + 1.0])).item()
    assert total == world_size * (world_size + 1) / 2
    # Already initialised: returns the same group; another world size is an error.
    assert ps.init_distributed_environment() is g
    expect_raises("init/other-size", ValueError,
                  lambda: ps.init_distributed_environment(world_size + 1), "world_size")
    ps.initialize_model_parallel(1, world_size)
    assert ps.get_pipeline_model_parallel_world_size() == world_size
    assert ps.get_pipeline_model_parallel_rank() == rank
    return {"old": old.unique_name, "new": g.unique_name}


def run_same_node(rank: int, world_size: int) -> dict[str, Any]:
    """in_the_same_node_as: all True on one machine; GROUPCOORD_NODE_ID splits nodes."""
    from coordinator import parallel_state as ps

    world = ps.get_world_group()
    out: dict[str, Any] = {"plain": ps.in_the_same_node_as(world),
                           "torch_group": ps.in_the_same_node_as(world.cpu_group, world_size - 1)}
    os.environ["GROUPCOORD_NODE_ID"] = f"node{rank // 2}"
    try:
        out["split_src0"] = ps.in_the_same_node_as(world, 0)
        out["split_srclast"] = ps.in_the_same_node_as(world, source_rank=world_size - 1)
    finally:
        del os.environ["GROUPCOORD_NODE_ID"]
    return out


def run_wrappers(rank: int, world_size: int) -> list[str]:
    """tensor_model_parallel_* wrappers, graph_capture and patch_tensor_parallel_group."""
    from coordinator import GraphCaptureContext
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(2, 2)
    tp = ps.get_tp_group()
    t = tp.rank_in_group
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (2, rank % 2)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (2, rank // 2)

    def inputs(tag: str, shape: tuple[int, ...], dt: torch.dtype = torch.float32) -> list[torch.Tensor]:
        return [make(r, shape, dt, tag) for r in tp.ranks]

    xs = inputs("w-ar", (3, 4))
    expect_equal("wrap/all_reduce", ps.tensor_model_parallel_all_reduce(xs[t]), ref_reduce(xs, ReduceOp.SUM))
    xs = inputs("w-ar-max", (3,), torch.int64)
    expect_equal("wrap/all_reduce/max", ps.tensor_model_parallel_all_reduce(xs[t], ReduceOp.MAX),
                 ref_reduce(xs, ReduceOp.MAX))
    xs = inputs("w-ag", (2, 3, 2), torch.bfloat16)
    expect_equal("wrap/all_gather", ps.tensor_model_parallel_all_gather(xs[t]), torch.cat(xs, -1))
    expect_equal("wrap/all_gather/0", ps.tensor_model_parallel_all_gather(xs[t], 0), torch.cat(xs, 0))
    xs = inputs("w-rs", (2, 4))
    expect_equal("wrap/reduce_scatter", ps.tensor_model_parallel_reduce_scatter(xs[t]),
                 ref_reduce(xs, ReduceOp.SUM).chunk(2, -1)[t])
    expect_equal("wrap/reduce_scatter/0", ps.tensor_model_parallel_reduce_scatter(xs[t], 0),
                 ref_reduce(xs, ReduceOp.SUM).chunk(2, 0)[t])
    xs = inputs("w-g", (2, 3))
    for dst in (0, 1):
        got = ps.tensor_model_parallel_gather(xs[t], dst, 0)
        if t == dst:
            expect_equal("wrap/gather", got, torch.cat(xs, 0))
        else:
            assert got is None
    got = ps.tensor_model_parallel_gather(xs[t])  # defaults dst=0, dim=-1
    if t == 0:
        expect_equal("wrap/gather/defaults", got, torch.cat(xs, -1))
    with ps.graph_capture() as ctx:
        assert isinstance(ctx, GraphCaptureContext) and ctx.stream is None
        with tp.graph_capture(ctx) as inner:
            assert inner is ctx
    # patch_tensor_parallel_group: the wrappers follow the patched group, then revert.
    world = ps.get_world_group()
    with ps.patch_tensor_parallel_group(world) as patched:
        assert patched is world and ps.get_tp_group() is world
        assert ps.get_tensor_model_parallel_world_size() == world_size
        assert ps.get_tensor_model_parallel_rank() == rank
        total = ps.tensor_model_parallel_all_reduce(torch.tensor([1.0])).item()
        assert total == world_size, total
    assert ps.get_tp_group() is tp
    try:
        with ps.patch_tensor_parallel_group(world):
            raise KeyError("inside")
    except KeyError:
        pass
    assert ps.get_tp_group() is tp, "patch_tensor_parallel_group must restore after an exception"
    expect_raises("patch/type", TypeError,
                  lambda: ps.patch_tensor_parallel_group(world.cpu_group).__enter__(), "group")
    return ["wrappers"]


# ---------------------------------------------------------------------- bad input
def run_bad_inputs(rank: int, world_size: int) -> list[str]:
    """Every bad argument raises TypeError/ValueError on the caller, naming the argument.

    Arguments the ranks all agree on are passed on every rank (each raises
    before communicating). Checks only one rank can make (its own size entry,
    the source's tensor) run on that rank alone, so no peer is left waiting.
    """
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    n, me = g.world_size, g.rank_in_group
    other = (me + 1) % n
    x = make(me, (2, 4), torch.float32, "bad")
    xi = make(me, (2, 4), torch.int64, "bad")
    meta = torch.empty(2, 4, device="meta")
    T, V = TypeError, ValueError
    cases: list[tuple[str, type, Callable[[], Any], tuple[str, ...]]] = [
        ("all_reduce/band-float", T, lambda: g.all_reduce(x, ReduceOp.BAND), ("op", "BAND", "float32")),
        ("all_reduce/bxor-bf16", T, lambda: g.all_reduce(x.bfloat16(), ReduceOp.BXOR), ("op", "bfloat16")),
        ("all_reduce/avg-int", T, lambda: g.all_reduce(xi, ReduceOp.AVG), ("op", "AVG", "int64")),
        ("all_reduce/bad-op", T, lambda: g.all_reduce(x, "median"), ("op",)),
        ("all_reduce/not-tensor", T, lambda: g.all_reduce([1.0, 2.0]), ("input_", "list")),
        ("all_reduce/meta-device", V, lambda: g.all_reduce(meta), ("input_", "cpu")),
        ("all_gather/dim-range", V, lambda: g.all_gather(x, 2), ("dim", "[-2, 2)")),
        ("all_gather/dim-neg", V, lambda: g.all_gather(x, -3), ("dim",)),
        ("all_gather/dim-type", T, lambda: g.all_gather(x, 1.0), ("dim",)),
        ("all_gather/0-dim", V, lambda: g.all_gather(torch.tensor(1.0), 0), ("dim", "0-dim")),
        ("all_gather/not-tensor", T, lambda: g.all_gather(None), ("input_",)),
        ("all_gatherv/sizes-len", V, lambda: g.all_gatherv(x, 0, [2] * (n + 1)), ("sizes", str(n))),
        ("all_gatherv/sizes-neg", V, lambda: g.all_gatherv(x, 0, [2] * (n - 1) + [-1]), ("sizes[",)),
        ("all_gatherv/sizes-type", T, lambda: g.all_gatherv(x, 0, "22"), ("sizes",)),
        ("all_gatherv/dim", V, lambda: g.all_gatherv(x, 5, [2] * n), ("dim",)),
        ("reduce_scatter/indivisible", V, lambda: g.reduce_scatter(torch.ones(2, n + 1)), ("divisible", "input_.shape")),
        ("reduce_scatter/dim", V, lambda: g.reduce_scatter(x, 3), ("dim",)),
        ("reduce_scatter/band-float", T, lambda: g.reduce_scatter(torch.ones(n), 0, ReduceOp.BAND), ("op",)),
        ("reduce_scatterv/sum", V, lambda: g.reduce_scatterv(torch.ones(n + 2), 0, [1] * n), ("sizes", "sum")),
        ("reduce_scatterv/len", V, lambda: g.reduce_scatterv(torch.ones(4), 0, [4] + [0] * n), ("sizes",)),
        ("reduce_scatterv/avg-int", T, lambda: g.reduce_scatterv(xi, 0, [2] + [0] * (n - 1), ReduceOp.AVG), ("op",)),
        ("gather/dst-range", V, lambda: g.gather(x, n), ("dst", f"[0, {n})")),
        ("gather/dst-neg", V, lambda: g.gather(x, -1), ("dst",)),
        ("gather/dst-type", T, lambda: g.gather(x, "0"), ("dst",)),
        ("gather/dim", V, lambda: g.gather(x, 0, 2), ("dim",)),
        ("reduce/dst", V, lambda: g.reduce(x, n + 3), ("dst",)),
        ("reduce/op", T, lambda: g.reduce(x, 0, ReduceOp.BOR), ("op",)),
        ("scatter/src", V, lambda: g.scatter(x, n), ("src",)),
        ("scatter/dim-type", T, lambda: g.scatter(x, 0, "0"), ("dim",)),
        ("all_to_all/scatter_dim", V, lambda: g.all_to_all(x, 2, 0), ("scatter_dim",)),
        ("all_to_all/gather_dim", V, lambda: g.all_to_all(torch.ones(n, 2), 0, -3), ("gather_dim",)),
        ("broadcast/src", V, lambda: g.broadcast(x, n), ("src",)),
        ("broadcast/src-bool", T, lambda: g.broadcast(x, True), ("src",)),
        ("broadcast/not-tensor", T, lambda: g.broadcast(3.0, 0), ("input_",)),
        ("broadcast_object/src", V, lambda: g.broadcast_object(1, n), ("src",)),
        ("broadcast_object_list/src", V, lambda: g.broadcast_object_list([1], -1), ("src",)),
        ("broadcast_object_list/type", T, lambda: g.broadcast_object_list((1, 2), 0), ("obj_list", "tuple")),
        ("broadcast_tensor_dict/src", V, lambda: g.broadcast_tensor_dict({"a": x}, n), ("src",)),
        ("send/self", V, lambda: g.send(x, me), ("dst", "this rank")),
        ("send/range", V, lambda: g.send(x, n), ("dst",)),
        ("send/not-tensor", T, lambda: g.send("x", other), ("tensor",)),
        ("recv/self", V, lambda: g.recv((2,), torch.float32, me), ("src", "this rank")),
        ("recv/dtype", T, lambda: g.recv((2,), "float32", other), ("dtype",)),
        ("recv/range", V, lambda: g.recv((2,), torch.float32, -1), ("src",)),
        ("recv/size-type", T, lambda: g.recv("ab", torch.float32, other), ("size",)),
        ("recv/size-neg", V, lambda: g.recv((2, -1), torch.float32, other), ("size",)),
        ("send_object/self", V, lambda: g.send_object({}, me), ("dst",)),
        ("send_object/range", V, lambda: g.send_object({}, n), ("dst",)),
        ("recv_object/self", V, lambda: g.recv_object(me), ("src",)),
        ("recv_object/type", T, lambda: g.recv_object(None), ("src",)),
        ("send_tensor_dict/self", V, lambda: g.send_tensor_dict({"a": x}, me), ("dst",)),
        ("send_tensor_dict/range", V, lambda: g.send_tensor_dict({"a": x}, n), ("dst",)),
        ("send_tensor_dict/not-a-dict", T, lambda: g.send_tensor_dict([x], other), ("tensor_dict",)),
        ("recv_tensor_dict/range", V, lambda: g.recv_tensor_dict(n), ("src",)),
        ("group_ranks/dup", V, lambda: GroupCoordinator([[0, 0]], 0, "gloo", True), ("group_ranks",)),
        ("group_ranks/range", V, lambda: GroupCoordinator([list(range(n + 1))], 0, "gloo", True), ("group_ranks",)),
        ("group_ranks/type", T, lambda: GroupCoordinator("01", 0, "gloo", True), ("group_ranks",)),
    ]
    if n == 1:  # everything divides by 1; a send_tensor_dict to oneself is a no-op
        cases = [c for c in cases if "indivisible" not in c[0] and c[0] != "send_tensor_dict/self"]
    names = []
    for name, exc, fn, words in cases:
        expect_raises(name, exc, fn, *words)
        names.append(name)
    # Arguments only one rank can get wrong: that rank raises, the others do not call.
    if me == n - 1:
        sizes = [2] * n
        bad = make(me, (3, 4), torch.float32, "bad")
        expect_raises("all_gatherv/own-size", ValueError, lambda: g.all_gatherv(bad, 0, sizes),
                      f"sizes[{me}]", "input_.shape[0]")
        expect_raises("all_gatherv/own-size-list", ValueError,
                      lambda: g.all_gatherv([make(me, (2, 4), torch.float32, "ok"), bad], 0, sizes),
                      f"sizes[{me}]")
    if me == 0:
        expect_raises("scatter/src-dim", ValueError, lambda: g.scatter(x, 0, 2), ("dim"))
        if n > 1:
            expect_raises("scatter/src-indivisible", ValueError,
                          lambda: g.scatter(torch.ones(n + 1, 2), 0, 0), "divisible")
        expect_raises("scatter/src-not-tensor", TypeError, lambda: g.scatter(None, 0, 0), "input_")
        expect_raises("broadcast/non-contiguous", ValueError, lambda: g.broadcast(x.t(), 0),
                      "contiguous")
        expect_raises("broadcast_tensor_dict/not-a-dict", TypeError,
                      lambda: g.broadcast_tensor_dict([("a", x)], 0), "tensor_dict")
    # The group still works after all of that.
    expect_equal("still-works", g.all_reduce(torch.ones(3)), torch.full((3,), float(n)))
    return names


# ---------------------------------------------------------------------- failures
class RankBoom(ValueError):
    """A custom exception raised on one rank (re-raised in the parent with its type)."""


class Unpicklable(Exception):
    """An exception that cannot be pickled (holds a lambda)."""

    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.fn = lambda: None


def raise_on(rank: int, world_size: int, bad_rank: int, kind: str) -> int:
    """Raise on ``bad_rank`` (the others return their rank)."""
    if rank == bad_rank:
        if kind == "custom":
            raise RankBoom(f"boom on rank {rank}")
        if kind == "keyerror":
            raise KeyError("missing")
        if kind == "unpicklable":
            raise Unpicklable()
    return rank


def exit_on(rank: int, world_size: int, bad_rank: int, how: str) -> int:
    """Die without a result on ``bad_rank``: ``os._exit(3)`` or SIGKILL."""
    import signal

    if rank == bad_rank:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def echo(rank: int, world_size: int, *args: Any) -> tuple[Any, ...]:
    """Return what the rank was called with, plus its pid and parent pid."""
    return (rank, world_size, args, os.getpid())


def read_env(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """The rank's view of env var ``name`` and of its node placement."""
    from coordinator import parallel_state as ps

    return {"env": os.environ.get(name), "same_node": ps.in_the_same_node_as(ps.get_world_group())}


def init_mp_then_check(rank: int, world_size: int, step: int) -> bool:
    """Step 0 leaves model parallelism initialised; step 1 sees it torn down."""
    from coordinator import parallel_state as ps

    if step == 0:
        ps.initialize_model_parallel(world_size, 1)
        return ps.model_parallel_is_initialized()
    was = ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(1, world_size)
    return was


def mismatched_all_reduce_on_gloo(rank: int, world_size: int) -> None:
    """On a group forced onto plain gloo (the "torch" communicator), all ranks
    all-reduce but the last rank passes a tensor twice as long."""
    from coordinator import GroupCoordinator

    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                         group_name="gloo-only", device_communicator="torch")
    assert type(g.comm).__name__ == "TorchDistributedCommunicator"
    n = 1000 * (2 if rank == world_size - 1 else 1)
    g.all_reduce(torch.ones(n))


def killed_mid_collective(rank: int, world_size: int, victim: int, delay: float) -> int:
    """All ranks loop over all_reduce; ``victim`` SIGKILLs itself ``delay`` s in."""
    import signal
    import threading

    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    g.barrier()
    if rank == victim:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    x = torch.ones(1 << 18)
    for _ in range(100_000):
        g.all_reduce(x)
    return rank


def barrier_timeout(rank: int, world_size: int) -> str:
    """barrier(timeout) with rank 1 missing raises CollectiveTimeout on rank 0 (world size 2)."""
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group
    from device_comms import CollectiveTimeout

    tmp = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="bartmp")
    msg = ""
    t0 = time.monotonic()
    if rank == 0:
        msg = expect_raises("barrier-timeout", CollectiveTimeout, lambda: tmp.barrier(timeout=1.0),
                            "bartmp", "barrier")
        assert time.monotonic() - t0 < 20, "barrier(timeout=1) took far too long"
    get_world_group().barrier()  # rank 1 waits here until rank 0 has failed
    tmp.destroy()
    return msg


def mismatch_then_recover(rank: int, world_size: int) -> dict[str, Any]:
    """Mismatched collectives on the default communicator: every rank must get an
    error (not hang), and the group must work afterwards."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    last = rank == world_size - 1
    out: dict[str, Any] = {"comm": type(g.comm).__name__}
    calls = {
        "numel": lambda: g.all_reduce(torch.ones(2000 if last else 1000)),
        "dtype": lambda: g.all_reduce(torch.ones(4, dtype=torch.int32 if last else torch.float32)),
        "op": lambda: g.all_reduce(torch.ones(4), "max" if last else "sum"),
        "all_gather": lambda: g.all_gather(torch.ones(3 if last else 2), 0),
        "kind": lambda: g.all_gather(torch.ones(4), 0) if last else g.all_reduce(torch.ones(4)),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = ("no error", None)
        except Exception as e:  # noqa: BLE001 - the type is the result
            out[name] = (type(e).__name__, round(time.monotonic() - t0, 2))
        expect_equal(f"recovered after {name}", g.all_reduce(torch.ones(3)),
                     torch.full((3,), float(world_size)))
    return out


def survivor_main(rank: int, world_size: int, port: int, conn: Any) -> None:
    """Entry point of a hand-spawned rank (no harness watching): rank 1 SIGKILLs
    itself in the middle of a stream of all-reduces; every survivor reports what
    it raised and how long after the death (sent through ``conn``)."""
    import signal

    from coordinator import GroupCoordinator
    from coordinator import parallel_state as ps

    try:
        ps.init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank)
        default = ps.get_world_group()
        gloo = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                group_name="gloo-only", device_communicator="torch")
        default.barrier()
        x = torch.ones(1 << 16)
        report: dict[str, Any] = {"comm": type(default.comm).__name__}
        for i in range(10_000):
            if rank == 1 and i == 20:
                conn.send(("dying", time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            g = default if i % 2 == 0 else gloo
            try:
                g.all_reduce(x)
            except Exception as e:  # noqa: BLE001 - reported to the test
                report["first"] = (g.unique_name, type(e).__name__, time.time(), str(e)[:300])
                break
        # The other group must fail as well (not hang) now that the peer is gone.
        other = gloo if report.get("first", ("world",))[0].startswith("world") else default
        try:
            other.all_reduce(x)
            report["second"] = (other.unique_name, "no error", time.time(), "")
        except Exception as e:  # noqa: BLE001
            report["second"] = (other.unique_name, type(e).__name__, time.time(), str(e)[:300])
        conn.send(("report", report))
    except BaseException as e:  # noqa: BLE001
        conn.send(("crash", repr(e)))
    finally:
        conn.close()
        os._exit(0)  # skip teardown that would talk to the dead peer
