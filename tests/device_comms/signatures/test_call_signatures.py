"""No silent wrong results: every op's call signature reaches every rank.

For each op on the plain gloo path (world sizes 2, 3, 4), the hierarchical
path (3 and 4 ranks on two simulated nodes) and the one-node shared-memory
path (2, 3, 4; its gloo-routed ops: scatter, all_to_all, send/recv), one
fault per case:

* ``reject-first`` / ``reject-middle`` / ``reject-last``: that rank passes an
  argument only it can see is wrong; it raises TypeError/ValueError, every
  other rank PeerRejectedError naming it;
* ``skip``: that rank skips the call; its next call (another op) pairs with
  the peers' call and every rank raises CollectiveMismatch naming it;
* ``dtype`` / ``shape`` / ``op`` / ``root``: that rank's call differs; every
  rank raises CollectiveMismatch naming the op and that rank.

After the fault every rank makes a good call, which must return the right
answer (the group stays usable). The full matrix is ``slow``; CI runs a
selection covering every op, fault, path and world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import (
    CollectiveMismatch,
    CpuCommunicator,
    DeviceCommunicator,
    PeerRejectedError,
    ReduceOp,
    TorchDistributedCommunicator,
)

OPS = (
    "all_reduce", "reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
    "gather", "broadcast", "scatter", "all_to_all", "send_recv",
)
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatterv")
ROOTED = ("reduce", "gather", "broadcast", "scatter")
FAULTS = ("reject-first", "reject-middle", "reject-last", "skip", "dtype", "shape", "op", "root")
PATHS = {"gloo": (2, 3, 4), "hierarchical": (3, 4), "shm": (2, 3, 4)}


def _applies(op: str, fault: str, world_size: int) -> bool:
    if fault == "op":
        return op in REDUCTIONS
    if fault == "root":
        return op in ROOTED
    if fault == "dtype":
        return op != "scatter"  # receivers of a scatter take the source's dtype
    if op == "send_recv" and fault == "reject-middle":
        return world_size == 2  # only the first and last ranks take part
    return True


def _cases(full: bool) -> list[Any]:
    out = []
    for path, sizes in PATHS.items():
        for n in sizes:
            for op in OPS:
                for fault in FAULTS:
                    if not _applies(op, fault, n):
                        continue
                    ci = _in_ci(path, n, op, fault)
                    if full or ci:
                        marks = [] if ci else [pytest.mark.slow]
                        out.append(pytest.param(path, n, op, fault, id=f"{path}-ws{n}-{op}-{fault}",
                                                marks=marks))
    return out


_CI_EXTRA = {  # faults the rule below leaves out on some path
    ("gloo", 2, "all_reduce", "op"), ("gloo", 3, "reduce_scatter", "op"),
    ("hierarchical", 4, "all_reduce", "op"), ("hierarchical", 3, "all_reduce", "skip"),
    ("hierarchical", 4, "all_reduce", "dtype"), ("hierarchical", 3, "broadcast", "root"),
}


def _in_ci(path: str, n: int, op: str, fault: str) -> bool:
    """A selection that covers every op, every fault, both paths and all world sizes."""
    if (path, n, op, fault) in _CI_EXTRA:
        return True
    i, j = OPS.index(op), FAULTS.index(fault)
    if path == "gloo":
        return (i + j) % 6 == n % 6 and n in (2, 3) or (n == 4 and (i * 3 + j) % 19 == 0)
    if path == "shm":  # already signed before this work: gloo-routed ops and a few others
        return op in ("scatter", "all_to_all", "send_recv") and (i + j + n) % 5 == 0
    return (i + 2 * j) % 11 == n


def _culprit(fault: str, n: int, op: str) -> int:
    r = {"reject-first": 0, "reject-middle": n // 2, "skip": 0, "shape": n // 2}.get(fault, n - 1)
    return n - 1 if op == "send_recv" and r != 0 else r  # only ranks 0 and n-1 take part


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,world_size,op,fault", _cases(full=True))
def test_fault_is_seen_by_every_rank(dist_pool, path: str, world_size: int, op: str,
                                     fault: str) -> None:
    outs = dist_pool(world_size).run(run_case, path, op, fault, timeout=45)
    culprit = _culprit(fault, world_size, op)
    involved = _involved(op, world_size)
    total = float(world_size * (world_size + 1) // 2)
    for rank, out in enumerate(outs):
        where = f"rank {rank} ({path}, {op}, {fault}, culprit {culprit})"
        assert out["mode"] == path, where
        assert out["good"] == [total] * 3, f"{where}: the next call gave {out['good']}"
        if op == "send_recv":
            assert out["p2p_good"] is None or out["p2p_good"] == [7.0, 7.0], where
        if rank not in involved:
            continue
        kind, msg, named = out["outcome"]
        assert out["elapsed"] < 10.0, f"{where}: took {out['elapsed']:.1f}s"
        if fault.startswith("reject"):
            if rank == culprit:
                assert kind in ("TypeError", "ValueError"), f"{where}: {kind}: {msg}"
            else:
                assert kind == "PeerRejectedError", f"{where}: {kind}: {msg}"
                assert named == [culprit] and f"rank {culprit}" in msg, f"{where}: {msg}"
        else:
            assert kind == "CollectiveMismatch", f"{where}: {kind}: {msg}"
            assert f"rank {culprit}" in msg or f"{culprit}]" in msg, f"{where}: {msg}"
        if not (fault.startswith("reject") and rank == culprit):  # its own argument error
            names = ("send", "recv") if op == "send_recv" else (op,)
            assert any(f"op {x}" in msg or f"{x}(" in msg or f"({x}," in msg
                       for x in names), f"{where}: {msg}"


def _involved(op: str, n: int) -> set[int]:
    return {0, n - 1} if op == "send_recv" else set(range(n))


# ---------------------------------------------------------------------- on the ranks
def _comm(path: str, rank: int, world_size: int) -> DeviceCommunicator:
    world, cpu = dist.group.WORLD, torch.device("cpu")
    if path == "gloo":
        return TorchDistributedCommunicator(world, cpu, unique_name="sig-gloo")
    if path == "shm":
        return CpuCommunicator(world, cpu, unique_name="sig-shm", workspace_bytes=1 << 16)
    node = "a" if rank < (world_size + 1) // 2 else "b"  # 3: a a b, 4: a a b b
    return CpuCommunicator(world, cpu, unique_name="sig-hier", node_id=node,
                           workspace_bytes=1 << 16)


def _x(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) + rank).to(dtype)


def _call(comm: DeviceCommunicator, op: str, rank: int, n: int, bad: str | None) -> Any:
    """``op`` as every rank makes it; ``bad`` names this rank's fault (None: a good call)."""
    dt = torch.float64 if bad == "dtype" else torch.float32
    rop = ReduceOp.MAX if bad == "op" else ReduceOp.SUM
    root = 1 if bad == "root" else 0
    wrong = bad == "shape"
    if bad is not None and bad.startswith("reject"):
        return _rejected(comm, op, rank, n)
    if op == "all_reduce":
        return comm.all_reduce(_x(rank, (4, 3 if wrong else 2), dt), rop)
    if op == "reduce":
        return comm.reduce(_x(rank, (5 if wrong else 4,), dt), root, rop)
    if op == "all_gather":
        return comm.all_gather(_x(rank, (2, 4 if wrong else 3), dt), 0)
    if op == "all_gatherv":
        sizes = [r + 1 for r in range(n)]
        if wrong:  # its own entry still matches its input: only the lists differ
            sizes = [s + (0 if r == rank else 1) for r, s in enumerate(sizes)]
        return comm.all_gatherv(_x(rank, (sizes[rank], 3), dt), 0, sizes)
    if op == "reduce_scatter":
        return comm.reduce_scatter(_x(rank, (2 * n, 5 if wrong else 3), dt), 0, rop)
    if op == "reduce_scatterv":
        sizes = [r + 1 for r in range(n)]
        if wrong:  # same total, different split
            sizes = sizes[::-1]
        return comm.reduce_scatterv(_x(rank, (sum(sizes), 3), dt), 0, sizes, rop)
    if op == "gather":
        return comm.gather(_x(rank, (3 if wrong else 2, 2), dt), root, 0)
    if op == "broadcast":
        return comm.broadcast(_x(rank, (6 if wrong else 5,), dt), root)
    if op == "scatter":
        src_t = _x(rank, (2 * n, 2 * n), dt) if rank == root else None
        return comm.scatter(src_t, root, 1 if wrong else 0)
    if op == "all_to_all":
        return comm.all_to_all(_x(rank, (2 * n, 4 if wrong else 3), dt), 0, 0)
    if op == "send_recv":
        if rank == 0:
            return comm.send(_x(rank, (5 if wrong else 4,), dt), n - 1)
        if rank == n - 1:
            return comm.recv((5 if wrong else 4,), dt, 0)
        return None
    raise AssertionError(op)


