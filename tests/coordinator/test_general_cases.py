"""General cases an engine builder tries, beyond the shapes our issues named.

* Odd world sizes (3, and 6 for layouts), every dtype an engine moves
  (float32/16, bfloat16, int8, uint8, int32, int64, bool), 0-dim, empty, 4-D,
  transposed/sliced/expanded inputs, negative and non-last dims, uneven
  all_gatherv/reduce_scatterv with zero-size ranks, non-zero dst/src.
* Odd Python objects (numpy arrays and scalars, tuples and tuple keys, sets,
  5 MiB bytes, big ints, torch.Size/dtype) through every object path, including
  the TP group's message queue, without pickle; dataclasses and enums too when
  the groups opt in with ``allow_pickle=True`` (msgspec would hand them back as
  dicts and values); Parameters, expanded tensors and a 24 MiB tensor in
  tensor dicts.
* Input only the source can get wrong (a meta or sparse tensor, a value that
  does not pickle) raises on the source *and* on every receiver; these used
  to leave the receivers waiting forever.
* ``barrier(timeout=...)`` validates its argument (a non-positive timeout used
  to reach gloo and break the group's connections).

Each function runs many cases on the ranks and returns the failed ones, so a
failure lists every broken case at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import traceback
from typing import Any

import numpy as np
import pytest
import torch

from device_comms import ReduceOp
from tests.coordinator.rank_checks import expect_equal, expect_raises, make, ref_reduce


def _no_failures(results: list[list[str]]) -> None:
    bad = [f"rank {r}: {f}" for r, fails in enumerate(results) for f in fails]
    assert not bad, "\n".join(bad[:40])


@pytest.mark.timeout(120)
def test_collectives_every_dtype_and_layout_at_world_size_3(dist_pool):
    """Odd group size through the default CPU communicator and plain gloo."""
    _no_failures(dist_pool(3).run(collectives, timeout=100))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("allow_pickle", [False, True], ids=["msgspec", "pickle-opt-in"])
def test_odd_objects_and_tensor_dicts_through_every_path_at_tp3(dist_pool, allow_pickle):
    """World group (CPU-group path) and TP=3 (message queue) and size-1 PP.

    The default carries every object here but dataclasses and enums, which
    only pickle returns as themselves: those are added when the groups opt in
    explicitly with ``allow_pickle=True`` (and refused without it, see
    ``source_failures``).
    """
    _no_failures(dist_pool(3).run(objects, 3, allow_pickle, timeout=100))


@pytest.mark.timeout(120)
def test_source_side_failures_raise_on_every_rank_and_barrier_timeouts(dist_pool):
    results = dist_pool(2).run(source_failures, 2, timeout=60)
    _no_failures(results)
    _no_failures(dist_pool(2).run(tensors_and_barrier, 2, timeout=60))


def _expected(tp: int, pp: int, dp: int, rank: int) -> dict:
    def group(same) -> list[int]:
        def coord(r: int) -> tuple[int, int, int]:
            return (r // (tp * pp), (r // tp) % pp, r % tp)

        return [r for r in range(tp * pp * dp) if same(coord(r), coord(rank))]

    out = {}
    for k, same in (("tp", lambda a, b: a[:2] == b[:2]),
                    ("pp", lambda a, b: (a[0], a[2]) == (b[0], b[2])),
                    ("dp", lambda a, b: a[1:] == b[1:])):
        ranks = group(same)
        i = ranks.index(rank)
        out[k] = (ranks, i, ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)],
                  i == 0, i == len(ranks) - 1)
    return out


LAYOUTS_3 = [(3, 1, 1), (1, 3, 1), (1, 1, 3)]


@pytest.mark.timeout(120)
def test_layouts_and_reinit_at_world_size_3(dist_pool):
    results = dist_pool(3).run(layouts, LAYOUTS_3, timeout=100)
    for rank, recs in enumerate(results):
        for (tp, pp, dp), rec in zip(LAYOUTS_3, recs, strict=False):
            want = _expected(tp, pp, dp, rank)
            for k in ("tp", "pp", "dp"):
                assert tuple(rec[k]) == want[k], (
                    f"{(tp, pp, dp)} rank {rank} {k}: {rec[k]} != {want[k]}")
            assert rec["getters"] == (tp, want["tp"][1], pp, want["pp"][1])


LAYOUTS_6 = [(3, 2, 1), (2, 3, 1), (1, 2, 3)]


@pytest.mark.slow  # CI time; world sizes 2-4 run by default
@pytest.mark.timeout(150)
def test_layouts_and_reinit_at_world_size_6():
    from coordinator.testing import run_distributed

    results = run_distributed(layouts, 6, LAYOUTS_6, timeout=120)
    for rank, recs in enumerate(results):
        for (tp, pp, dp), rec in zip(LAYOUTS_6, recs, strict=False):
            want = _expected(tp, pp, dp, rank)
            for k in ("tp", "pp", "dp"):
                assert tuple(rec[k]) == want[k], (
                    f"{(tp, pp, dp)} rank {rank} {k}: {rec[k]} != {want[k]}")
            assert rec["getters"] == (tp, want["tp"][1], pp, want["pp"][1])


# ---------------------------------------------------------------------- on the ranks
ALL_DT = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Point:
    x: int
    y: list


def _mk(r, shape, dt, tag):
    if dt == torch.uint8:
        return make(r, shape, torch.int64, tag).abs().remainder(50).to(torch.uint8)
    if dt == torch.int8:
        return make(r, shape, torch.int64, tag).remainder(20).to(torch.int8)
    return make(r, shape, dt, tag)


def _ok_op(op, dt):
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return not dt.is_floating_point
    if op is ReduceOp.AVG:
        return dt.is_floating_point
    return True


def _ref(ts, op, dt):
    if dt == torch.bool:
        s = torch.stack(ts)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return s.any(0)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return s.all(0)
        return (s.to(torch.int64).sum(0) % 2).bool()
    if op in (ReduceOp.SUM, ReduceOp.PRODUCT) and dt in (torch.int8, torch.uint8, torch.int32):
        return ref_reduce([t.to(torch.int64) for t in ts], op).to(dt)
    return ref_reduce(ts, op)


def collectives(rank: int, world_size: int) -> list[str]:
    from coordinator import GroupCoordinator
    from coordinator.parallel_state import get_world_group

    fails: list[str] = []
    groups = [("world", get_world_group())]
    if world_size > 1:
        groups.append(("gloo", GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                                 group_name="pg", device_communicator="torch")))

    def chk(case, fn):
        try:
            fn()
        except Exception as e:
            fails.append(f"{case}: {type(e).__name__}: {str(e)[:300]}")

    for tag, g in groups:
        n, me = g.world_size, g.rank_in_group
        for dt in ALL_DT:
            for op in ReduceOp:
                case = f"{tag}/ar/{dt}/{op.name}"
                if not _ok_op(op, dt):
                    continue

                def f(case=case, dt=dt, op=op):
                    xs = [_mk(r, (3, 5), dt, case) for r in range(n)]
                    expect_equal(case, g.all_reduce(xs[me], op), _ref(xs, op, dt))
                chk(case, f)
            # 0-dim all_reduce
            def f0(dt=dt):
                xs = [_mk(r, (), dt, f"{tag}0{dt}") for r in range(n)]
                expect_equal(f"{tag}/ar0/{dt}", g.all_reduce(xs[me], ReduceOp.MAX),
                             _ref(xs, ReduceOp.MAX, dt))
            chk(f"{tag}/ar0/{dt}", f0)
            # reduce dst n-1
            def fr(dt=dt):
                xs = [_mk(r, (4,), dt, f"{tag}r{dt}") for r in range(n)]
                got = g.reduce(xs[me], n - 1, ReduceOp.MIN)
                if me == n - 1:
                    expect_equal("reduce", got, _ref(xs, ReduceOp.MIN, dt))
            chk(f"{tag}/reduce/{dt}", fr)
            # 4-D collectives on many dims, non-contiguous inputs
            for dim in (0, 1, 2, 3, -2, -3, -4):
                def fg(dt=dt, dim=dim):
                    shp = (2, 3, 2 * n, 4)
                    xs = [_mk(r, (4, 2 * n, 3, 2), dt, f"{tag}g{dt}{dim}").permute(3, 2, 1, 0)
                          for r in range(n)]
                    # non-contiguous (2, 3, 2n, 4)
                    assert xs[me].shape == torch.Size(shp)
                    expect_equal("ag", g.all_gather(xs[me], dim), torch.cat(xs, dim))
                    got = g.gather(xs[me], n - 1, dim)
                    if me == n - 1:
                        expect_equal("gather", got, torch.cat(xs, dim))
                    else:
                        assert got is None
                    sl = [x[:, ::2] for x in xs]  # sliced
                    expect_equal("ag-sliced", g.all_gather(sl[me], dim), torch.cat(sl, dim))
                chk(f"{tag}/ag4d/{dt}/{dim}", fg)
            for dim in (0, 1, 2, -1, -2):
                def frs(dt=dt, dim=dim):
                    shp = [2 * n, 2 * n, 2 * n]
                    xs = [_mk(r, shp, dt, f"{tag}rs{dt}{dim}").transpose(0, 2) for r in range(n)]
                    op = ReduceOp.MAX
                    full = _ref(xs, op, dt)
                    expect_equal("rs", g.reduce_scatter(xs[me], dim, op),
                                 full.chunk(n, dim)[me].contiguous())
                    # scatter from n-1, non-contig input
                    got = g.scatter(xs[n - 1] if me == n - 1 else None, n - 1, dim)
                    expect_equal("scatter", got, xs[n - 1].chunk(n, dim)[me].contiguous())
                    got = g.all_to_all(xs[me], dim, (dim + 1) % 3)
                    want = torch.cat([x.chunk(n, dim)[me] for x in xs], (dim + 1) % 3)
                    expect_equal("a2a", got, want)
                chk(f"{tag}/rs/{dt}/{dim}", frs)
            # gatherv / reduce_scatterv with zero-size ranks at several dims
            sizes = [0, 3, 1, 0, 2, 5][:n] if n > 1 else [0]
            for dim in (0, 1, -1, -2):
                def fv(dt=dt, dim=dim):
                    def shp(s):
                        b = [2, 3, 4]
                        b[dim] = s
                        return b
                    xs = [_mk(r, shp(sizes[r]), dt, f"{tag}v{dt}{dim}") for r in range(n)]
                    # make non-contiguous via clone-transposed
                    x = xs[me].transpose(0, 1).contiguous().transpose(0, 1)
                    expect_equal("agv", g.all_gatherv(x, dim, sizes), torch.cat(xs, dim))
                    tot = sum(sizes)
                    ys = [_mk(r, shp(tot), dt, f"{tag}rsv{dt}{dim}") for r in range(n)]
                    op = ReduceOp.MAX
                    strided = ys[me].transpose(0, 1).contiguous().transpose(0, 1)
                    expect_equal("rsv", g.reduce_scatterv(strided, dim, sizes, op),
                                 _ref(ys, op, dt).split(sizes, dim)[me].contiguous())
                chk(f"{tag}/v/{dt}/{dim}", fv)
            # broadcast from n-1 incl. 0-dim and empty
            def fb(dt=dt):
                for shp in ((), (0,), (3, 0, 2), (2, 3, 4, 5)):
                    want = _mk(n - 1, shp, dt, f"{tag}b{dt}{shp}")
                    buf = want.clone() if me == n - 1 else torch.zeros(shp, dtype=dt)
                    g.broadcast(buf, n - 1)
                    expect_equal(f"bcast{shp}", buf, want)
            chk(f"{tag}/bcast/{dt}", fb)
            if n > 1:
                def fs(dt=dt):
                    for shp in ((), (0,), (2, 3, 4, 5)):
                        x = _mk(0, shp, dt, f"{tag}s{dt}{shp}")
                        if me == 0:
                            src = x.t() if x.dim() == 2 else x
                            g.send(src, n - 1)
                        elif me == n - 1:
                            expect_equal(f"send{shp}", g.recv(x.shape, dt, 0), x)
                chk(f"{tag}/sendrecv/{dt}", fs)
        # empty tensors with numel 0 through every op, 3-D
        def fe():
            e = torch.empty(2 * n, 0, 3)
            expect_equal("ar", g.all_reduce(e, ReduceOp.MAX), e)
            expect_equal("ag", g.all_gather(e, 0), torch.empty(2 * n * n, 0, 3))
            expect_equal("rs", g.reduce_scatter(e, 0), torch.empty(2, 0, 3))
            expect_equal("a2a", g.all_to_all(e, 0, 2), torch.empty(2, 0, 3 * n))
            got = g.gather(e, n - 1, 2)
            if me == n - 1:
                expect_equal("gather", got, torch.empty(2 * n, 0, 3 * n))
            got = g.reduce(e, n - 1)
            if me == n - 1:
                expect_equal("reduce", got, e)
            expect_equal("agv", g.all_gatherv(e, 0, [2 * n] * n), torch.empty(2 * n * n, 0, 3))
        chk(f"{tag}/empty", fe)
    for _, g in groups[1:]:
        g.destroy()
    return fails


def objects(rank: int, world_size: int, tp: int, allow_pickle: bool = False) -> list[str]:
    from coordinator import GroupCoordinator
    from coordinator import parallel_state as ps

    fails: list[str] = []

    def chk(case, fn):
        try:
            fn()
        except Exception as e:
            fails.append(f"{case}: {type(e).__name__}: {str(e)[:300]}\n"
                         f"{traceback.format_exc()[-600:]}")

    ps.initialize_model_parallel(tp, world_size // tp, allow_pickle=allow_pickle)
    world = ps.get_world_group()
    if allow_pickle:  # the pool's world group did not opt in: a world-sized group that does
        world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                                 group_name="world-pickle", allow_pickle=True)
    groups = [("world", world), ("tp", ps.get_tp_group()), ("pp", ps.get_pp_group())]
    pickle_only = {"dc": Point(3, [1, (2, 3)]), "enum": Color.RED} if allow_pickle else {}
    for tag, g in groups:
        n, me = g.world_size, g.rank_in_group
        objs = {
            **pickle_only,
            "npscalar": np.float32(1.5),
            "torch_meta": [torch.Size([2, 3]), torch.bfloat16],
            "np": np.arange(6, dtype=np.float16).reshape(2, 3),
            "big": b"\x01" * (5 << 20),
            "tuple": (1, (2, "x"), None),
            "set": {1, 2},
            "tkey": {(1, 2): "a", 3: "b", None: 4},
            "t": torch.arange(5),
            "nested_t": {"a": [torch.ones(2, dtype=torch.bfloat16), {"b": torch.zeros(3, 0)}]},
            "none": None,
            "bytes0": b"",
            "bigint": 1 << 80,
        }
        for src in range(n):
            for k, o in objs.items():
                def f(k=k, o=o, src=src):
                    got = g.broadcast_object(o if me == src else None, src)
                    _same(got, o, k)
                chk(f"{tag}/bobj/{src}/{k}", f)
            def fl(src=src):
                lst = list(objs.values()) if me == src else [None] * len(objs)
                g.broadcast_object_list(lst, src)
                for (k, o), got in zip(objs.items(), lst, strict=False):
                    _same(got, o, k)
            chk(f"{tag}/bobjlist/{src}", fl)
            # tensor dicts with odd values
            td = {
                "a": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
                "nested": {"x": 1, "y": [1, 2]},
                "tuple": (1, 2),
                "lst": [None, "s"],
                "none": None,
                ("k", 1): "tuple key",
                5: torch.tensor(True),
                None: "none key",
                "i8": torch.tensor([-3, 4], dtype=torch.int8),
                "u8": torch.tensor([250, 4], dtype=torch.uint8),
                "f16": torch.tensor([[1.5]], dtype=torch.float16),
                **pickle_only,
                "np": np.ones(3, dtype=np.int32),
                "e": torch.empty(0, dtype=torch.int64),
                "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
            }
            def ftd(src=src, td=td):
                got = g.broadcast_tensor_dict(td if me == src else None, src)
                _same(got, td, "td")
            chk(f"{tag}/btd/{src}", ftd)
            def ftd_empty(src=src):
                got = g.broadcast_tensor_dict({} if me == src else None, src)
                assert got == {}, got
            chk(f"{tag}/btd-empty/{src}", ftd_empty)
        if n > 1:
            for a in range(n):
                b = (a + 1) % n
                for k, o in objs.items():
                    def fp(k=k, o=o, a=a, b=b):
                        if me == a:
                            g.send_object(o, b)
                        elif me == b:
                            _same(g.recv_object(a), o, k)
                    chk(f"{tag}/p2pobj/{a}->{b}/{k}", fp)
                def fstd(a=a, b=b, td=td):
                    if me == a:
                        g.send_tensor_dict(td, b)
                    elif me == b:
                        _same(g.recv_tensor_dict(a), td, "std")
                chk(f"{tag}/std/{a}->{b}", fstd)
                def fstd_empty(a=a, b=b):
                    if me == a:
                        g.send_tensor_dict({}, b)
                    elif me == b:
                        got = g.recv_tensor_dict(a)
                        assert got == {}, got
                chk(f"{tag}/std-empty/{a}->{b}", fstd_empty)
    if allow_pickle:
        world.destroy()
    return fails


def _same(got: Any, want: Any, case: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{case}: {type(got)}"
        expect_equal(case, got, want)
        return
    if isinstance(want, np.ndarray):
        assert (isinstance(got, np.ndarray) and got.dtype == want.dtype
                and np.array_equal(got, want)), f"{case}: {got!r}"
        return
    assert type(got) is type(want), (
        f"{case}: type {type(got).__name__} != {type(want).__name__}: {got!r}")
    if isinstance(want, dict):
        assert list(got) == list(want), f"{case}: keys {list(got)} != {list(want)}"
        for k in want:
            _same(got[k], want[k], f"{case}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), case
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            _same(a, b, f"{case}[{i}]")
    else:
        assert got == want, f"{case}: {got!r} != {want!r}"


def tensors_and_barrier(rank: int, world_size: int, tp: int) -> list[str]:
    from coordinator import parallel_state as ps

    fails: list[str] = []

    def chk(case, fn):
        try:
            fn()
        except Exception as e:
            fails.append(f"{case}: {type(e).__name__}: {str(e)[:300]}\n"
                         f"{traceback.format_exc()[-800:]}")

    ps.initialize_model_parallel(tp, world_size // tp)
    for tag, g in (("world", ps.get_world_group()), ("tp", ps.get_tp_group())):
        n, me = g.world_size, g.rank_in_group
        w = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
        ex = torch.ones(1, 4).expand(3, 4)
        big = torch.arange((24 << 20) // 4, dtype=torch.float32)
        td = {"w": w, "wt": w.t(), "ex": ex, "big": big,
              "grad": torch.ones(2, requires_grad=True) * 2}
        def f1():
            got = g.broadcast_tensor_dict(td if me == 0 else None, 0)
            for k in td:
                expect_equal(k, got[k].detach(), td[k].detach())
        chk(f"{tag}/btd-grad-expand-big", f1)
        def f2():
            expect_equal("ar-param", g.all_reduce(w).detach(), w.detach() * n)
            expect_equal("ag-expand", g.all_gather(ex, 0), torch.ones(3 * n, 4))
            expect_equal("ar-expand", g.all_reduce(ex), torch.full((3, 4), float(n)))
        chk(f"{tag}/coll-grad-expand", f2)
        def f3():
            got = g.broadcast_object(td if me == 0 else None, 0)
            for k in td:
                expect_equal(k, got[k].detach(), td[k].detach())
        chk(f"{tag}/bobj-td", f3)
        # received tensors must be writable and independent of later broadcasts
        def f4():
            a = g.broadcast_tensor_dict({"x": torch.full((4,), 1.0)} if me == 0 else None, 0)
            for i in range(20):
                g.broadcast_tensor_dict({"x": torch.full((4,), float(i + 2))} if me == 0 else None,
                                        0)
            expect_equal("stable", a["x"], torch.full((4,), 1.0))
            a["x"].add_(1)
            o = g.broadcast_object(np.zeros(3) if me == 0 else None, 0)
            o += 1
        chk(f"{tag}/independent", f4)
        if n > 1:
            def f5():
                if me == 0:
                    g.send_tensor_dict(td, n - 1)
                elif me == n - 1:
                    got = g.recv_tensor_dict(0)
                    for k in td:
                        expect_equal(k, got[k].detach(), td[k].detach())
            chk(f"{tag}/std-grad", f5)
        # barrier: bad timeouts raise on every rank before any communication
        # (a non-positive one used to reach gloo and break the group's pairs).
        def fb():
            for bad, exc in (("5", TypeError), (True, TypeError), (None, None), (-1, ValueError),
                             (0, ValueError), (float("nan"), ValueError),
                             (float("inf"), ValueError)):
                if exc is not None:
                    expect_raises(f"barrier({bad!r})", exc, lambda: g.barrier(timeout=bad),
                                  "timeout")
            g.barrier(timeout=datetime.timedelta(seconds=60))
            g.barrier(timeout=60)
            expect_equal("after-barriers", g.all_reduce(torch.ones(2)), torch.full((2,), float(n)))
        chk(f"{tag}/barrier-timeouts", fb)
    return fails


def source_failures(rank: int, world_size: int, tp: int) -> list[str]:
    """Input only the source/sender can get wrong (a tensor on the wrong device,
    a sparse tensor, a value that cannot be serialised): the source raises
    TypeError/ValueError naming the argument and every receiver raises
    ValueError naming the source, instead of waiting forever. Runs on the world
    group (CPU-group path) and the TP group (message-queue path)."""
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(tp, world_size // tp)
    fails: list[str] = []
    meta_t = torch.empty(2, device="meta")
    sparse = torch.eye(2).to_sparse()
    def lam() -> int:
        return 1

    for tag, g in (("world", ps.get_world_group()), ("tp", ps.get_tp_group())):
        n, me = g.world_size, g.rank_in_group
        src, dst = n - 1, 0
        # (name, call on src, call on the others, src exception, words in src message)
        cases = [
            ("btd/meta", lambda: g.broadcast_tensor_dict({"ok": torch.ones(1), "a": meta_t}, src),
             lambda: g.broadcast_tensor_dict(None, src), ValueError, ("'a'", "meta")),
            ("btd/sparse", lambda: g.broadcast_tensor_dict({"s": sparse}, src),
             lambda: g.broadcast_tensor_dict(None, src), TypeError, ("'s'", "sparse")),
            ("btd/unpicklable",
             lambda: g.broadcast_tensor_dict({"f": lam, "t": torch.ones(3)}, src),
             lambda: g.broadcast_tensor_dict(None, src), TypeError, ("tensor_dict", "serialised")),
            ("btd/unpicklable-explicit-groups",
             lambda: g.broadcast_tensor_dict({"f": lam}, src, g.device_group, g.cpu_group),
             lambda: g.broadcast_tensor_dict(None, src, g.device_group, g.cpu_group),
             TypeError, ("tensor_dict",)),
            ("bobj/unpicklable", lambda: g.broadcast_object({"f": lam}, src),
             lambda: g.broadcast_object(None, src), TypeError, ("obj", "serialised")),
            ("bobj_list/unpicklable", lambda: g.broadcast_object_list([1, lam], src),
             lambda: g.broadcast_object_list([None, None], src), TypeError, ("obj_list",)),
            # Without the pickle opt-in, values msgspec cannot carry exactly are
            # refused on the source, naming the type and the opt-in.
            ("bobj/dataclass-needs-pickle", lambda: g.broadcast_object(Point(1, [2]), src),
             lambda: g.broadcast_object(None, src), TypeError, ("Point", "allow_pickle=True")),
            ("btd/enum-needs-pickle", lambda: g.broadcast_tensor_dict({"e": Color.RED}, src),
             lambda: g.broadcast_tensor_dict(None, src), TypeError, ("Color", "allow_pickle=True")),
        ]
        for name, on_src, on_other, exc, words in cases:
            def f(on_src=on_src, on_other=on_other, exc=exc, words=words, name=name):
                if me == src:
                    expect_raises(f"{tag}/{name}/src", exc, on_src, *words)
                else:
                    expect_raises(f"{tag}/{name}/receiver", ValueError, on_other,
                                  f"source rank {src}")
            _collect(fails, f"{tag}/{name}", f)
        # Point-to-point: the sender raises for its bad argument (a meta or
        # sparse tensor) or a value that does not serialise, and the receiver
        # is told in place of the dict or object it waits for.
        p2p = [
            ("std/meta", lambda: g.send_tensor_dict({"a": meta_t}, dst), ValueError,
             ("'a'", "meta"), f"rank {src} rejected"),
            ("std/sparse", lambda: g.send_tensor_dict({"s": sparse}, dst), TypeError,
             ("'s'", "sparse"), f"rank {src} rejected"),
            ("std/unpicklable", lambda: g.send_tensor_dict({"f": lam}, dst), TypeError,
             ("tensor_dict", "serialised"), f"rank {src})"),
            ("sobj/unpicklable", lambda: g.send_object(lam, dst), TypeError, ("obj", "serialised"),
             f"rank {src})"),
            ("sobj/enum-needs-pickle", lambda: g.send_object(Color.RED, dst), TypeError,
             ("Color", "allow_pickle=True"), f"rank {src})"),
        ]
        for name, on_src, exc, words, told in p2p:
            recv = g.recv_object if name.startswith("sobj") else g.recv_tensor_dict
            def fp(on_src=on_src, exc=exc, words=words, name=name, recv=recv, told=told):
                if me == src:
                    expect_raises(f"{tag}/{name}/sender", exc, on_src, *words)
                elif me == dst:
                    expect_raises(f"{tag}/{name}/receiver", ValueError, lambda: recv(src), told)
            _collect(fails, f"{tag}/{name}", fp)
        # the group is still in step afterwards
        _collect(fails, f"{tag}/still-works", lambda: expect_equal(
            "still-works", g.all_reduce(torch.ones(2)), torch.full((2,), float(n))))
        got = g.broadcast_tensor_dict({"x": torch.arange(3)} if me == src else None, src)
        _collect(fails, f"{tag}/btd-after",
                 lambda: expect_equal("btd-after", got["x"], torch.arange(3)))
    return fails


def _collect(fails: list[str], case: str, fn: Any) -> None:
    try:
        fn()
    except Exception as e:
        fails.append(f"{case}: {type(e).__name__}: {str(e)[:400]}")


def layouts(rank: int, world_size: int, configs: list[tuple[int, int, int]]) -> list[dict]:
    """initialize / use / destroy model parallelism for each (tp, pp, dp) in the
    same processes; returns each group's ranks and neighbours for the test to check."""
    from coordinator import parallel_state as ps

    out = []
    for tp, pp, dp in configs:
        ps.initialize_model_parallel(tp, pp, dp)
        rec: dict[str, Any] = {}
        for k, g in (("tp", ps.get_tp_group()), ("pp", ps.get_pp_group()),
                     ("dp", ps.get_dp_group())):
            rec[k] = (list(g.ranks), g.rank_in_group, g.next_rank, g.prev_rank, g.is_first_rank,
                      g.is_last_rank)
            xs = [_mk(r, (2, 3), torch.bfloat16, f"{tp}{pp}{dp}{k}") for r in g.ranks]
            me = g.rank_in_group
            expect_equal(f"{k}/ar", g.all_reduce(xs[me]), ref_reduce(xs, ReduceOp.SUM))
            expect_equal(f"{k}/ag", g.all_gather(xs[me], -2), torch.cat(xs, 0))
            want = {"k": xs[-1], "s": (k, tp)}
            last = g.world_size - 1
            got = g.broadcast_tensor_dict(want if me == last else None, last)
            expect_equal(f"{k}/btd", got["k"], xs[-1])
            assert got["s"] == (k, tp), got["s"]
        # pipeline hand-off from each stage to the next, TP-sliced
        pg, tpg = ps.get_pp_group(), ps.get_tp_group()
        if pg.world_size > 1:
            x = _mk(tpg.ranks[0] // tp, (tp * 2, 3), torch.float32, f"pipe{tp}{pp}{dp}")
            if not pg.is_first_rank:
                got = pg.recv_tensor_dict(all_gather_group=tpg)
                prev = _mk(pg.prev_rank // tp, (tp * 2, 3), torch.float32, f"pipe{tp}{pp}{dp}")
                expect_equal("pipe", got["h"], prev)
            if not pg.is_last_rank:
                pg.send_tensor_dict({"h": x}, all_gather_group=tpg)
        rec["getters"] = (ps.get_tensor_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_rank(),
                          ps.get_pipeline_model_parallel_world_size(),
                          ps.get_pipeline_model_parallel_rank())
        ps.destroy_model_parallel()
        out.append(rec)
    return out
