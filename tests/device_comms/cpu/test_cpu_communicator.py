"""CpuCommunicator: every shared-memory op against a reference, on 2, 3 and 4 real ranks."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.testing import run_distributed
from device_comms import (
    CollectiveMismatch,
    CollectiveTimeout,
    CpuCommunicator,
    PeerDiedError,
    ReduceOp,
    reduce_local,
    select_device_communicator,
)
from shm_broadcast.lifecycle.segment import list_segments
from shm_broadcast.ranks.launcher import spawn_group


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_registered_above_torch() -> None:
    assert select_device_communicator("cpu") is CpuCommunicator
    assert select_device_communicator(torch.device("cpu")) is CpuCommunicator
    assert CpuCommunicator.priority > 0 and CpuCommunicator.device_types == {"cpu"}


@pytest.mark.parametrize("device,exc", [(None, TypeError), (3.0, TypeError), (True, TypeError),
                                        ("blah", ValueError), ("cpu:x", ValueError)])
def test_select_refuses_what_is_not_a_device(device: Any, exc: type) -> None:
    with pytest.raises(exc, match="device"):
        select_device_communicator(device)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_op_matches_reference(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(all_cases)
    cases = build_cases(world_size)
    for out in outs:
        assert out["mode"] == "shm"
        assert out["leftover"] == [], "workspace name must be unlinked once every rank attached"
        assert out["mapped_before"] and not out["mapped_after"], "destroy() must unmap"
        assert all(v > 0 for v in out["calls"].values()), out["calls"]
        total = world_size * (world_size + 1) / 2
        for r in out["extras"]["grad"]:
            assert not r.requires_grad and r.tolist() == [total] * 4
        for r in out["extras"]["noncontig"]:
            assert torch.equal(r, torch.arange(12.0).reshape(3, 4).t() * total)
        assert out["extras"]["str_op"].tolist() == [1.0, 1.0]
        assert out["extras"]["a2av"].tolist() == [[float(q)] * 2 for q in range(world_size)]
        assert out["extras"]["rows"] == list(range(world_size))
        assert "AVG" in out["extras"]["bad_op"]
    failures = []
    for key in ("results", "results_big", "results_pieces"):
        for c in cases:
            if key == "results_pieces" and c.kind not in ("all_reduce", "reduce"):
                continue
            got = [out[key][c.idx] for out in outs]
            for rank in range(world_size):
                want = expected(c, world_size, rank)
                if not _same(got[rank], want):
                    failures.append(f"{key} {c} rank {rank}: got {got[rank]!r}, want {want!r}")
            # Results that every rank receives are bitwise identical across ranks.
            if c.kind in ("all_reduce", "all_gather", "all_gatherv", "broadcast"):
                assert all(_same(g, got[0]) for g in got), f"ranks disagree on {c}"
    assert not failures, f"{len(failures)} mismatches, first: {failures[:3]}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_world_group_uses_shm(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(world_group_comm)
    total = world_size * (world_size + 1) / 2
    for out in outs:
        assert out["type"] == "CpuCommunicator" and out["mode"] == "shm"
        assert out["sum"] == [total] * 5


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_calls_raise_on_every_rank(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(mismatch)
    for out in outs:
        size_err, dtype_err, op_err, gather_err = out["errors"]
        assert size_err and "shape=(10,)" in size_err and "shape=(11,)" in size_err
        assert dtype_err and "torch.int32" in dtype_err and "torch.float32" in dtype_err
        assert op_err and "op=MAX" in op_err and "op=SUM" in op_err
        assert "group 't'" in size_err
        # A layout digest ("sizes #...") comes with what this rank passed.
        assert gather_err and "sizes #" in gather_err, gather_err
        own = (3 if out["rank"] == 1 else 2, 5)
        assert f"this rank passed: float32 tensor of shape {own}" in gather_err, gather_err
        assert out["after"] == [float(world_size)] * 3  # still usable afterwards


def test_fallback_to_gloo(dist_pool) -> None:
    outs = dist_pool(2).run(fallbacks)
    for out in outs:
        for label in ("disabled", "own_nodes"):
            o = out[label]
            assert o["mode"] == "gloo" and o["reason"], o
            assert o["calls"] == 0
            assert o["sum"] == [3.0 * i for i in range(6)]
            assert o["gather"] == [0, 1]
        assert "rank(s) [0]" in out["disabled"]["reason"]


def test_bad_arguments(dist_pool) -> None:
    msgs = dist_pool(2).run(bad_arguments)[0]
    assert msgs[0].startswith("ValueError") and "workspace_bytes" in msgs[0]
    assert msgs[1].startswith("TypeError") and "workspace_bytes" in msgs[1]
    assert msgs[2].startswith("TypeError") and "use_shm" in msgs[2]
    assert msgs[3].startswith("ValueError") and "timeout" in msgs[3]
    assert msgs[4].startswith("TypeError") and "node_id" in msgs[4]
    assert msgs[5].startswith("ValueError") and "oneshot_bytes" in msgs[5]
    assert "GROUPCOORD_CPU_SHM_BYTES" in msgs[6] and "'lots'" in msgs[6]
    for msg, (exc, word) in zip(msgs[7:], BAD_POSITIONAL.values(), strict=True):
        assert msg.startswith(exc) and word in msg, msg


BAD_POSITIONAL = {  # constructor arguments before the keywords: (exception, name in the message)
    "group-not-a-group": ("TypeError", "cpu_group"),
    "device-group-not-a-group": ("TypeError", "device_group"),
    "device-float": ("TypeError", "device"),
    "device-unknown": ("ValueError", "device"),
    "device-gpu": ("ValueError", "CPU device"),
    "name-not-a-str": ("TypeError", "unique_name"),
}


def test_timeout_and_destroyed_peer(dist_pool) -> None:
    out = dist_pool(2).run(timeout_and_close)[0]
    elapsed, msg, is_timeout = out["timeout"]
    assert is_timeout and 0.5 <= elapsed < 2.0
    assert "group 't'" in msg and "all_reduce" in msg and "[1]" in msg
    assert "unusable" in out["after_timeout"]
    elapsed, msg = out["closed"]
    assert elapsed < 2.0 and "rank 1" in msg and "destroyed" in msg


@pytest.mark.timeout(120)
def test_killed_peer_is_reported_within_2s() -> None:
    # Rank 0 owns the workspace segment: its death must not leave it behind
    # (the autouse leak check verifies /dev/shm after the test).
    outs = spawn_group(killed_peer, 3, (0,), timeout=90)
    assert outs[0].exitcode == -9 and not outs[0].ok
    for o in outs[1:]:
        assert o.ok, o.error
        res = o.result
        assert res["error"] is not None, "survivor did not notice the dead peer"
        assert res["elapsed"] < 2.0, res
        assert "rank 0" in res["error"] and "died" in res["error"] and "all_reduce" in res["error"]
        assert "group 't'" in res["error"]


def _hier_expected(case: Case, nodes: list[int], n: int) -> torch.Tensor:
    """Reduce inside each node in rank order, then across nodes in node order."""
    from device_comms import reduce_local

    inner = ReduceOp.SUM if case.op is ReduceOp.AVG else case.op
    partials = []
    for node in sorted(set(nodes)):
        xs = [make_input(case, r) for r in range(n) if nodes[r] == node]
        partials.append(reduce_local(xs, inner) if len(xs) > 1 else xs[0].clone())
    total = reduce_local(partials, inner)
    if case.op is ReduceOp.AVG:
        total.div_(n)
    return total


@pytest.mark.timeout(180)
def test_hierarchical_all_reduce() -> None:
    env = [{"GROUPCOORD_NODE_ID": k} for k in ("a", "a", "b", "b")]
    layouts = [None, ["x", "y", "x", "x"]]  # env: {0,1}{2,3}; argument: {0,2,3}{1}
    outs = run_distributed(hierarchical, 4, layouts, env=env, timeout=150)
    for li, want_nodes in enumerate(([0, 0, 1, 1], [0, 1, 0, 0])):
        per_rank = [o[li] for o in outs]
        idx = 0
        for rank, o in enumerate(per_rank):
            assert o["mode"] == "hierarchical" and o["nodes"] == want_nodes
            assert o["hier_calls"] == len(o["results"])
            assert o["engine"] == (want_nodes.count(want_nodes[rank]) > 1)
            if o["engine"]:
                assert o["intra_shm"] == 2 * o["hier_calls"]  # reduce + broadcast per call
            assert o["other_op"] == [0, 1, 2, 3]
        for dtype in FLOATS + INTS:
            ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN) if dtype in FLOATS else (
                ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR)
            for op in ops:
                for shape in ((1,), (7, 3), (20011,)):
                    case = Case(idx, "all_reduce", dtype, shape, op=op)
                    got = [o["results"][idx] for o in per_rank]
                    want = _hier_expected(case, want_nodes, 4)
                    assert all(_same(g, got[0]) for g in got), f"ranks disagree on {case}"
                    assert _same(got[0], want), f"{case}: got {got[0]}, want {want}"
                    idx += 1


# ---------------------------------------------------------------------- the cases
# Every rank builds the same case list and the same inputs (seeded by case and
# rank), so the parent can rebuild every rank's input and compute the expected
# result with the reference reduction, independently of the code under test.
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


# ---------------------------------------------------------------------- on the ranks
# Called as ``fn(rank, world_size, *args)`` with torch.distributed (gloo)
# initialised. They return plain data to the parent, which does the checking.
SMALL_WS = 64 << 10  # workspace of the tests' communicators: forces the chunked paths


def _comm(**kw: Any) -> CpuCommunicator:
    kw.setdefault("workspace_bytes", SMALL_WS)
    return CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="t", **kw)


def _maps(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Run every case through a small-workspace communicator (and a default one)."""
    comm = _comm(oneshot_bytes=2048)
    seg_name = comm._engine.ws.segment.name if comm._engine is not None else None
    results = [run_case(comm, c, rank) for c in build_cases(world_size)]
    # The same cases with the default (large) workspace: every op fits in one piece.
    big = _comm(workspace_bytes=None)
    results_big = [run_case(big, c, rank) for c in build_cases(world_size)]
    # Reductions larger than a slot in one-shot pieces (the 2-rank default).
    pieces = _comm(oneshot_bytes=1 << 40)
    results_pieces = [
        run_case(pieces, c, rank) if c.kind in ("all_reduce", "reduce") else None
        for c in build_cases(world_size)
    ]
    pieces.destroy()
    # Inputs the all_reduce fast path must leave to the validating path.
    g = torch.full((4,), float(rank + 1), requires_grad=True)
    nc = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # non-contiguous
    extras = {
        "grad": [comm.all_reduce(g) for _ in range(2)],
        "noncontig": [comm.all_reduce(nc) for _ in range(2)],
        "str_op": comm.all_reduce(torch.ones(2), "max"),
        # one row to every rank through the engine (test_all_to_allv.py has the rest)
        "a2av": comm.all_to_allv(torch.full((world_size, 2), float(rank)), [1] * world_size),
        # rows of two tensors in one step (test_all_gatherv_rows.py has the rest)
        "rows": comm.all_gatherv_rows([torch.full((rank, 2), float(rank)),
                                       torch.ones(rank, dtype=torch.int64)])[1],
    }
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.int32), ReduceOp.AVG)
        extras["bad_op"] = None
    except TypeError as e:
        extras["bad_op"] = str(e)
    calls = dict(comm.shm_calls)
    leftover = [s.name for s in list_segments() if s.kind == "cpucomm" and s.pid == os.getpid()]
    mapped_before = seg_name is not None and _maps(seg_name)
    comm.destroy()
    big.destroy()
    comm.destroy()  # idempotent
    return {
        "mode": comm.mode,
        "results": results,
        "results_big": results_big,
        "results_pieces": results_pieces,
        "calls": calls,
        "extras": extras,
        "leftover": leftover,
        "mapped_before": mapped_before,
        "mapped_after": seg_name is not None and _maps(seg_name),
    }


