"""The object calls alone (``coordinator.group.object_calls.ObjectCalls``) on a real gloo
group with its CPU communicator, no GroupCoordinator: broadcasts counted as
collective calls, objects point to point by kind, rejections and failures
reaching the peer."""

from __future__ import annotations

from typing import Any

import pytest


def objects_alone(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from coordinator.calls.call_book import CallBook
    from coordinator.errors import CollectiveMismatch, PeerRejectedError
    from coordinator.group.object_calls import ObjectCalls
    from coordinator.wire.object_comm import DICT_META, OBJECT
    from tests.coordinator.parts import bare_group

    g = bare_group(rank, world_size, "objects-alone:0")
    book = CallBook(g.unique_name, rank, world_size, g.timeout)
    g.comm.number_calls(lambda: book.collectives)
    objects = ObjectCalls(g, book)
    out: dict[str, Any] = {}
    try:
        src = world_size - 1
        got = objects.broadcast_object({"t": torch.arange(3)} if rank == src else None, src)
        out["broadcast"] = torch.equal(got["t"], torch.arange(3))
        lst = ["a", 2] if rank == 0 else [None, None]
        out["list"] = objects.broadcast_object_list(lst, 0, None)
        out["counted"] = (book.collectives, book.p2p_calls)
        if rank == 0:
            objects.send({"k": 1}, 1)
            objects.send([1, 2], 1, DICT_META)
            objects.send_failure("send_tensor_dict", "bad dict", 1, DICT_META)
        elif rank == 1:
            out["recv"] = objects.recv(0)
            out["meta"] = objects.recv(0, DICT_META)
            try:
                objects.recv(0, DICT_META)
            except CollectiveMismatch as e:
                out["failure"] = "bad dict" in str(e)
        out["p2p counted"] = book.calls  # raw sends are not calls of their own
        try:
            if rank == 0:
                raise ValueError("src out of range here")
            objects.broadcast_raw(None, 0)
        except PeerRejectedError as e:  # (a ValueError too: caught first)
            out["rejected"] = list(e.peers)
        except ValueError as e:
            objects.reject_broadcast("broadcast_object", e)
            out["rejected"] = "self"
        out["kinds"] = (OBJECT, DICT_META)
    finally:
        objects.close()
        g.close()
    return out


@pytest.mark.timeout(90)
def test_object_calls_work_alone(dist_pool) -> None:
    a, b = dist_pool(2).run(objects_alone, timeout=80)
    for r in (a, b):
        assert r["broadcast"] and r["list"] == ["a", 2], r
        assert r["counted"] == (2, 0) and r["p2p counted"] == 2, r
    assert b["recv"] == {"k": 1} and b["meta"] == [1, 2] and b["failure"], b
    assert a["rejected"] == "self" and b["rejected"] == [0], (a, b)