def _rejected(comm: DeviceCommunicator, op: str, rank: int, n: int) -> Any:
    """An argument only this rank can see is wrong (its peers' calls are valid)."""
    if op == "all_gatherv":
        sizes = [r + 1 for r in range(n)]
        return comm.all_gatherv(_x(rank, (sizes[rank] + 1, 3)), 0, sizes)
    if op == "reduce_scatterv":
        return comm.reduce_scatterv(_x(rank, (n * (n + 1) // 2 + 1, 3)), 0,
                                    [r + 1 for r in range(n)])
    if op == "broadcast":
        return comm.broadcast(_x(rank, (5, 2)).t(), 0)  # not contiguous
    if op == "scatter":
        return comm.scatter(_x(rank, (2 * n, 2 * n)) if rank == 0 else None, 0, "0")  # type: ignore[arg-type]
    if op == "send_recv":
        if rank == 0:
            return comm.send([1.0, 2.0], n - 1)  # type: ignore[arg-type]
        return comm.recv((4,), "float32", 0)  # type: ignore[arg-type]
    bad: Callable[..., Any] = getattr(comm, op)
    if op in ("all_reduce", "reduce"):
        return bad([1.0, 2.0])
    return bad(torch.ones(2, 3).to_sparse(), 0) if op == "gather" else bad([1.0], 0)


def _follow_up(comm: DeviceCommunicator, op: str, rank: int, n: int) -> Any:
    """What a rank that skipped ``op`` calls next (differs from every op's call)."""
    if op == "send_recv":
        if rank == 0:
            return comm.send(torch.ones(3, dtype=torch.int64), n - 1)
        return comm.recv((3,), torch.int64, 0)
    return comm.all_reduce(torch.ones(7, dtype=torch.int16))


def run_case(rank: int, world_size: int, path: str, op: str, fault: str) -> dict[str, Any]:
    """Make ``op`` with ``fault`` on the culprit, then good calls; report what each did."""
    comm = _comm(path, rank, world_size)
    culprit = _culprit(fault, world_size, op)
    mine = fault if rank == culprit else None
    t0 = time.monotonic()
    outcome: tuple[str, str, Any] = ("ok", "", None)
    try:
        if mine == "skip":
            _follow_up(comm, op, rank, world_size)
        else:
            _call(comm, op, rank, world_size, mine)
    except PeerRejectedError as e:
        outcome = ("PeerRejectedError", str(e), [e.rank])
    except CollectiveMismatch as e:
        outcome = ("CollectiveMismatch", str(e), list(e.peers))
    except (TypeError, ValueError) as e:
        outcome = (type(e).__name__, str(e), None)
    elapsed = time.monotonic() - t0
    p2p_good = None
    if op == "send_recv" and rank in (0, world_size - 1):  # the pair still works
        if rank == 0:
            comm.send(torch.full((2,), 7.0), world_size - 1)
        else:
            p2p_good = comm.recv((2,), torch.float32, 0).tolist()
    good = comm.all_reduce(torch.full((3,), float(rank + 1), dtype=torch.float64)).tolist()
    mode = getattr(comm, "mode", "gloo")
    comm.destroy()
    return {"outcome": outcome, "elapsed": elapsed, "good": good, "p2p_good": p2p_good,
            "mode": mode}


# ---------------------------------------------------------------------- beyond the matrix
@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,world_size", [("shm", 2), ("shm", 3), ("hierarchical", 3),
                                             ("hierarchical", 4)])