def world_group_comm(rank: int, world_size: int) -> dict[str, Any]:
    """What the registry put into the harness's world GroupCoordinator."""
    from coordinator.parallel_state import get_world_group

    g = get_world_group()
    x = torch.full((5,), float(rank + 1))
    return {
        "type": type(g.device_communicator).__name__,
        "mode": getattr(g.device_communicator, "mode", None),
        "sum": g.all_reduce(x).tolist(),
    }


def mismatch(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks disagree on size, then on dtype; then agree again."""
    comm = _comm()
    seen = []
    for bad in (
        torch.ones(10 + (rank == 1)),  # size differs on rank 1
        torch.ones(10, dtype=torch.float32 if rank != 1 else torch.int32),  # dtype differs
    ):
        try:
            comm.all_reduce(bad)
            seen.append(None)
        except CollectiveMismatch as e:
            seen.append(str(e))
    try:  # a reduce op mismatch
        comm.all_reduce(torch.ones(4), ReduceOp.MAX if rank == 0 else ReduceOp.SUM)
        seen.append(None)
    except CollectiveMismatch as e:
        seen.append(str(e))
    try:  # all_gather's sizes travel as a digest
        comm.all_gather(torch.ones(3 if rank == 1 else 2, 5), 0)
        seen.append(None)
    except CollectiveMismatch as e:
        seen.append(str(e))
    after = comm.all_reduce(torch.ones(3)).tolist()
    comm.destroy()
    return {"errors": seen, "after": after, "rank": rank}


def fallbacks(rank: int, world_size: int) -> dict[str, Any]:
    """Shared memory disabled on one rank, or every rank its own node: gloo, still correct."""
    out = {}
    for label, kw in (
        ("disabled", {"use_shm": rank != 0}),
        ("own_nodes", {"node_id": f"node{rank}"}),
    ):
        comm = _comm(**kw)
        x = torch.arange(6.0) * (rank + 1)
        out[label] = {
            "mode": comm.mode,
            "reason": comm.fallback_reason,
            "sum": comm.all_reduce(x).tolist(),
            "gather": comm.all_gather(torch.tensor([rank]), 0).tolist(),
            "calls": sum(comm.shm_calls.values()),
        }
        comm.destroy()
    return out


def bad_arguments(rank: int, world_size: int) -> list[str]:
    """Bad constructor arguments raise TypeError/ValueError naming the argument."""
    msgs = []
    for kw in (
        {"workspace_bytes": 0},
        {"workspace_bytes": "big"},
        {"use_shm": "yes"},
        {"timeout": -1},
        {"node_id": 3},
        {"oneshot_bytes": -5},
    ):
        try:
            _comm(**kw)
            msgs.append("no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    os.environ["GROUPCOORD_CPU_SHM_BYTES"] = "lots"
    try:
        _comm(workspace_bytes=None)
        msgs.append("no error")
    except ValueError as e:
        msgs.append(f"ValueError: {e}")
    finally:
        del os.environ["GROUPCOORD_CPU_SHM_BYTES"]
    world, cpu = dist.group.WORLD, torch.device("cpu")
    calls = {
        "group-not-a-group": lambda: CpuCommunicator("world", cpu),
        "device-group-not-a-group": lambda: CpuCommunicator(world, cpu, "world"),
        "device-float": lambda: CpuCommunicator(world, 0.5),
        "device-unknown": lambda: CpuCommunicator(world, "gpu7"),
        "device-gpu": lambda: CpuCommunicator(world, "cuda:0"),
        "name-not-a-str": lambda: CpuCommunicator(world, cpu, None, 42),
    }
    for name in BAD_POSITIONAL:
        try:
            calls[name]()
            msgs.append(f"{name}: no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def timeout_and_close(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 waits for a peer that never comes (timeout), then for one that left (destroy)."""
    out: dict[str, Any] = {}
    comm = _comm(timeout=0.6)
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
        except CollectiveTimeout as e:
            out["timeout"] = (time.monotonic() - t0, str(e), isinstance(e, TimeoutError))
        try:
            comm.all_reduce(torch.ones(4))
        except Exception as e:  # the engine is now unusable
            out["after_timeout"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    comm.destroy()
    comm2 = _comm()
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm2.all_reduce(torch.ones(4))
        except PeerDiedError as e:
            out["closed"] = (time.monotonic() - t0, str(e))
    else:
        time.sleep(0.2)
        comm2.destroy()
    dist.barrier()
    comm2.destroy()
    return out


def killed_peer(rank: int, world_size: int, victim: int) -> dict[str, Any]:
    """``victim`` SIGKILLs itself while the others wait in an all_reduce."""
    comm = _comm()
    for _ in range(20):
        comm.all_reduce(torch.ones(16))
    if rank == victim:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16))
        return {"error": None}
    except PeerDiedError as e:
        return {"error": str(e), "elapsed": time.monotonic() - t0}
    finally:
        comm.destroy()


