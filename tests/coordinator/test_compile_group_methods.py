"""GroupCoordinator.all_reduce/all_gather/reduce_scatter trace under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest

from tests.coordinator import _compile_fns as fns


@pytest.mark.timeout(300)
def test_group_methods_compile_without_graph_breaks(dist_pool) -> None:
    res = dist_pool(2).run(fns.compiled_matches_eager, timeout=280)
    for r in res:
        assert r["graph_breaks"] == 0, r
        assert r["graphs"] == 1, r
        assert r["match"] and r["match2"], r
        assert [o.removesuffix(".default") for o in r["ops"]] == [
            "groupcoord.all_gather", "groupcoord.all_reduce", "groupcoord.reduce_scatter"
        ], r["ops"]
