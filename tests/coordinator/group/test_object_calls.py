"""The object calls alone (``coordinator.group.object_calls.ObjectCalls``) on a real gloo
group with its CPU communicator, no GroupCoordinator: broadcasts counted as
collective calls, objects point to point by kind, rejections and failures
reaching the peer."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(90)
@pytest.mark.distributed(world_size=2, timeout=80)
def test_object_calls_work_alone(rank: int, world_size: int) -> None:
    import torch

    from coordinator.calls.call_book import CallBook
    from coordinator.errors import CollectiveMismatch, PeerRejectedError
    from coordinator.group.object_calls import ObjectCalls
    from coordinator.wire.object_comm import DICT_META
    from tests.coordinator.parts import bare_group

    g = bare_group(rank, world_size, "objects-alone:0")
    book = CallBook(g.unique_name, rank, world_size, g.timeout)
    g.comm.number_calls(lambda: book.collectives)
    objects = ObjectCalls(g, book)
    try:
        src = world_size - 1
        got = objects.broadcast_object({"t": torch.arange(3)} if rank == src else None, src)
        assert torch.equal(got["t"], torch.arange(3))
        lst = ["a", 2] if rank == 0 else [None, None]
        assert objects.broadcast_object_list(lst, 0, None) == ["a", 2]
        assert (book.collectives, book.p2p_calls) == (2, 0)
        if rank == 0:
            objects.send({"k": 1}, 1)
            objects.send([1, 2], 1, DICT_META)
            objects.send_failure("send_tensor_dict", "bad dict", 1, DICT_META)
        elif rank == 1:
            assert objects.recv(0) == {"k": 1}
            assert objects.recv(0, DICT_META) == [1, 2]
            with pytest.raises(CollectiveMismatch, match="bad dict"):
                objects.recv(0, DICT_META)
        assert book.calls == 2  # raw sends are not calls of their own
        try:
            if rank == 0:
                raise ValueError("src out of range here")
            objects.broadcast_raw(None, 0)
        except PeerRejectedError as e:  # (a ValueError too: caught first)
            rejected: object = list(e.peers)
        except ValueError as e:
            objects.reject_broadcast("broadcast_object", e)
            rejected = "self"
        assert rejected == ("self" if rank == 0 else [0])
    finally:
        objects.close()
        g.close()