def hierarchical(
    rank: int, world_size: int, layouts: list[list[str] | None]
) -> list[dict[str, Any]]:
    """All-reduce cases through hierarchical communicators (env or ``node_id`` layouts)."""
    out = []
    for layout in layouts:
        comm = _comm(node_id=None if layout is None else layout[rank], oneshot_bytes=2048)
        res = []
        idx = 0
        for dtype in FLOATS + INTS:
            ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN) if dtype in FLOATS else (
                ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR)
            for op in ops:
                for shape in ((1,), (7, 3), (20011,)):
                    case = Case(idx, "all_reduce", dtype, shape, op=op)
                    idx += 1
                    res.append(comm.all_reduce(make_input(case, rank), op))
        hier = comm.hierarchical
        out.append({
            "mode": comm.mode,
            "nodes": comm.nodes,
            "results": res,
            "hier_calls": hier.calls if hier else 0,
            "intra_shm": hier.intra_node_shm_steps if hier else 0,
            "engine": comm._engine is not None,
            "other_op": comm.all_gather(torch.tensor([rank]), 0).tolist(),
        })
        comm.destroy()
    return out


def default_device_rank(rank: int, world_size: int) -> list[str]:
    """Every collective on CPU tensors, called twice (the second time on its fast path)
    inside ``with torch.device("meta")``: CPU results with the right values."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="default-dev")
    bad: list[str] = []
    x = torch.arange(4.0 * world_size * 6).view(4 * world_size, 6) + rank  # CPU, made outside
    rows = [torch.ones(2, 3) * rank, torch.full((2,), rank, dtype=torch.int32)]
    counts = [4 * world_size - (world_size - 1)] + [1] * (world_size - 1)
    total = sum(x.clone() - rank + r for r in range(world_size))
    try:
        for _ in range(2):
            with torch.device("meta"):
                got = {
                    "all_reduce": comm.all_reduce(x),
                    "all_gather": comm.all_gather(x, 0),
                    "reduce_scatter": comm.reduce_scatter(x, 0),
                    "reduce_scatterv": comm.reduce_scatterv(x, 0, counts),
                    "gather": comm.gather(x, 0, 0),
                    "broadcast": comm.broadcast(x.clone(), 0),
                    "all_gatherv_rows": comm.all_gatherv_rows(rows, None)[0][0],
                }
            want = {
                "all_reduce": total,
                "all_gather": torch.cat([x - rank + r for r in range(world_size)]),
                "reduce_scatter": total.chunk(world_size)[rank],
                "reduce_scatterv": total.split(counts)[rank],
                "gather": torch.cat([x - rank + r for r in range(world_size)]) if rank == 0
                else None,
                "broadcast": x - rank,
                "all_gatherv_rows": torch.cat([torch.ones(2, 3) * r for r in range(world_size)]),
            }
            for op, value in got.items():
                if want[op] is None:
                    if value is not None:
                        bad.append(f"{op}: a result off the root")
                elif value.device.type != "cpu" or not torch.equal(value, want[op]):
                    bad.append(f"{op}: {value.device} {value.flatten()[:3].tolist()}")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_ignore_the_default_device(dist_pool, world_size: int) -> None:
    for rank, bad in enumerate(dist_pool(world_size).run(default_device_rank, timeout=50)):
        assert bad == [], f"rank {rank}: {bad}"
