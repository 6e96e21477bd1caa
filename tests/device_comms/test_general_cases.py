"""General shapes, dtypes, world sizes and error paths of the device communicators.

One multi-process run per world size covers every op through the shared-memory
CpuCommunicator and through plain gloo (TorchDistributedCommunicator) against
a fixed-order reference, then the error paths: disagreements the element count
does not reveal, a rank whose own arguments are rejected while its peers wait,
use after destroy, and create/destroy cycles (no leaked segments or fds).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator.testing import run_distributed
from device_comms import CpuCommunicator, ReduceOp, TorchDistributedCommunicator
from device_comms.errors import BrokenCommunicator
from shm_broadcast.lifecycle.segment import list_segments
from tests.device_comms import general_cases


def _same(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is b
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _close(a: object, b: object) -> bool:
    """gloo sums in its own order: exact for ints, close for floats."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return _same(a, b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.allclose(a.to(torch.complex128), b.to(torch.complex128), rtol=0.05, atol=0.1)
    return torch.equal(a, b)


def test_broken_communicator_import_paths() -> None:
    from device_comms import BrokenCommunicator as top
    from device_comms.cpu_shm.sync import BrokenCommunicator as old

    assert top is old is BrokenCommunicator


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_general_cases(dist_pool, world_size: int) -> None:
    n = world_size
    outs = dist_pool(n).run(general, timeout=140)
    cases = general_cases.cases(n)
    failures = []
    for c in cases:
        wants = [general_cases.expected(c, n, r) for r in range(n)]
        for key, cmp in (("shm", _same), ("gloo", _close)):
            got = [o[key][c[0]] for o in outs]
            for r, want in enumerate(wants):
                if not cmp(got[r], want):
                    failures.append(f"{key} {c[:5]} {c[5]} rank {r}")
            same_everywhere = c[1] in ("all_reduce", "all_gather", "all_gatherv", "broadcast")
            if same_everywhere and not all(_same(g, got[0]) for g in got):
                failures.append(f"{key} ranks disagree on {c[:5]}")
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert outs[0]["sizes_differ_gloo"][0] == "CollectiveMismatch"
    # Rank 0's sizes list is the odd one: the headers name it, on every rank.
    assert "rank 0 called all_gatherv" in outs[0]["sizes_differ_gloo"][1]
    assert "sizes" in outs[0]["sizes_differ_gloo"][1]
    for o in outs:
        assert o["mode"] == "shm"
        for name, msg, _ in o["complex"]:
            assert name == "TypeError" and "complex" in msg, (name, msg)
        for name, msg, elapsed in o["mismatch"]:
            assert name == "CollectiveMismatch", (name, msg)
            assert elapsed < 5.0
        assert o["after_mismatch"] == [float(n)] * 3
        for label in ("shm", "gloo"):
            name, msg, elapsed = o[f"sizes_differ_{label}"]
            # Both compare every rank's sizes (shm: step signatures, gloo: call headers).
            assert name == "CollectiveMismatch" and elapsed < 5.0, (label, name, msg)
            assert "rank 0 called" in msg, (label, msg)
            want = [[float(r)] * 2 for r in range(n) if r % 2]
            assert o[f"after_sizes_{label}"] == want
        for name, msg, _ in o["closed"]:
            assert name == "ClosedError" and "destroyed" in msg, (name, msg)


@pytest.mark.timeout(90)
def test_two_groups_and_create_destroy_cycles() -> None:
    n = 2
    outs = run_distributed(lifecycle, n, timeout=80)
    for rank, o in enumerate(outs):
        for i, (ar, ag, bc, rsv) in enumerate(o["inter"]):
            dt = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
            xs = [torch.full((i + 1, 3), r + 1, dtype=dt) for r in range(n)]
            assert _same(ar, xs[0] + xs[1])
            assert _same(ag, torch.cat(xs, 0))
            assert _same(bc, xs[i % n])
            want = torch.full((i + 1 if rank == 0 else 0,), n, dtype=dt)
            assert _same(rsv, want)
        fds0, fds1 = o["fds"]
        assert fds1 <= fds0, f"file descriptors leaked: {fds0} -> {fds1}"
        assert o["segs"] == [], o["segs"]


# ---------------------------------------------------------------------- on the ranks
SMALL_WS = 64 << 10  # slots of a few KiB: "large" inputs go through in pieces


def _group() -> Any:
    return dist.new_group(timeout=datetime.timedelta(seconds=20), backend="gloo")


