"""Tensor dicts through shared-memory links (coordinator.shm_links), on real ranks.

Every case builds a group of its own, so the first dict of each direction
settles it (the offer over the CPU group). The same dicts go over the CPU
group when the sender sets ``GROUPCOORD_P2P_SHM=0``: both transports must
return exactly what was sent.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from typing import Any

import pytest
import torch

from shm_broadcast.launcher import spawn_group

# ---------------------------------------------------------------------- rank side


def _group(rank: int, n: int, name: str, timeout: float = 60.0) -> Any:
    from coordinator import GroupCoordinator

    return GroupCoordinator([list(range(n))], rank, "gloo", True, group_name=name,
                            timeout=timeout)


def _dict(src: int, dst: int, big: bool) -> dict[str, Any]:
    """Every dtype family, empty and 0-d tensors, views, plain values; ``big``
    adds a tensor larger than a link's ring chunk (the overflow path)."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + 100 * src + dst
    d: dict[str, Any] = {
        "f32": base.float(),
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i64": base.long(),
        "i8": base.to(torch.int8),
        "u8": base.to(torch.uint8),
        "bool": base.long() % 3 == 0,
        "c64": torch.complex(base.float(), -base.float()),
        "scalar": torch.tensor(3.5 + src),
        "empty": torch.empty(0, 5),
        "strided": base.float()[:, ::2],
        "transposed": base.float().t(),
        "conj-view": torch.complex(base.float(), base.float()).conj(),
        "needs-grad": base.float().requires_grad_(),
        "parameter": torch.nn.Parameter(base.float()),
        "none": None,
        "value": {"ids": [src, dst], "name": f"{src}->{dst}", "t": (1, 2)},
    }
    if big:  # streamed in parts: the two large ones; "f32" and the rest travel inline
        d["big"] = torch.arange(5 << 20 >> 2, dtype=torch.float32) + src  # 5 MiB
        d["mid"] = (torch.arange(300_000, dtype=torch.float32) - dst).to(torch.bfloat16)
        d["mid-strided"] = torch.arange(800_000, dtype=torch.int64)[::4] + src
    return d


def _differences(got: Any, want: dict[str, Any]) -> list[str]:
    if not isinstance(got, dict) or list(got) != list(want):
        return [f"keys {list(got) if isinstance(got, dict) else type(got)} != {list(want)}"]
    bad = []
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            if not (type(g) is torch.Tensor and not g.requires_grad and g.dtype == v.dtype
                    and g.shape == v.shape and torch.equal(g, v.detach())):
                bad.append(f"{k}: {g!r:.80} != {v!r:.80}")
        elif g != v:
            bad.append(f"{k}: {g!r} != {v!r}")
    return bad


def every_pair(rank: int, n: int, transport: str, big: bool) -> dict[str, Any]:
    """Each ordered pair exchanges two dicts (blocking and asynchronous); report
    mismatches and the transport each direction settled on."""
    from coordinator.p2p_channels import SEND

    if transport == "cpu-group":
        os.environ["GROUPCOORD_P2P_SHM"] = "0"
    g = _group(rank, n, f"links-{transport}")
    bad: list[str] = []
    try:
        for src in range(n):
            for dst in range(n):
                if src == dst or rank not in (src, dst):
                    continue
                if rank == src:
                    g.send_tensor_dict(_dict(src, dst, big), dst)
                    g.isend_tensor_dict(_dict(src, dst, False), dst).wait()
                else:
                    bad += _differences(g.recv_tensor_dict(src), _dict(src, dst, big))
                    bad += _differences(g.irecv_tensor_dict(src).wait(), _dict(src, dst, False))
        used = {dst: type(g._links._settled[(SEND, dst)]).__name__
                for dst in range(n) if dst != rank}
    finally:
        os.environ.pop("GROUPCOORD_P2P_SHM", None)
        g.destroy()
    return {"bad": bad, "used": used}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", ["link", "cpu-group"])
def test_every_dtype_shape_and_value_arrives_exactly(dist_pool, world_size, transport):
    results = dist_pool(world_size).run(every_pair, transport, world_size == 2, timeout=150)
    want = "MessageQueue" if transport == "link" else "str"
    for rank, res in enumerate(results):
        assert res["bad"] == [], (rank, res["bad"])
        assert set(res["used"].values()) == {want}, (rank, res["used"])


# ---------------------------------------------------------------------- a hostile sender


class _Evil:
    """Unpickling this would run ``print`` (a stand-in for any code)."""

    def __reduce__(self) -> tuple:
        return (print, ("pwned: code ran in the receiver",))


