"""What ``isend_tensor_dict`` sends is the dict as it was at the call: the caller
may change its nested lists and dicts (and numpy arrays, bytearrays) right after
the call, as it may the dict itself, and the receiver gets the values of the
call (vLLM's form pickles them at the call). Tensors are the caller's until the
send's ``wait()``, as with ``isend``.

The first send is larger than what the transport buffers, so the sender's
worker is still in it, waiting for the receiver, when the caller changes the
second dict: what the worker sends of it then is what the call kept."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from tests.env_vars import environ


@pytest.mark.timeout(150)
@pytest.mark.parametrize("link", ["shm-link", "gloo"])
def test_changes_after_the_call_do_not_travel(dist_pool, link: str) -> None:
    outs = dist_pool(2).run(changed_after_isend, link, timeout=120)
    assert outs[0] == "sent", outs
    assert outs[1] == {"ids": [1, 2, 3], "nested": {"a": [4, (5, 6)], "b": {7}},
                       "array": [1, 2], "raw": b"ab", "t": [0.0, 1.0], "n": 3}, outs


def changed_after_isend(rank: int, world_size: int, link: str) -> Any:
    from coordinator import GroupCoordinator

    with environ(GROUPCOORD_P2P_SHM="1" if link == "shm-link" else "0"):
        g = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name=f"snapshot-{link}", timeout=60.0)
    big = torch.ones(64 << 20, dtype=torch.uint8)  # past what either transport buffers
    try:
        if rank == 0:
            meta: dict[str, Any] = {"ids": [1, 2, 3], "nested": {"a": [4, (5, 6)], "b": {7}},
                                    "array": np.array([1, 2]), "raw": bytearray(b"ab")}
            d = {"meta": meta, "t": torch.arange(2.0), "n": 3}
            first = g.isend_tensor_dict({"big": big}, 1)
            second = g.isend_tensor_dict(d, 1)
            meta["ids"].append(99)
            meta["nested"]["a"][0] = -1
            meta["nested"]["b"].add(8)
            meta["array"][0] = -1
            meta["raw"][0] = ord("z")
            d["n"] = 4
            first.wait()
            second.wait()
            return "sent"
        time.sleep(1.0)  # the sender's worker waits in the first send meanwhile
        got_big = g.recv_tensor_dict(0)
        assert torch.equal(got_big["big"], big)
        got = g.recv_tensor_dict(0)
        m = got["meta"]
        return {"ids": m["ids"], "nested": m["nested"], "array": m["array"].tolist(),
                "raw": bytes(m["raw"]), "t": got["t"].tolist(), "n": got["n"]}
    finally:
        g.destroy()