def test_a_barrier_meets_another_collective(dist_pool, path: str, world_size: int) -> None:
    """The last rank enters a barrier, the others an all_reduce. Its barrier step
    was unsigned: on one node that rank passed the barrier alone (the others
    raised), on several nodes every rank waited until the timeout."""
    for rank, out in enumerate(dist_pool(world_size).run(barrier_meets_all_reduce, path,
                                                         timeout=45)):
        assert out["mode"] == path
        assert out["outcome"] == "CollectiveMismatch", (rank, out)
        assert "barrier" in out["message"] and out["elapsed"] < 10.0, (rank, out)
        assert out["good"] == [float(world_size)] and out["barrier"] == "ok", (rank, out)


def barrier_meets_all_reduce(rank: int, world_size: int, path: str) -> dict[str, Any]:
    comm = _comm(path, rank, world_size)
    t0 = time.monotonic()
    out: dict[str, Any] = {"outcome": "returned", "message": "", "mode": comm.mode}
    try:
        if rank == world_size - 1:
            comm.barrier()
        else:
            comm.all_reduce(torch.ones(4))
    except CollectiveMismatch as e:
        out["outcome"], out["message"] = type(e).__name__, str(e)
    out["elapsed"] = time.monotonic() - t0
    out["good"] = comm.all_reduce(torch.ones(1)).tolist()
    comm.barrier()
    out["barrier"] = "ok"
    comm.destroy()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_large_calls_agree_first_then_run_gloo(dist_pool, world_size: int) -> None:
    """Payloads above a block: headers first, then the gloo op; mismatches still caught."""
    outs = dist_pool(world_size).run(large_calls, timeout=75)
    n = world_size
    for rank, out in enumerate(outs):
        for op, ok in out["results"].items():
            assert ok, f"rank {rank}: {op} gave a wrong result"
        for op, (kind, msg) in out["mismatch"].items():
            assert kind == "CollectiveMismatch", (rank, op, kind, msg)
            assert f"rank {n - 1}" in msg or f"[{n - 1}]" in msg, (rank, op, msg)
        assert out["after"] == [float(n)] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_rejected_rank_that_continues_does_not_pair_with_its_peers_call(
        dist_pool, world_size: int) -> None:
    """The rank whose all_reduce is rejected goes on to its next all_reduce; before
    signatures its peers' first all_reduce silently returned the sum of its second."""
    outs = dist_pool(world_size).run(reject_then_continue, timeout=45)
    n = world_size
    for rank, out in enumerate(outs):
        first, second = out
        assert first[0] == ("TypeError" if rank == 0 else "PeerRejectedError"), (rank, first)
        assert second == [float(n)] * 4, (rank, second)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_node_gloo_routed_op_meets_shared_memory_op(dist_pool, world_size: int) -> None:
    """One node: a rank in scatter/all_to_all (gloo) and ranks in a shared-memory op raise."""
    outs = dist_pool(world_size).run(cross_transport, timeout=45)
    for rank, out in enumerate(outs):
        assert out["mode"] == "shm"
        for label, (kind, msg) in out["cases"].items():
            assert kind == "CollectiveMismatch", (rank, label, kind, msg)
            assert f"rank {world_size - 1}" in msg, (rank, label, msg)
        assert out["after"] == [float(world_size)] * 2


