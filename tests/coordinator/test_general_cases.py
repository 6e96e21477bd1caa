"""General cases an engine builder tries, beyond the shapes our issues named.

* Odd world sizes (3, and 6 for layouts), every dtype an engine moves
  (float32/16, bfloat16, int8, uint8, int32, int64, bool), 0-dim, empty, 4-D,
  transposed/sliced/expanded inputs, negative and non-last dims, uneven
  all_gatherv/reduce_scatterv with zero-size ranks, non-zero dst/src.
* Odd Python objects (dataclass, enum, numpy, tuples and tuple keys, sets,
  5 MiB bytes, big ints) through every object path, including the TP group's
  message queue; Parameters, expanded tensors and a 24 MiB tensor in tensor dicts.
* Input only the source can get wrong (a meta or sparse tensor, a value that
  does not pickle) raises on the source *and* on every receiver; these used
  to leave the receivers waiting forever.
* ``barrier(timeout=...)`` validates its argument (a non-positive timeout used
  to reach gloo and break the group's connections).

Each function runs many cases on the ranks and returns the failed ones, so a
failure lists every broken case at once.
"""

from __future__ import annotations

import pytest

from tests.coordinator import _general_fns as F


def _no_failures(results: list[list[str]]) -> None:
    bad = [f"rank {r}: {f}" for r, fails in enumerate(results) for f in fails]
    assert not bad, "\n".join(bad[:40])


@pytest.mark.timeout(120)
def test_collectives_every_dtype_and_layout_at_world_size_3(dist_pool):
    """Odd group size through the default CPU communicator and plain gloo."""
    _no_failures(dist_pool(3).run(F.collectives, timeout=100))


@pytest.mark.timeout(120)
def test_odd_objects_and_tensor_dicts_through_every_path_at_tp3(dist_pool):
    """World group (CPU-group path) and TP=3 (message queue) and size-1 PP."""
    _no_failures(dist_pool(3).run(F.objects, 3, timeout=100))


@pytest.mark.timeout(120)
def test_source_side_failures_raise_on_every_rank_and_barrier_timeouts(dist_pool):
    results = dist_pool(2).run(F.source_failures, 2, timeout=60)
    _no_failures(results)
    _no_failures(dist_pool(2).run(F.tensors_and_barrier, 2, timeout=60))


def _expected(tp: int, pp: int, dp: int, rank: int) -> dict:
    def group(same) -> list[int]:
        coord = lambda r: (r // (tp * pp), (r // tp) % pp, r % tp)  # noqa: E731
        return [r for r in range(tp * pp * dp) if same(coord(r), coord(rank))]

    out = {}
    for k, same in (("tp", lambda a, b: a[:2] == b[:2]), ("pp", lambda a, b: (a[0], a[2]) == (b[0], b[2])),
                    ("dp", lambda a, b: a[1:] == b[1:])):
        ranks = group(same)
        i = ranks.index(rank)
        out[k] = (ranks, i, ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)],
                  i == 0, i == len(ranks) - 1)
    return out


LAYOUTS_3 = [(3, 1, 1), (1, 3, 1), (1, 1, 3)]


@pytest.mark.timeout(120)
def test_layouts_and_reinit_at_world_size_3(dist_pool):
    results = dist_pool(3).run(F.layouts, LAYOUTS_3, timeout=100)
    for rank, recs in enumerate(results):
        for (tp, pp, dp), rec in zip(LAYOUTS_3, recs):
            want = _expected(tp, pp, dp, rank)
            for k in ("tp", "pp", "dp"):
                assert tuple(rec[k]) == want[k], f"{(tp, pp, dp)} rank {rank} {k}: {rec[k]} != {want[k]}"
            assert rec["getters"] == (tp, want["tp"][1], pp, want["pp"][1])


LAYOUTS_6 = [(3, 2, 1), (2, 3, 1), (1, 2, 3)]


@pytest.mark.timeout(150)
def test_layouts_and_reinit_at_world_size_6():
    from coordinator.testing import run_distributed

    results = run_distributed(F.layouts, 6, LAYOUTS_6, timeout=120)
    for rank, recs in enumerate(results):
        for (tp, pp, dp), rec in zip(LAYOUTS_6, recs):
            want = _expected(tp, pp, dp, rank)
            for k in ("tp", "pp", "dp"):
                assert tuple(rec[k]) == want[k], f"{(tp, pp, dp)} rank {rank} {k}: {rec[k]} != {want[k]}"
            assert rec["getters"] == (tp, want["tp"][1], pp, want["pp"][1])