def _hostile_messages() -> list[tuple[str, list[Any]]]:
    """``(name, messages)``: each attack's messages, all read by the receive that fails."""
    f32 = ["cpu", "float32", [4], 0]
    big = ["td", [["x", 1, ["cpu", "float32", [600_000], 0]]], []]  # 2.4 MiB: streamed
    return [
        ("not-a-list", [{"td": 1}]),
        ("unknown-tag", [["nope", [], []]]),
        ("pieces-not-tensors", [["td", [["x", 1, f32]], [b"\x00" * 16]]]),
        ("missing-bytes", [["td", [["x", 1, f32]], []]]),
        ("too-few-elements", [["td", [["x", 1, f32]], [torch.zeros(3)]]]),
        ("wrong-dtype", [["td", [["x", 1, f32]], [torch.zeros(4, dtype=torch.int32)]]]),
        ("extra-pieces", [["td", [["x", 1, f32]], [torch.zeros(4), torch.zeros(4)]]]),
        ("negative-shape", [["td", [["x", 1, ["cpu", "float32", [-4], 0]]], []]]),
        ("huge-shape", [["td", [["x", 1, ["cpu", "float32", [1 << 40, 1 << 30], 0]]], []]]),
        ("bad-slicing", [["td", [["x", 1, ["cpu", "float32", [5], 2]]], [torch.zeros(2)]]]),
        ("pickled-value", [["td", [["x", 0, _Evil()]], []]]),
        ("streamed-sent-inline", [["td", big[1], [torch.zeros(600_000)]]]),
        ("part-of-wrong-dtype", [big, ["part", torch.zeros(10, dtype=torch.int32)]]),
        ("part-too-long", [big, ["part", torch.zeros(600_001)]]),
        ("part-2d", [big, ["part", torch.zeros(2, 5)]]),
        ("dict-instead-of-part", [big, ["td", [], []]]),
        ("pickled-part", [big, ["part", _Evil()]]),
    ]


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pickle.loads called on bytes from a peer")


def hostile_link(rank: int, n: int) -> list[str]:
    """Rank 0 offers a link meant for another rank, then a pickle-enabled link of
    its own, and writes malformed messages on it; rank 1 must raise DecodeError
    for each, never unpickle, and read the honest dict that follows."""
    from coordinator.errors import DecodeError
    from coordinator.shm_links import MAGIC
    from shm_broadcast.message_queue import MessageQueue

    g = _group(rank, n, "hostile-link")
    fails: list[str] = []
    loads, pickle.loads = pickle.loads, _refuse
    try:
        if rank == 0:
            g._send_object([MAGIC, b"\x93garbage"], 1)
            g._send_object(["not-the-magic", None], 1)
            other = MessageQueue(1, 1, local_reader_ranks=[5])
            g._send_object([MAGIC, other.export_handle().to_bytes()], 1)
            other.close()
            q = MessageQueue(1, 1, local_reader_ranks=[1], allow_pickle=True)
            g._send_object([MAGIC, q.export_handle().to_bytes()], 1)
            q.wait_until_ready(30)
            for _, msgs in _hostile_messages():
                for msg in msgs:
                    q.enqueue(msg)
            q.enqueue(["td", [["ok", 0, 7], ["t", 2, torch.arange(3)]], []])
            g.barrier()
            q.close()
            return fails
        offers = [("garbage-handle", None), ("no-magic", None), ("offer-for-rank-5", None)]
        for name, _ in [*offers, *_hostile_messages()]:
            try:
                got = g.recv_tensor_dict(0)
                fails.append(f"{name}: decoded {got!r:.100}")
            except DecodeError:
                pass
            except Exception as e:  # noqa: BLE001 -- report what escaped
                fails.append(f"{name}: {type(e).__name__}: {e}")
        got = g.recv_tensor_dict(0)
        if got.get("ok") != 7 or not torch.equal(got.get("t"), torch.arange(3)):
            fails.append(f"honest dict after the attacks: {got!r:.100}")
        g.barrier()
    finally:
        pickle.loads = loads
        g.destroy()
    return fails


@pytest.mark.timeout(120)
def test_hostile_link_messages_are_refused(dist_pool):
    assert dist_pool(2).run(hostile_link, timeout=100) == [[], []]


# ---------------------------------------------------------------------- waits end