def large_calls(rank: int, world_size: int) -> dict[str, Any]:
    from device_comms.signatures.envelopes import BLOCK_INLINE

    n = world_size
    comm = TorchDistributedCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="big")
    rows = BLOCK_INLINE // 4  # float32 rows of 1 element: one block's worth per rank
    xs = [_x(r, (2 * n * rows, 3)) for r in range(n)]
    x = xs[rank]
    total = sum(xs)
    res: dict[str, bool] = {}
    res["all_reduce"] = torch.equal(comm.all_reduce(x), total)
    red = comm.reduce(x, n - 1)
    res["reduce"] = torch.equal(red, total) if rank == n - 1 else red is None
    res["all_gather"] = torch.equal(comm.all_gather(x, 1), torch.cat(xs, 1))
    sizes = [rows * (r + 1) for r in range(n)]
    piece = _x(rank, (sizes[rank], 3))
    res["all_gatherv"] = torch.equal(comm.all_gatherv(piece, 0, sizes),
                                     torch.cat([_x(r, (sizes[r], 3)) for r in range(n)]))
    m = x.shape[0] // n
    res["reduce_scatter"] = torch.equal(comm.reduce_scatter(x, 0), total[rank * m:(rank + 1) * m])
    vs = [rows * (r + 1) for r in range(n)]
    vx = [_x(r, (sum(vs), 3)) for r in range(n)]
    off = sum(vs[:rank])
    res["reduce_scatterv"] = torch.equal(comm.reduce_scatterv(vx[rank], 0, vs),
                                         sum(vx)[off:off + vs[rank]])
    g = comm.gather(x, 0, 0)
    res["gather"] = torch.equal(g, torch.cat(xs)) if rank == 0 else g is None
    b = x.clone() if rank == 1 else torch.zeros_like(x)
    res["broadcast"] = torch.equal(comm.broadcast(b, 1), xs[1])
    sc = comm.scatter(xs[0] if rank == 0 else None, 0, 0)
    res["scatter"] = torch.equal(sc, xs[0][rank * m:(rank + 1) * m])
    a2a = comm.all_to_all(x, 0, 1)
    res["all_to_all"] = torch.equal(
        a2a, torch.cat([xs[r][rank * m:(rank + 1) * m] for r in range(n)], 1))
    big = _x(0, (70000,))  # above a point-to-point envelope too
    if rank == 0:
        comm.send(big, n - 1)
    elif rank == n - 1:
        res["send_recv"] = torch.equal(comm.recv((70000,), torch.float32, 0), big)
    mismatch: dict[str, tuple[str, str]] = {}
    wrong = rank == n - 1
    for op, call in (
        ("all_reduce", lambda: comm.all_reduce(_x(rank, (2 * n * rows, 4 if wrong else 3)))),
        ("all_gather", lambda: comm.all_gather(x.double() if wrong else x, 0)),
        ("scatter", lambda: comm.scatter(xs[0] if rank == 0 else None, 0, 1 if wrong else 0)),
    ):
        try:
            call()
            mismatch[op] = ("ok", "")
        except CollectiveMismatch as e:
            mismatch[op] = (type(e).__name__, str(e))
    if rank in (0, n - 1):  # a large send against a receiver expecting another shape
        try:
            if rank == 0:
                comm.send(big, n - 1)
            else:
                comm.recv((69999,), torch.float32, 0)
            mismatch["send_recv"] = ("ok", "")
        except CollectiveMismatch as e:
            mismatch["send_recv"] = (type(e).__name__, str(e))
    after = comm.all_reduce(torch.ones(3)).tolist()
    comm.destroy()
    return {"results": res, "mismatch": mismatch, "after": after}


