"""General shapes, dtypes, world sizes and error paths of the device communicators.

One multi-process run per world size covers every op through the shared-memory
CpuCommunicator and through plain gloo (TorchDistributedCommunicator) against
a fixed-order reference, then the error paths: disagreements the element count
does not reveal, a rank whose own arguments are rejected while its peers wait,
use after destroy, and create/destroy cycles (no leaked segments or fds).
"""

from __future__ import annotations

import pytest
import torch

from coordinator.testing import run_distributed
from device_comms.errors import BrokenCommunicator
from tests.device_comms import _general_fns as fns


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
    from device_comms.shm_sync import BrokenCommunicator as old

    assert top is old is BrokenCommunicator


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [3, 5])
def test_general_cases(world_size: int) -> None:
    n = world_size
    outs = run_distributed(fns.general, n, timeout=140)
    cases = fns.cases(n)
    failures = []
    for c in cases:
        for key, cmp in (("shm", _same), ("gloo", _close)):
            got = [o[key][c[0]] for o in outs]
            for r in range(n):
                want = fns.expected(c, n, r)
                if not cmp(got[r], want):
                    failures.append(f"{key} {c[:5]} {c[5]} rank {r}")
            if c[1] in ("all_reduce", "all_gather", "all_gatherv", "broadcast"):
                if not all(_same(g, got[0]) for g in got):
                    failures.append(f"{key} ranks disagree on {c[:5]}")
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert outs[0]["sizes_differ_gloo"][0] == "CollectiveMismatch"
    assert f"rank {n - 1}: 2" in outs[0]["sizes_differ_gloo"][1]
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
            # shm compares every rank's sizes; gloo's size headers show rank 0
            # (whose list disagrees) that rank n-1 sent 2 rows, not 1.
            ok = ("CollectiveMismatch",) if label == "shm" else ("CollectiveMismatch", "ok")
            assert name in ok and elapsed < 5.0, (label, name, msg)
            want = [[float(r)] * 2 for r in range(n) if r % 2]
            assert o[f"after_sizes_{label}"] == want
        for name, msg, _ in o["closed"]:
            assert name == "ClosedError" and "destroyed" in msg, (name, msg)


@pytest.mark.timeout(90)
def test_two_groups_and_create_destroy_cycles() -> None:
    n = 2
    outs = run_distributed(fns.lifecycle, n, timeout=80)
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