def _attempt(fn: Any) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e), time.monotonic() - t0)


def general(rank: int, n: int) -> dict[str, Any]:
    """Every case through shared memory and through plain gloo, plus error paths."""
    pg = _group()
    out: dict[str, Any] = {}
    shm = CpuCommunicator(pg, torch.device("cpu"), unique_name="gen", workspace_bytes=SMALL_WS,
                          timeout=20)
    gloo = TorchDistributedCommunicator(pg, torch.device("cpu"), unique_name="gen-gloo")
    out["mode"] = shm.mode
    out["shm"] = [general_cases.run_case(shm, c, rank, n) for c in general_cases.cases(n)]
    out["gloo"] = [general_cases.run_case(gloo, c, rank, n) for c in general_cases.cases(n)]
    # Complex MIN/MAX/PRODUCT: a clear TypeError before any communication.
    out["complex"] = [
        _attempt(lambda op=op: c.all_reduce(torch.ones(3, dtype=torch.complex64), op))
        for c in (shm, gloo) for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
    ]
    # Disagreements that the element count alone does not reveal (shared memory).
    x = torch.arange(6.0).reshape(2, 3) + rank
    out["mismatch"] = [
        _attempt(lambda: shm.all_gather(x if rank else x.reshape(3, 2), 0)),
        _attempt(lambda: shm.all_gather(x, 0 if rank else 1)),
        _attempt(lambda: shm.gather(x if rank else x.reshape(3, 2), n - 1, 0)),
        _attempt(lambda: shm.reduce_scatter(torch.ones(n, n), 0 if rank else 1)),
        _attempt(lambda: shm.all_gatherv(
            torch.ones(2, 3) if rank else torch.ones(2, 3, 1), 0, [2] * n)),
    ]
    out["after_mismatch"] = shm.all_reduce(torch.ones(3)).tolist()
    # A peer whose sizes list disagrees (not only its own input) is caught by
    # the signature / the per-rank size headers on every rank, promptly.
    bad_sizes = [2] * n if rank else [2] * (n - 1) + [1]
    for label, c in (("shm", shm), ("gloo", gloo)):
        out[f"sizes_differ_{label}"] = _attempt(
            lambda c=c: c.all_gatherv(torch.ones(bad_sizes[rank], 4), 0, bad_sizes)
        )
        out[f"after_sizes_{label}"] = c.all_gatherv(
            torch.full((rank % 2, 2), float(rank)), 0, [r % 2 for r in range(n)]
        ).tolist()
    shm.destroy()
    gloo.close()
    out["closed"] = [
        _attempt(lambda c=c: c.all_reduce(torch.ones(2))) for c in (shm, gloo)
    ] + [_attempt(lambda: shm.all_gather(torch.ones(2))),
         _attempt(lambda: shm.send(torch.ones(1), 0 if rank else 1))]
    dist.destroy_process_group(pg)
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def lifecycle(rank: int, n: int) -> dict[str, Any]:
    """Two communicators interleaved, then many create/destroy cycles."""
    pg_a, pg_b = _group(), _group()
    a = CpuCommunicator(pg_a, torch.device("cpu"), unique_name="a", workspace_bytes=SMALL_WS,
                        timeout=20)
    b = CpuCommunicator(pg_b, torch.device("cpu"), unique_name="b", timeout=20)
    inter = []
    for i in range(6):  # changing shapes/dtypes, interleaving two groups and ops
        dt = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
        x = torch.full((i + 1, 3), rank + 1, dtype=dt)
        inter.append((a.all_reduce(x), b.all_gather(x, 0), a.broadcast(x.clone(), i % n),
                      b.reduce_scatterv(torch.ones(i + 1, dtype=dt), 0, [i + 1] + [0] * (n - 1))))
    a.destroy()
    b.destroy()
    dist.barrier()
    fds0 = _fds()
    for _ in range(12):
        c = CpuCommunicator(pg_a, torch.device("cpu"), unique_name="cyc", workspace_bytes=SMALL_WS)
        c.all_reduce(torch.ones(5))
        c.destroy()
    dist.barrier()
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    # Only these ranks' segments: other processes (another test worker) may
    # hold live communicators of their own meanwhile.
    segs = [s.name for s in list_segments() if s.name.startswith("gc_cpucomm_") and s.pid in pids]
    fds1 = _fds()
    dist.destroy_process_group(pg_a)
    dist.destroy_process_group(pg_b)
    return {"inter": inter, "fds": (fds0, fds1), "segs": segs}
