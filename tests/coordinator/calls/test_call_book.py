"""The call book alone (``coordinator.calls.call_book.CallBook``): numbering, the
closed state, and the explanation of failed waits; the peers' identities over a
real gloo group."""

from __future__ import annotations

import os
from typing import Any

import pytest

from coordinator.calls.call_book import CallBook
from coordinator.errors import ClosedError, CommTimeout, NotInitializedError


def test_collective_and_point_to_point_calls_are_counted_apart() -> None:
    book = CallBook("g:0", 0, 2, 5.0)
    assert (book.calls, book.collectives, book.p2p_calls) == (0, 0, 0)
    assert book.run("all_gatherv", lambda x: x + 1, 41) == 42
    assert book.run("send_object", lambda: None, partner=1, p2p=True) is None
    assert book.number_p2p() == 3
    assert book.run("barrier", lambda: "ok") == "ok"
    assert (book.calls, book.collectives, book.p2p_calls) == (4, 2, 2)


def test_a_closed_book_refuses_new_calls_and_explains_running_ones_as_closed() -> None:
    book = CallBook("g:1", 0, 2, 5.0)
    book.check_live("barrier")
    assert not book.closed
    book.close()
    assert book.closed
    with pytest.raises(NotInitializedError, match=r"'g:1' was destroyed; barrier needs"):
        book.check_live("barrier")

    def gloo_gave_up() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(ClosedError, match=r"op all_gather, call #1: the group was destroyed"):
        book.run("all_gather", gloo_gave_up)


def test_a_failed_wait_names_the_group_the_op_and_the_call() -> None:
    book = CallBook("g:2", 0, 2, 5.0)
    book.run("all_reduce", lambda: None)

    def times_out() -> None:
        raise CommTimeout("waited", peers=(1,))

    with pytest.raises(CommTimeout) as got:
        book.run("recv", times_out, partner=1, p2p=True)
    assert "group 'g:2' (rank 0 of 2), op recv, call #2" in str(got.value)
    assert got.value.peers == (1,) and got.value.call == 2  # type: ignore[attr-defined]


def test_other_errors_pass_unchanged() -> None:
    book = CallBook("g:3", 0, 2, 5.0)

    def bad_argument() -> None:
        raise TypeError("dst must be an int")

    with pytest.raises(TypeError, match="^dst must be an int$"):
        book.run("send_object", bad_argument, p2p=True)
    assert book.calls == 1


def learn(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    pg = dist.new_group(list(range(world_size)), backend="gloo")
    try:
        book = CallBook("learn:0", rank, world_size, 10.0)
        book.learn_peers(pg)
        peer = 1 - rank
        return {"pid": book.errors.pids[peer], "watched": book.errors.watches[peer] is not None,
                "dead": book.dead_partner("recv", peer), "me": os.getpid()}
    finally:
        dist.destroy_process_group(pg)


@pytest.mark.timeout(60)
def test_the_book_learns_its_peers_processes(dist_pool) -> None:
    a, b = dist_pool(2).run(learn, timeout=50)
    assert a["pid"] == b["me"] and b["pid"] == a["me"]
    assert a["watched"] and b["watched"]  # same host: checkable
    assert a["dead"] is None and b["dead"] is None  # alive
