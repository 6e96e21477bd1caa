"""A blocking point-to-point call holds its direction's turn, on any thread.

Calls of one direction with one peer run one at a time in issue order. A
blocking receive made before any asynchronous call in that direction used to
run outside the direction's turn, so an ``irecv`` issued meanwhile by another
thread ran beside it: on a link both polled the queue at once (a raw
``RuntimeError``, then the link closed), on the CPU group the ``irecv`` took the
tensor of the dict the blocking call was receiving. And ``destroy()`` did not
know the blocking call ran, so a receive blocked in gloo on another thread
waited for the group's whole timeout. Both transports, tensors and dicts.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.coordinator.rank_checks import env_set

_TIMEOUT = 20.0


def _group(rank: int, world_size: int, transport: str, name: str) -> Any:
    from coordinator import GroupCoordinator

    with env_set("GROUPCOORD_P2P_SHM", "1" if transport == "link" else "0"):
        return GroupCoordinator([list(range(world_size))], rank, "gloo", True, True,
                                group_name=name, timeout=_TIMEOUT)


def blocking_then_async(rank: int, world_size: int, transport: str, kind: str,
                        key: str) -> list[str]:
    """Rank 1 receives on a thread (issued first), then ``irecv``s on its main thread."""
    g = _group(rank, world_size, transport, f"turns-{transport}-{kind}")
    store = dist.distributed_c10d._get_default_store()
    bad: list[str] = []
    try:
        if rank == 1:
            got: dict[str, Any] = {}

            def first() -> None:
                try:
                    got["a"] = (g.recv_tensor_dict(0) if kind == "dict"
                                else g.recv((2,), torch.float32, 0))
                except Exception as e:  # reported below
                    got["a"] = e

            t = threading.Thread(target=first)
            t.start()
            time.sleep(0.5)  # the blocking receive waits for its message
            h = g.irecv(((3,), torch.float32), 0)
            store.set(key, "go")
            second = h.wait(_TIMEOUT)
            t.join(_TIMEOUT)
            a = got.get("a")
            a = a["x"] if kind == "dict" and isinstance(a, dict) else a
            if not (isinstance(a, torch.Tensor) and torch.equal(a, torch.arange(2.0))):
                bad.append(f"first (blocking) receive got {a!r:.200}")
            if not torch.equal(second, torch.arange(3.0)):
                bad.append(f"second (irecv) got {second!r:.200}")
        else:
            store.wait([key])
            if kind == "dict":
                g.send_tensor_dict({"x": torch.arange(2.0)}, 1)
            else:
                g.send(torch.arange(2.0), 1)
            g.send(torch.arange(3.0), 1)
        g.barrier()
    finally:
        g.destroy()
    return bad


def destroy_while_receiving(rank: int, world_size: int, transport: str, kind: str,
                            key: str) -> float | None:
    """Rank 1 blocks in a receive on a thread and destroys the group: seconds the
    receive took to end (with ClosedError), else None."""
    from coordinator.errors import ClosedError

    g = _group(rank, world_size, transport, f"destroy-{transport}-{kind}")
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.wait([key])  # sends nothing; leaves once rank 1's receive ended
        g.destroy()
        return 0.0
    ended: dict[str, Any] = {}

    def receive() -> None:
        t0 = time.monotonic()
        try:
            {"recv": lambda: g.recv((2,), torch.float32, 0),
             "dict": lambda: g.recv_tensor_dict(0),
             "object": lambda: g.recv_object(0)}[kind]()
        except ClosedError:
            ended["after"] = time.monotonic() - t0
        except Exception as e:  # the wrong error: reported as None
            ended["error"] = e

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(0.5)
    g.destroy()
    t.join(_TIMEOUT + 5)
    store.set(key, "done")
    return ended.get("after")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tensor", "dict"])
@pytest.mark.parametrize("transport", ["link", "cpu-group"])
def test_an_irecv_waits_for_a_blocking_receive_of_another_thread(
        dist_pool, transport: str, kind: str) -> None:
    outs = dist_pool(2).run(blocking_then_async, transport, kind,
                            f"turns-{uuid.uuid4().hex}", timeout=100)
    assert outs == [[], []], outs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["recv", "dict", "object"])
@pytest.mark.parametrize("transport", ["link", "cpu-group"])
def test_destroy_ends_a_blocking_receive_of_another_thread(dist_pool, transport: str,
                                                            kind: str) -> None:
    outs = dist_pool(2).run(destroy_while_receiving, transport, kind,
                            f"destroyed-{uuid.uuid4().hex}", timeout=100)
    after = outs[1]
    assert after is not None and after < 5.0, after  # not the group's 20 s timeout