def reject_then_continue(rank: int, world_size: int) -> list[Any]:
    comm = TorchDistributedCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="rtc")
    out: list[Any] = []
    try:
        t = [1.0] * 4 if rank == 0 else torch.full((4,), 100.0)
        out.append(("returned", comm.all_reduce(t).tolist()))  # type: ignore[arg-type]
    except PeerRejectedError as e:
        out.append(("PeerRejectedError", e.rank))
    except TypeError as e:
        out.append(("TypeError", str(e)))
    out.append(comm.all_reduce(torch.ones(4)).tolist())
    comm.destroy()
    return out


def cross_transport(rank: int, world_size: int) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="xt",
                           workspace_bytes=1 << 16)
    odd = rank == world_size - 1
    cases: dict[str, tuple[str, str]] = {}
    n = world_size
    for label, gloo_op in (
        ("scatter", lambda: comm.scatter(torch.ones(n, 2) if rank == 0 else None, 0, 0)),
        ("all_to_all", lambda: comm.all_to_all(torch.ones(n, 2), 0, 0)),
    ):
        try:
            if odd:
                gloo_op()
            else:
                comm.all_reduce(torch.ones(n, 2))
            cases[label] = ("ok", "")
        except CollectiveMismatch as e:
            cases[label] = (type(e).__name__, str(e))
    after = comm.all_reduce(torch.ones(2)).tolist()
    mode = comm.mode
    comm.destroy()
    return {"cases": cases, "after": after, "mode": mode}


