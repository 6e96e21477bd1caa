"""A tensor of more than 64 dimensions, sent point to point: the receivers accept
at most 64, so the sender refuses it before anything travels, the receiver is
told (it raises too) and the next calls pair as they should. On the shared-memory
link the sender failed in the encoder with an ``IndexError`` that reached no
receiver, which then took the next call's message (a silently wrong value); over
gloo a dict's receiver refused it and the sender waited until the timeout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.env_vars import environ


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["tensor", "dict"])
@pytest.mark.parametrize("link", ["shm-link", "gloo"])
def test_a_tensor_of_65_dims_is_refused_and_the_next_calls_pair(dist_pool, form: str,
                                                                link: str) -> None:
    outs = dist_pool(2).run(many_dims, form, link, timeout=100)
    sent, got = outs
    assert sent[0].startswith(("ValueError", "EncodeError")) and "65 dimensions" in sent[0], sent
    assert got[0].startswith(("PeerRejectedError", "CollectiveMismatch")), got
    assert "65 dimensions" in got[0], got
    assert sent[1:] == ["sent", "sent"], sent
    assert got[1:] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]], got


def many_dims(rank: int, world_size: int, form: str, link: str) -> list[Any]:
    from coordinator import GroupCoordinator

    with environ(GROUPCOORD_P2P_SHM="1" if link == "shm-link" else "0"):
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=f"dims-{form}-{link}", timeout=20.0)
    out: list[Any] = []
    try:
        for t in (torch.ones([1] * 65), torch.arange(3.0), torch.arange(3.0) + 10):
            try:
                if rank == 0:
                    if form == "dict":
                        g.send_tensor_dict({"x": t}, 1)
                    else:
                        g.send(t, 1)
                    out.append("sent")
                else:
                    got = g.recv_tensor_dict(0)["x"] if form == "dict" else \
                        g.recv(t.shape, t.dtype, 0)
                    out.append(got.tolist())
            except Exception as e:  # the parent checks which call raised what
                out.append(f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        g.destroy()
    return out
