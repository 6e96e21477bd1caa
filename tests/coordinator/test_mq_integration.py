"""GroupCoordinator + shm_broadcast: broadcasters, single-reader queues, external writers."""

from __future__ import annotations

import pytest

from tests.coordinator import _mq_fns as fns


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 4), (4, 2)])
def test_tp_group_broadcasts_through_queue(dist_pool, world_size: int, tp: int) -> None:
    for r in dist_pool(world_size).run(fns.tp_broadcasts, tp, timeout=120):
        assert r["has_mq"]
        assert "bad_obj" not in r, r.get("bad_obj")
        assert r["dict_ok"]
        assert r["writer_last_ok"]
        assert r.get("bad_option") is True


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("blocking", [True, False])
def test_single_reader_queues(dist_pool, world_size: int, blocking: bool) -> None:
    res = dist_pool(world_size).run(fns.single_reader, blocking, timeout=120)
    assert res[-1]["ok"]
    assert res[-1]["count"] == 20 * (world_size - 1)


def test_external_writer_handle(dist_pool) -> None:
    res = dist_pool(3).run(fns.external_writer, timeout=120)
    assert res[1]["got"] == [0, 1, 2, 3, 4]
    assert res[2]["got"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world_size", [2, 4])
def test_src_only_argument_errors_raise_everywhere(dist_pool, world_size: int) -> None:
    res = dist_pool(world_size).run(fns.src_only_errors_reach_everyone, timeout=120)
    for rank, r in enumerate(res):
        for name in ("world", "tp_mq"):
            kind, elapsed, msg = r[f"{name}_btd"]
            # The source raises the plain argument error; the others learn of it
            # as CollectiveMismatch (a ValueError) naming the source.
            assert kind == ("TypeError" if rank == 0 else "CollectiveMismatch"), (rank, name, msg)
            assert elapsed < 10 and ("source rank 0" in msg or rank == 0), msg
            kind, elapsed, msg = r[f"{name}_scatter"]
            assert kind == ("ValueError" if rank == 0 else "CollectiveMismatch"), (rank, name, msg)
            assert elapsed < 10, (rank, name, msg)
            assert "divisible" in msg, msg
            assert r[f"{name}_after"]
