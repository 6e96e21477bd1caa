"""The point-to-point part alone (``coordinator.p2p.point_to_point.PointToPoint``) on a
real gloo group with the CPU shared-memory communicator, no GroupCoordinator:
tensors settle a link, asynchronous calls run on channels in issue order with
the blocking ones, and closing ends what is still outstanding."""

from __future__ import annotations

from typing import Any

import pytest


def p2p_alone(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from coordinator.errors import ClosedError
    from coordinator.p2p.channels import SEND
    from tests.coordinator.parts import bare_group, bare_parts

    g = bare_group(rank, world_size, "p2p-alone:0")
    book, objects, p2p, _ = bare_parts(g)
    out: dict[str, Any] = {}
    try:
        x = torch.arange(6, dtype=torch.float32)
        if rank == 0:
            p2p.send(x, 1)
            out["link"] = p2p.links.settled(SEND, 1) is not None
            handles = [p2p.isend(x + k, 1) for k in range(3)]
            p2p.send_object({"after": 3}, 1)  # waits for the three isends, in order
            out["done"] = all(h.is_completed() for h in handles)
            out["waited"] = [h.wait() for h in handles]
            out["calls"] = [h.call for h in handles]
        else:
            got = p2p.recv((6,), torch.float32, 0)
            out["first"] = torch.equal(got, x)
            bufs = [p2p.irecv(torch.empty(6), 0) for _ in range(3)]
            out["async"] = [torch.equal(h.wait(), x + k) for k, h in enumerate(bufs)]
            out["object"] = p2p.recv_object(0)
        out["counted"] = (book.collectives, book.p2p_calls)
        objects.broadcast_object(None, 0)  # both ranks are done before closing
        pending = p2p.irecv(((1,), torch.float32), 1 - rank)  # nobody sends: waits at close
        p2p.close()
        try:
            pending.wait(5)
        except ClosedError:
            out["closed"] = True
    finally:
        objects.close()
        g.close()
    return out


@pytest.mark.timeout(90)
def test_point_to_point_works_alone(dist_pool) -> None:
    a, b = dist_pool(2).run(p2p_alone, timeout=80)
    assert a["link"] and a["done"] and a["waited"] == [None] * 3, a
    assert a["calls"] == [2, 3, 4] and a["counted"] == (0, 5), a
    assert b["first"] and b["async"] == [True] * 3 and b["object"] == {"after": 3}, b
    assert b["counted"] == (0, 5), b
    assert a["closed"] and b["closed"], (a, b)


def tensor_dicts_alone(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    from tests.coordinator.parts import bare_group, bare_parts

    g = bare_group(rank, world_size, "dicts-alone:0")
    book, objects, p2p, dicts = bare_parts(g)
    out: dict[str, Any] = {}
    try:
        d = {"x": torch.arange(4.0), "n": 3, "none": None}
        got = dicts.broadcast_tensor_dict(d if rank == 0 else None, 0, None, None)
        out["broadcast"] = torch.equal(got["x"], d["x"]) and got["n"] == 3
        if rank == 0:
            dicts.send_tensor_dict(d, 1, None, None)
            h = dicts.isend_tensor_dict({"y": torch.ones(2, 3)}, None)
            out["isend"] = h.wait()
            try:
                dicts.send_tensor_dict(d, 1, "tp", None)
            except TypeError as e:
                out["bad group"] = str(e)
        else:
            got = dicts.recv_tensor_dict(0, None)
            out["recv"] = torch.equal(got["x"], d["x"]) and got["none"] is None
            out["irecv"] = dicts.irecv_tensor_dict(None).wait()["y"].shape
            try:
                dicts.recv_tensor_dict(0, None)
            except Exception as e:  # the sender rejected its call
                out["peer rejected"] = type(e).__name__
        out["counted"] = (book.collectives, book.p2p_calls)
    finally:
        p2p.close()
        objects.close()
        g.close()
    return out


@pytest.mark.timeout(90)
def test_tensor_dict_calls_work_alone(dist_pool) -> None:
    a, b = dist_pool(2).run(tensor_dicts_alone, timeout=80)
    assert a["broadcast"] and b["broadcast"], (a, b)
    assert a["isend"] is None and b["recv"] and b["irecv"] == (2, 3), (a, b)
    assert "all_gather_group must be a BareGroup, got str" in a["bad group"], a
    assert b["peer rejected"] == "PeerRejectedError", b
    assert a["counted"] == b["counted"] == (1, 3), (a, b)