_LAYOUTS = ["sparse_coo", "sparse_csr", "meta", "quantised", "nested"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,world_size", [("gloo", 2), ("gloo", 3), ("hierarchical", 3)])
@pytest.mark.parametrize("kind", _LAYOUTS)
def test_bad_layout_is_refused_before_communicating(dist_pool, path: str, world_size: int,
                                                    kind: str) -> None:
    """A sparse/meta/quantised/nested tensor on the last rank: refused there, announced."""
    outs = dist_pool(world_size).run(bad_layout, path, kind, timeout=45)
    culprit = world_size - 1
    for rank, out in enumerate(outs):
        for op, (what, msg) in out["calls"].items():
            if rank == culprit:
                assert what in ("TypeError", "ValueError") and "input_" in msg, (rank, op, msg)
            else:
                assert what == "PeerRejectedError" and f"rank {culprit}" in msg, (rank, op, msg)
        assert out["after"] == [float(world_size)] * 2


def _bad(kind: str) -> Any:
    import warnings

    warnings.simplefilter("ignore")  # beta warnings of sparse CSR / nested / quantised
    if kind == "sparse_coo":
        return torch.ones(8).to_sparse()
    if kind == "sparse_csr":
        return torch.ones(2, 4).to_sparse_csr()
    if kind == "meta":
        return torch.empty(8, device="meta")
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(5)])
    return torch.quantize_per_tensor(torch.ones(8), 0.1, 0, torch.qint8)


def bad_layout(rank: int, world_size: int, path: str, kind: str) -> dict[str, Any]:
    comm = _comm(path, rank, world_size)
    culprit = rank == world_size - 1
    calls: dict[str, tuple[str, str]] = {}
    for op in ("all_reduce", "all_gather", "broadcast"):
        x = _bad(kind) if culprit else torch.ones(8)
        try:
            if op == "all_reduce":
                comm.all_reduce(x)
            elif op == "all_gather":
                comm.all_gather(x, 0)
            else:
                comm.broadcast(x, 0)
            calls[op] = ("ok", "")
        except PeerRejectedError as e:
            calls[op] = ("PeerRejectedError", str(e))
        except (TypeError, ValueError) as e:
            calls[op] = (type(e).__name__, str(e))
    after = comm.all_reduce(torch.ones(2)).tolist()
    comm.destroy()
    return {"calls": calls, "after": after}


# ---------------------------------------------------------------------- group ids
def test_group_id_ignores_the_process_counter() -> None:
    from device_comms.signatures.call_signature import group_id

    assert group_id("tp:0") == group_id("tp:7") == group_id("tp")
    assert group_id("tp:0") != group_id("pp:0")
    assert group_id("sig-gloo") != group_id("sig-shm")
    assert group_id("a:b") != group_id("a")  # only a numeric counter is left out


