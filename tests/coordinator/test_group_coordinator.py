"""GroupCoordinator's collectives on real gloo process groups, checked against local references.

World sizes 1, 2 and 4 run every method on the world group (whose tensors go
through the registry's CPU communicator) and on a group forced onto plain gloo
(``device_communicator="torch"``, the portable fallback); TP=2 x PP=2 runs them
again on the TP and PP groups (group-local ranks that are not global ranks) and
on the size-1 DP group. Each configuration is one pool run that
checks a few hundred cases on the ranks (see ``_dist_fns.collective_suite``).
"""

from __future__ import annotations

import pytest

from tests.coordinator import _dist_fns as F

WORLD_SIZES = [1, 2, 4]


def _topology(ranks: list[int], me: int) -> dict:
    """Expected topology properties of global rank ``me`` in a group of ``ranks``."""
    i = ranks.index(me)
    return {
        "ranks": ranks, "rank": me, "world_size": len(ranks), "rank_in_group": i,
        "first_rank": ranks[0], "last_rank": ranks[-1],
        "is_first_rank": i == 0, "is_last_rank": i == len(ranks) - 1,
        "next_rank": ranks[(i + 1) % len(ranks)], "prev_rank": ranks[(i - 1) % len(ranks)],
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_method_on_the_world_group(dist_pool, world_size):
    results = dist_pool(world_size).run(F.run_world_suites, timeout=150)
    cases = [r["cases"] for r in results]
    assert all(c == cases[0] for c in cases), "ranks checked different case lists"
    # every method family really ran (the rank-side asserts did the checking)
    families = {c.split("/")[1] for c in cases[0] if c.startswith("world/")}
    assert {"all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv",
            "gather", "reduce", "scatter", "all_to_all", "broadcast"} <= families
    if world_size > 1:
        assert "send" in families
        # the same collective cases ran again on a group forced onto plain gloo
        gloo = [c.removeprefix("gloo/") for c in cases[0] if c.startswith("gloo/")]
        assert gloo == [c.removeprefix("world/") for c in cases[0] if c.startswith("world/")]
        assert f"send_object/{world_size - 1}->0" in cases[0]
    else:
        assert "single-rank" in cases[0]
    # 8 ops x 3 dtypes of all_reduce, incl. the refused combinations
    assert sum(c.startswith("world/all_reduce/torch") for c in cases[0]) == 24
    for rank, r in enumerate(results):
        assert r["topology"] == _topology(list(range(world_size)), rank)


@pytest.mark.timeout(180)
def test_every_method_on_tp_and_pp_groups_of_tp2_pp2(dist_pool):
    results = dist_pool(4).run(F.run_tp2_pp2_suites, timeout=150)
    assert all(r["cases"] == results[0]["cases"] for r in results)
    assert any(c.startswith("tp/reduce_scatterv/") for c in results[0]["cases"])
    assert any(c.startswith("pp/send/1->0") for c in results[0]["cases"])
    tp_groups, pp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for rank, r in enumerate(results):
        tp = next(g for g in tp_groups if rank in g)
        pp = next(g for g in pp_groups if rank in g)
        assert r["tp"] == _topology(tp, rank)
        assert r["pp"] == _topology(pp, rank)
        assert r["dp"] == _topology([rank], rank)
