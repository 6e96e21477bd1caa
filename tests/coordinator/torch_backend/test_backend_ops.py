"""Every op of the groupcoord backend equals the same op on gloo, on the same ranks.

One groupcoord group per pool serves the whole file (built by the first test,
destroyed by the module fixture); each test runs one op's cases (dtypes,
shapes incl. non-contiguous, empty and 0-dim tensors) on every rank and
compares them bitwise with gloo's results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.coordinator.torch_backend import cases

WORLDS = (2, 3)
#: ops that the shared-memory engine serves on one host (the test fails if they went to gloo)
_ON_SHM = {op for op in cases.CASES if op not in ("scatter", "functional")}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", sorted(cases.CASES))
def test_op_equals_gloo(pools: Callable[[int], Any], op: str, world: int) -> None:
    results = pools(world).run(cases.run_cases, op, timeout=90)
    for rank, res in enumerate(results):
        assert res["bad"] == [], f"rank {rank}: {res['bad']}"
        assert res["ran"] > 0, f"rank {rank}: every case was skipped: {res['skipped']}"
        if op in _ON_SHM:
            assert res["shm"] > 0, f"rank {rank}: the shared-memory engine served no call"
    # the ranks agree on which cases gloo refused (those are listed in the docs)
    assert len({len(r["skipped"]) for r in results}) == 1