def counters_differ(rank: int, world_size: int, shm: bool) -> tuple[str, list[float]]:
    """Rank 1 made more groups before (a process that re-created its groups, next to
    a fresh replacement rank): the same group has another ``ctr:<n>`` name on each
    rank, and its signed calls must still agree."""
    import os

    from coordinator import GroupCoordinator
    from coordinator.group.registry import REGISTRY

    if rank == 1:
        REGISTRY.unique_name("ctr")
        REGISTRY.unique_name("ctr")
    os.environ["GROUPCOORD_CPU_SHM"] = "1" if shm else "0"
    g = GroupCoordinator([list(range(world_size))], rank, "gloo", True, group_name="ctr")
    try:
        out = g.all_reduce(torch.ones(4) * (rank + 1))
        got = g.broadcast_object({"n": 3} if rank == 0 else None, 0)
        return g.unique_name, out.tolist() + [float(got["n"])]
    finally:
        g.destroy()
        os.environ.pop("GROUPCOORD_CPU_SHM", None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_ranks_whose_group_counters_differ_still_agree(dist_pool, shm: bool) -> None:
    (name0, got0), (name1, got1) = dist_pool(2).run(counters_differ, shm, timeout=45)
    assert name0 != name1
    assert got0 == got1 == [3.0] * 4 + [3.0]


# ---------------------------------------------------------------------- whom a mismatch names
def _headers(calls: dict[int, str]) -> dict[int, Any]:
    import numpy as np

    from device_comms.signatures.call_signature import group_id, layout_key, template

    shapes = {"a": (4, 2), "b": (7,), "c": (3,)}
    return {r: template(group_id("tp:0"), "all_reduce", torch.float32, None, 0,
                        layout_key(shapes[c]), shapes[c]).astype(np.int64)
            for r, c in calls.items()}


@pytest.mark.parametrize("calls,named", [
    ({0: "a", 1: "a", 2: "a", 3: "b"}, {r: [3] for r in range(4)}),
    ({0: "b", 1: "a", 2: "a", 3: "a"}, {r: [0] for r in range(4)}),
    ({0: "b", 1: "a"}, {0: [1], 1: [0]}),
    ({0: "a", 1: "a", 2: "b", 3: "b"}, {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}),
    ({0: "a", 1: "b", 2: "c"}, {0: [1, 2], 1: [0, 2], 2: [0, 1]}),
], ids=["minority-last", "minority-first", "tie-of-two", "tie-of-pairs", "three-way"])
def test_a_mismatch_names_the_minority_or_on_a_tie_the_other_side(
        calls: dict[int, str], named: dict[int, list[int]]) -> None:
    """The ranks outside the largest class are named, the same on every rank; on a
    tie every rank names the ranks outside its own class (two ranks that disagree
    cannot tell which one is wrong), never itself."""
    from device_comms.signatures.call_signature import settle

    heads = _headers(calls)
    for me, want in named.items():
        with pytest.raises(CollectiveMismatch) as info:
            settle("tp:0", "all_reduce", me, heads, lambda r: "")
        assert sorted(info.value.peers) == want, (me, str(info.value))


def _split_node(calls: dict[int, str]) -> tuple[Any, list[tuple[int, int, list[int]]]]:
    """The SPLIT header and call list a node leader sends when its ranks ``calls`` disagree
    (the header is the communicator's blank one, as the leader's is)."""
    from device_comms.signatures.call_signature import SPLIT, group_id, template
    from device_comms.signatures.envelopes import failure_header

    heads = _headers(calls)
    by_call: dict[tuple[int, int], list[int]] = {}
    for r, h in heads.items():
        by_call.setdefault((int(h[3]), int(h[4])), []).append(r)
    blank = template(group_id("tp:0"), "all_reduce", None, None, 0, 0, None)
    return failure_header(blank, SPLIT, -1), [(a, b, rs) for (a, b), rs in by_call.items()]


@pytest.mark.parametrize("nodes,named", [
    # two hosts of two ranks; host 0's leader skipped (a 1-1 tie on its host)
    ([{0: "b", 1: "a"}, {2: "a", 3: "a"}], {2: [0]}),
    # the non-leader skipped instead
    ([{0: "a", 1: "b"}, {2: "a", 3: "a"}], {2: [1]}),
    # a 2-2 tie at rank level: each leader names the ranks outside its own class
    ([{0: "b", 1: "a"}, {2: "a"}, {3: "b"}], {2: [0, 3], 3: [1, 2]}),
    # three hosts, one split 2-1 inside
    ([{0: "a", 1: "c", 2: "a"}, {3: "a", 4: "a"}, {5: "a"}], {3: [1], 5: [1]}),
    # no split, hosts of unequal size: ranks are counted, not hosts
    ([{0: "b", 1: "b", 2: "b"}, {3: "a"}, {4: "a"}], {0: [3, 4], 3: [3, 4], 4: [3, 4]}),
], ids=["leader-skipped", "member-skipped", "tie-of-ranks", "three-hosts", "uneven-hosts"])
def test_split_nodes_are_settled_by_counting_ranks(nodes: list[dict[int, str]],
                                                   named: dict[int, list[int]]) -> None:
    """Leaders count ranks; a leader whose node's ranks disagree sends every local call
    (SPLIT), so the rank outside the largest class is named even where its own node saw
    a 1-1 tie. The split node's leader settles nothing (its ranks raised locally)."""
    from device_comms.signatures.call_signature import decode_calls, encode_calls, settle

    heads, calls, members = {}, {}, {}
    for node in nodes:
        leader = min(node)
        members[leader] = sorted(node)
        if len(set(node.values())) > 1:
            heads[leader], calls[leader] = _split_node(node)
        else:
            heads[leader] = _headers({leader: node[leader]})[leader]
    raw = {r: encode_calls(c) for r, c in calls.items()}
    for me in heads:
        args = ("tp:0", "all_reduce", me, heads, lambda r: "", members.__getitem__,
                lambda r: decode_calls(raw[r], r, members[r], "tp:0"))
        if me in calls:
            assert settle(*args) is True  # its own ranks already raised
            continue
        with pytest.raises(CollectiveMismatch) as info:
            settle(*args)
        text = str(info.value)
        assert sorted(info.value.peers) == named[me], text
        assert "same shape, different layout" not in text, text
        if named[me] == [0] or named[me] == [1]:  # the majority's shape is spelled out
            assert f"rank {named[me][0]} called all_reduce" in text, text
            assert "but ranks [" in text and "shape=(4, 2)" in text.split("but ranks")[1], text


@pytest.mark.parametrize("calls,why", [
    (b"", "does not decode"),
    (b"\x91\x01", "does not decode"),
    (b"\xc1", "does not decode"),
    ([(1, 2, [0]), (1, 3, [0])], "names ranks"),          # rank 0 twice, rank 1 missing
    ([(1, 2, [0]), (1, 3, [1, 7])], "names ranks"),       # a rank of another node
    ([(1, 2, [0, 1])], "different calls"),                # one call is no split
    ([(1, 2, [0]), (1, 2, [1])], "different calls"),      # the same call twice
    ([(1 << 63, 2, [0]), (1, 3, [1])], "outside int64"),  # decodes (uint64), fits no word
], ids=["empty", "wrong-shape", "not-msgpack", "rank-twice", "foreign-rank", "one-call",
        "same-call-twice", "too-large"])
def test_a_split_call_list_that_is_not_valid_is_refused(calls: Any, why: str) -> None:
    from device_comms.errors import DecodeError
    from device_comms.signatures.call_signature import decode_calls, encode_calls

    raw = calls if isinstance(calls, bytes) else encode_calls(calls)
    with pytest.raises(DecodeError, match=f"rank 2 sent a split-call list that .*{why}"):
        decode_calls(raw, 2, [0, 1], "tp:0")
    assert decode_calls(encode_calls([(1, 2, [1]), (1, 3, [0])]), 2, [0, 1], "tp:0") == [
        (1, 2, [1]), (1, 3, [0])]


def test_a_split_header_where_no_participant_speaks_for_others_is_refused() -> None:
    """The flat signed path passes no call lists: a SPLIT header there is not ours."""
    from device_comms.errors import DecodeError
    from device_comms.signatures.call_signature import settle

    heads = _headers({0: "a", 1: "a"})
    heads[1], _ = _split_node({1: "a", 2: "b"})
    with pytest.raises(DecodeError, match="rank 1 sent a SPLIT header"):
        settle("tp:0", "all_reduce", 0, heads, lambda r: "")


def test_layout_keys_are_the_same_in_every_process() -> None:
    """Ranks compare these keys, and ranks are often separate interpreters (spawned,
    or on other hosts): ``hash(None)`` is an address before Python 3.12, so a
    barrier signed with layout None mismatched between spawned ranks."""
    import subprocess
    import sys

    from device_comms.signatures.call_signature import layout_key
    from tests.child_env import child_env

    layouts = "[None, (), (2, 3), ((2, 3), 1), ((4,), 3, 0, True), ((1, 2), (3,), 0)]"
    code = ("from device_comms.signatures.call_signature import layout_key\n"
            f"print([layout_key(x) for x in {layouts}])")
    mine = [layout_key(x) for x in eval(layouts)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=child_env(), check=True).stdout
    assert eval(out) == mine, (out, mine)
