"""Functions run on the ranks by the CpuCommunicator tests (module-level, importable).

Each is called as ``fn(rank, world_size, *args)`` with torch.distributed (gloo)
initialised. They return plain data to the parent, which does the checking.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from device_comms import CollectiveMismatch, CollectiveTimeout, CpuCommunicator, PeerDiedError, ReduceOp
from shm_broadcast.segment import list_segments
from tests.device_comms._cpu_cases import build_cases, run_case

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
    after = comm.all_reduce(torch.ones(3)).tolist()
    comm.destroy()
    return {"errors": seen, "after": after}


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


def hierarchical(rank: int, world_size: int, layouts: list[list[str] | None]) -> list[dict[str, Any]]:
    """All-reduce cases through hierarchical communicators (env or ``node_id`` layouts)."""
    from tests.device_comms._cpu_cases import FLOATS, INTS, Case, make_input

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
