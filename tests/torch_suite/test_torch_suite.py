"""PyTorch's own ``distributed_test.py`` as the judge of the groupcoord backend.

CI runs a fixed subset of the CPU collective tests (:data:`CI_SUBSET`: every
collective, point-to-point, barrier and group kind once) on two reused rank
processes (``--reuse``); the ``slow`` tests run the whole collective selection
at world sizes 2 and 4, where the failures the backend is known to have
(:data:`KNOWN_BACKEND_FAILURES`) are expected, strictly. Each goes through the
runner script (``run_torch_distributed_tests.py``) in a child process, as a
user would, and reads its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: The backend the suite runs on.
UNDER_TEST = "groupcoord"

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "run_torch_distributed_tests.py")

#: One test per kind of call, all passing on gloo at world size 2 (the suite tests
#: all_to_all on CPU only for MPI: every all_to_all test skips on gloo).
CI_SUBSET = (
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_sum",
    "test_broadcast",
    "test_reduce_sum",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_scatter",
    "test_all_gather_object_default_pg",
    "test_send_recv_any_source",
    "test_barrier",
    "test_send_recv_with_tag",
    "test_batch_isend_irecv_gloo",
)


#: Tests of the selection that fail on groupcoord because of the backend (to be fixed
#: there), with the cause. The slow tests expect exactly these failures, so a fix shows.
#: (Sparse all_reduce and the profiler's p2p tests failed here until the backend sent
#: sparse tensors to gloo and gave its gloo group a backend config.)
KNOWN_BACKEND_FAILURES: dict[str, str] = {}


def _run_suite(tmp_path: Path, world_size: int, patterns: list[str],
               timeout: float, expected_failures: frozenset[str] = frozenset()) -> dict:
    out = tmp_path / "suite.json"
    args = [sys.executable, _RUNNER, "--backend", UNDER_TEST, "--world-size", str(world_size),
            "--reuse", "--json", str(out)]
    for p in patterns:
        args += ["-k", p]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(out.read_text())
    failed = {n: t["detail"][-1500:] for n, t in data["tests"].items()
              if t["outcome"] == "failed" and n not in expected_failures}
    assert not failed, "\n\n".join(f"{n}:\n{d}" for n, d in failed.items())
    fixed = {n for n in expected_failures if data["tests"].get(n, {}).get("outcome") == "passed"}
    assert not fixed, f"these pass now: take them out of KNOWN_BACKEND_FAILURES: {sorted(fixed)}"
    return data


@pytest.mark.timeout(240)
def test_ci_subset_passes(tmp_path: Path) -> None:
    data = _run_suite(tmp_path, 2, [f"^{name}$" for name in CI_SUBSET], timeout=200)
    passed = {n for n, t in data["tests"].items() if t["outcome"] == "passed"}
    assert passed == set(CI_SUBSET), sorted(set(CI_SUBSET) - passed)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_selection_passes(tmp_path: Path, world_size: int) -> None:
    known = frozenset(KNOWN_BACKEND_FAILURES) if UNDER_TEST == "groupcoord" else frozenset()
    data = _run_suite(tmp_path, world_size, [], timeout=3500, expected_failures=known)
    assert data["counts"]["passed"] > 50, data["counts"]