def destroyed_while_waiting(rank: int, n: int) -> dict[str, Any]:
    """Rank 1 waits on a settled link for a dict that never comes; another thread
    destroys the group: the wait must end at once with ClosedError."""
    from coordinator.errors import ClosedError

    g = _group(rank, n, "destroyed-link", timeout=120)
    if rank == 0:
        g.send_tensor_dict({"x": torch.ones(2)}, 1)  # settles the link
        g.barrier()
        time.sleep(1.0)
        g.destroy()
        return {}
    g.recv_tensor_dict(0)
    g.barrier()
    handle = g.irecv_tensor_dict(0)
    killer = threading.Timer(0.3, g.destroy)
    t0 = time.monotonic()
    killer.start()
    out: dict[str, Any] = {}
    try:
        handle.wait()
        out["error"] = "none"
    except ClosedError:
        out["error"] = "ClosedError"
    except Exception as e:  # noqa: BLE001 -- the type is the result
        out["error"] = f"{type(e).__name__}: {e}"
    out["s"] = time.monotonic() - t0
    killer.join()
    return out


@pytest.mark.timeout(120)
def test_destroy_ends_a_wait_on_a_link(dist_pool):
    res = dist_pool(2).run(destroyed_while_waiting, timeout=100)[1]
    assert res["error"] == "ClosedError", res
    assert res["s"] < 10, res


def silent_sender(rank: int, n: int) -> dict[str, Any]:
    """Rank 0 settles the link and then sends nothing: rank 1's next receive must
    raise CommTimeout naming the op and rank 0 after the group's timeout."""
    from coordinator.errors import CommTimeout

    g = _group(rank, n, "silent-link", timeout=3.0)
    try:
        if rank == 0:
            g.send_tensor_dict({"x": torch.ones(2)}, 1)
            time.sleep(6.0)
            return {}
        g.recv_tensor_dict(0)
        t0 = time.monotonic()
        try:
            g.recv_tensor_dict(0)
            return {"error": "none"}
        except CommTimeout as e:
            return {"error": "CommTimeout", "msg": str(e), "peers": list(e.peers),
                    "s": time.monotonic() - t0}
    finally:
        g.destroy()


@pytest.mark.timeout(120)
def test_a_silent_sender_times_out_by_name(dist_pool):
    res = dist_pool(2).run(silent_sender, timeout=100)[1]
    assert res["error"] == "CommTimeout", res
    assert "recv_tensor_dict" in res["msg"] and "silent-link" in res["msg"], res
    assert 0 in res["peers"], res
    assert 2.5 < res["s"] < 20, res


def killed_sender(rank: int, n: int) -> dict[str, Any]:
    """Rank 0 SIGKILLs itself after one dict; rank 1's next receive must raise
    PeerDiedError naming it, well before the group's timeout."""
    from coordinator.errors import PeerDiedError

    g = _group(rank, n, "killed-link", timeout=120)
    if rank == 0:
        g.send_tensor_dict({"x": torch.ones(2)}, 1)
        g.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    g.recv_tensor_dict(0)
    g.barrier()
    t0 = time.monotonic()
    try:
        g.recv_tensor_dict(0)
        out: dict[str, Any] = {"error": "none"}
    except PeerDiedError as e:
        out = {"error": "PeerDiedError", "peers": list(e.peers), "msg": str(e)}
    except Exception as e:  # noqa: BLE001 -- the type is the result
        out = {"error": f"{type(e).__name__}: {e}"}
    out["s"] = time.monotonic() - t0
    g.destroy()
    return out


@pytest.mark.timeout(120)
def test_a_dead_sender_is_named():
    outcomes = spawn_group(killed_sender, 2, timeout=90)
    assert outcomes[0].exitcode == -signal.SIGKILL, outcomes[0]
    res = outcomes[1]
    assert res.ok, res.error
    assert res.result["error"] == "PeerDiedError", res.result
    assert 0 in res.result["peers"], res.result
    assert res.result["s"] < 30, res.result


def sent_then_destroyed(rank: int, n: int, numel: int) -> Any:
    """Rank 0 sends two dicts (one may exceed the ring chunk) and destroys its group
    at once; rank 1 reads them a second later: both must arrive whole."""
    g = _group(rank, n, "sent-then-destroyed", timeout=30)
    try:
        if rank == 0:
            g.send_tensor_dict({"settle": 1}, 1)
            g.send_tensor_dict({"big": torch.arange(numel, dtype=torch.float32)}, 1)
            g.send_tensor_dict({"small": torch.arange(5)}, 1)
            return None
        g.recv_tensor_dict(0)
        time.sleep(1.0)
        big, small = g.recv_tensor_dict(0), g.recv_tensor_dict(0)
        return [torch.equal(big["big"], torch.arange(numel, dtype=torch.float32)),
                small["small"].tolist()]
    finally:
        g.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("numel", [1000, 3 << 20], ids=["in-ring", "overflow-12MiB"])
def test_dicts_sent_before_destroy_still_arrive(dist_pool, numel):
    assert dist_pool(2).run(sent_then_destroyed, numel, timeout=100)[1] == [True, [0, 1, 2, 3, 4]]
