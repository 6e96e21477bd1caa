"""Tensor dicts through shared-memory links (coordinator.p2p.shm_links), on real ranks.

Every case builds a group of its own, so the first dict of each direction
settles it (the offer over the CPU group). The same dicts go over the CPU
group when the sender sets ``GROUPCOORD_P2P_SHM=0``: both transports must
return exactly what was sent.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.wire.object_comm import LINK_OFFER
from shm_broadcast.ranks.launcher import spawn_group

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
        "uint4": (base.to(torch.uint8) % 16).view(torch.uint4),
        "subclass": base.float().as_subclass(_Sub),
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


class _Sub(torch.Tensor):
    """A tensor subclass: it arrives as a plain tensor with the same values."""


def _same_values(g: torch.Tensor, v: torch.Tensor) -> bool:
    try:
        return bool(torch.equal(g, v.detach().as_subclass(torch.Tensor)))
    except (RuntimeError, NotImplementedError):  # sub-byte dtypes: compare the bytes
        return bool(torch.equal(g.reshape(-1).view(torch.uint8),
                                v.detach().reshape(-1).view(torch.uint8)))


def _resizable(t: torch.Tensor) -> bool:
    """Whether ``t`` can grow, as a tensor torch allocated can (where its dtype can)."""
    try:
        torch.empty(1, dtype=t.dtype).resize_(4)
    except (RuntimeError, NotImplementedError):
        return True  # the dtype itself cannot (sub-byte types)
    try:
        t.resize_(t.numel() + 3)
        return True
    except RuntimeError:
        return False


def _differences(got: Any, want: dict[str, Any]) -> list[str]:
    if not isinstance(got, dict) or list(got) != list(want):
        return [f"keys {list(got) if isinstance(got, dict) else type(got)} != {list(want)}"]
    bad = []
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            if not (type(g) is torch.Tensor and not g.requires_grad and g.dtype == v.dtype
                    and g.shape == v.shape and _same_values(g, v)):
                bad.append(f"{k}: {type(g).__name__} {g!r:.80} != {v!r:.80}")
            elif not _resizable(g):
                bad.append(f"{k}: the received tensor cannot be resized")
        elif g != v:
            bad.append(f"{k}: {g!r} != {v!r}")
    return bad


def every_pair(rank: int, n: int, transport: str, big: bool) -> dict[str, Any]:
    """Each ordered pair exchanges two dicts (blocking and asynchronous); report
    mismatches and the transport each direction settled on."""
    from coordinator.p2p.channels import SEND

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
        used = {dst: type(g._p2p.links._settled[(SEND, dst)]).__name__
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


def _hostile_messages() -> list[tuple[str, Any]]:
    """``(name, message)``: each read by one receive, which must raise DecodeError."""
    f32 = ["cpu", "float32", [4], 0]
    return [
        ("not-a-list", {"td": 1}),
        ("unknown-tag", ["nope", [], []]),
        ("tag-not-a-str", [np.zeros(2), [], []]),
        ("pieces-not-tensors", ["td", [["x", 1, f32]], [b"\x00" * 16]]),
        ("missing-bytes", ["td", [["x", 1, f32]], []]),
        ("too-few-bytes", ["td", [["x", 1, f32]], [torch.zeros(15, dtype=torch.uint8)]]),
        ("piece-of-another-dtype", ["td", [["x", 1, f32]], [torch.zeros(4, dtype=torch.float64)]]),
        ("piece-too-long", ["td", [["x", 1, f32]], [torch.zeros(5)]]),
        ("extra-pieces", ["td", [["x", 1, f32]], [torch.zeros(16, dtype=torch.uint8)] * 2]),
        ("negative-shape", ["td", [["x", 1, ["cpu", "float32", [-4], 0]]], []]),
        ("huge-shape", ["td", [["x", 1, ["cpu", "float32", [1 << 40, 1 << 30], 0]]], []]),
        ("bad-slicing", ["td", [["x", 1, ["cpu", "float32", [5], 2]]],
                         [torch.zeros(8, dtype=torch.uint8)]]),
        ("pickled-value", ["td", [["x", 0, _Evil()]], []]),
        ("streamed-sent-inline", ["td", _BIG[1], [torch.zeros(2_400_000, dtype=torch.uint8)]]),
        # values whose repr() raises, where the receiver quotes what it got
        ("bigint-message", ["td", _HUGE_INT]),
        ("bigint-dim", ["td", [["x", 1, ["cpu", "float32", [_HUGE_INT], 0]]], []]),
        ("bigint-key-of-a-short-piece", ["td", [[_HUGE_INT, 1, f32]],
                                         [torch.zeros(4, dtype=torch.float64)]]),
    ]


#: An int whose repr() raises ValueError (CPython's int-to-str limit).
_HUGE_INT = 10**5000


#: A dict header whose one tensor (2.4 MB) must follow in parts.
_BIG = ["td", [["x", 1, ["cpu", "float32", [600_000], 0]]], []]


#: Handle fields rank 0 changes in an honest link's handle: each must be refused.
_CRAFTED = {
    "tcp-control": {"local_ctl": "tcp://127.0.0.1:9"},
    "tcp-endpoints": {"remote_pub": "tcp://127.0.0.1:9", "remote_ctl": "tcp://127.0.0.1:9"},
    "other-host": {"writer_host": "gpu-node-77.elsewhere"},
    "other-process": {"writer_pid": 1},
    "outside-channel-dir": {"local_pub": "ipc:///tmp/elsewhere/p"},
    "zero-chunks": {"max_chunks": 0},
    "no-segment": {"segment": None},
    "two-readers": {"n_reader": 2},
}
_OFFER_NAMES = ["garbage-handle", "no-magic", "magic-not-a-str", "bigint-offer",
                "bigint-handle", *_CRAFTED]


def _crafted_offers(q: Any) -> list[Any]:
    """Offers rank 1 must refuse before opening anything, in :data:`_OFFER_NAMES` order."""
    import msgspec

    from coordinator.p2p.link_offer import MAGIC

    h = q.export_handle()
    return [[MAGIC, b"\x93garbage"], ["not-it", None], [np.zeros(2), None], _HUGE_INT,
            [MAGIC, _HUGE_INT],
            *([MAGIC, msgspec.structs.replace(h, **kw).to_bytes()] for kw in _CRAFTED.values())]


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pickle.loads called on bytes from a peer")


def _refused(g: Any, expected: type, name: str) -> list[str]:
    """``[]`` when rank 0's next dict raises ``expected`` here, else what happened."""
    try:
        got = g.recv_tensor_dict(0)
        return [f"{name}: decoded {got!r:.100}"]
    except expected:
        return []
    except Exception as e:
        return [f"{name}: {type(e).__name__} (expected {expected.__name__}): {e}"]


def _attacker_queue(reader: int) -> Any:
    """A link-shaped queue of rank 0's own, which (unlike the group's) may pickle."""
    from coordinator.p2p.shm_links import CHUNK_BYTES, CHUNKS
    from shm_broadcast.queue.message_queue import MessageQueue

    return MessageQueue(1, 1, local_reader_ranks=[reader], max_chunk_bytes=CHUNK_BYTES,
                        max_chunks=CHUNKS, allow_pickle=True)


def hostile_link(rank: int, n: int) -> list[str]:
    """Rank 0 sends crafted offers, then offers a pickle-enabled link of its own
    and writes malformed messages on it; rank 1 must raise DecodeError for each,
    never unpickle, and read the honest dict that follows."""
    from coordinator.errors import DecodeError
    from coordinator.p2p.link_offer import MAGIC

    g = _group(rank, n, "hostile-link")
    fails: list[str] = []
    loads, pickle.loads = pickle.loads, _refuse
    try:
        if rank == 0:
            q = _attacker_queue(1)
            for offer in _crafted_offers(q):
                g._objects.send(offer, 1, LINK_OFFER)
            g._objects.send([MAGIC, q.export_handle().to_bytes()], 1, LINK_OFFER)
            q.wait_until_ready(30)
            for _, msg in _hostile_messages():
                q.enqueue(msg)
            q.enqueue(["td", [["ok", 0, 7], ["t", 2, torch.arange(3)]], []])
            g.barrier()
            q.close()
            return fails
        for name in [*_OFFER_NAMES, *(name for name, _ in _hostile_messages())]:
            fails += _refused(g, DecodeError, name)
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


_BAD_PARTS = {
    "part-of-wrong-dtype": ["part", torch.zeros(10, dtype=torch.int32)],
    "part-too-long": ["part", torch.zeros(2_400_001, dtype=torch.uint8)],
    "part-2d": ["part", torch.zeros(2, 5, dtype=torch.uint8)],
    "part-too-short": ["part", torch.zeros(1000, dtype=torch.uint8)],  # honest parts are full
    "dict-instead-of-part": ["td", [], []],
    "pickled-part": ["part", _Evil()],
}


def hostile_stream(rank: int, n: int, bad: str) -> list[str]:
    """A dict header announcing a streamed tensor, then a bad part: DecodeError, and
    the direction is closed from then on (ClosedError), its order being lost."""
    from coordinator.errors import ClosedError, DecodeError
    from coordinator.p2p.link_offer import MAGIC

    g = _group(rank, n, "hostile-stream")
    loads, pickle.loads = pickle.loads, _refuse
    try:
        if rank == 0:
            q = _attacker_queue(1)
            g._objects.send([MAGIC, q.export_handle().to_bytes()], 1, LINK_OFFER)
            q.wait_until_ready(30)
            q.enqueue(_BIG)
            q.enqueue(_BAD_PARTS[bad])
            g.barrier()
            q.close()
            return []
        out = _refused(g, DecodeError, "bad part") + _refused(g, ClosedError, "next receive")
        g.barrier()
        return out
    finally:
        pickle.loads = loads
        g.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", sorted(_BAD_PARTS))
def test_a_bad_part_is_refused_and_closes_the_direction(dist_pool, bad):
    assert dist_pool(2).run(hostile_stream, bad, timeout=100) == [[], []]


#: Dict headers claiming more bytes than any host holds (under the 62-bit
#: bound of a tensor's size): refused before a byte is allocated or awaited.
_CLAIMS = {
    "one-tensor-of-1PiB": [1 << 50],
    "64-tensors-of-256GiB": [1 << 38] * 64,
}


def hostile_claim(rank: int, n: int, case: str) -> list[str]:
    """A header claiming :data:`_CLAIMS` bytes, one full part, then an honest dict:
    DecodeError at once for the header (nothing allocated, no wait for parts),
    DecodeError for the stray part, then the honest dict arrives."""
    from coordinator.errors import DecodeError
    from coordinator.p2p.link_messages import PART_BYTES
    from coordinator.p2p.link_offer import MAGIC

    g = _group(rank, n, "hostile-claim", timeout=20)
    try:
        if rank == 0:
            q = _attacker_queue(1)
            g._objects.send([MAGIC, q.export_handle().to_bytes()], 1, LINK_OFFER)
            q.wait_until_ready(30)
            q.enqueue(["td", [[f"x{i}", 1, ["cpu", "uint8", [c], 0]]
                              for i, c in enumerate(_CLAIMS[case])], []])
            q.enqueue(["part", torch.zeros(PART_BYTES, dtype=torch.uint8)])
            q.enqueue(["td", [["ok", 0, 7]], []])
            g.barrier()
            q.close()
            return []
        t0 = time.monotonic()
        out = _refused(g, DecodeError, "the claim")
        if time.monotonic() - t0 > 5:
            out.append(f"the claim was refused after {time.monotonic() - t0:.1f} s")
        out += _refused(g, DecodeError, "the stray part")
        got = g.recv_tensor_dict(0)
        if got != {"ok": 7}:
            out.append(f"honest dict after the claim: {got!r:.100}")
        g.barrier()
        return out
    finally:
        g.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(_CLAIMS))
def test_a_claim_beyond_the_hosts_memory_is_refused(dist_pool, case):
    assert dist_pool(2).run(hostile_claim, case, timeout=100) == [[], []]


def _victim_queue() -> Any:
    """A link-shaped queue of rank 1's own, for rank 1 alone to read (not yet attached)."""
    return _attacker_queue(1)


def _foreign_handle(case: str, own: Any, victim: Any) -> Any:
    """Rank 0's link handle, with the part ``case`` names taken from ``victim``'s."""
    v = victim
    fields = {
        "someone-elses-segment": {"segment": v.segment},
        "someone-elses-channel-dir": {"bell_prefix": v.bell_prefix, "local_pub": v.local_pub,
                                      "local_ctl": v.local_ctl},
        "both": {"segment": v.segment, "bell_prefix": v.bell_prefix,
                 "local_pub": v.local_pub, "local_ctl": v.local_ctl},
    }[case]
    return _replace(own, **fields)


#: Offers built on another process's queue (rank 1's own victim queue), a ring
#: whose header disagrees with its handle, and an offer replayed from another group.
_FOREIGN = ["someone-elses-segment", "someone-elses-channel-dir", "both",
            "ring-of-larger-chunks", "ring-of-more-chunks", "replayed-offer"]


def foreign_offer(rank: int, n: int, case: str) -> list[str]:
    """Rank 0 offers ``case``; rank 1 must refuse it with DecodeError at once,
    leave the victim queue untouched, and take rank 0's honest link next."""
    from coordinator.errors import DecodeError
    from coordinator.p2p.channels import SEND
    from coordinator.p2p.link_offer import MAGIC
    from coordinator.p2p.shm_links import CHUNK_BYTES, CHUNKS
    from shm_broadcast.queue.handle import Handle
    from shm_broadcast.queue.message_queue import MessageQueue
    from shm_broadcast.queue.ring_buffer import READER_EMPTY

    g = _group(rank, n, "foreign-offer", timeout=20)
    other = _group(rank, n, "foreign-offer-b", timeout=20) if case == "replayed-offer" else None
    out: list[str] = []
    try:
        if rank == 0:
            q = None
            if case == "replayed-offer":  # rank 0's honest link of the other group
                other.send_tensor_dict({"settle": 1}, 1)
                offer = other._p2p.links._settled[(SEND, 1)].export_handle()
            elif case.startswith("ring-of"):
                shape = ({"max_chunk_bytes": CHUNK_BYTES * 4} if case == "ring-of-larger-chunks"
                         else {"max_chunks": CHUNKS * 2})
                q = MessageQueue(1, 1, local_reader_ranks=[1], **shape)
                offer = _replace(q.export_handle(), max_chunk_bytes=CHUNK_BYTES,
                                 max_chunks=CHUNKS)
            else:
                victim = Handle.from_bytes(g.recv_object(1))
                q = _attacker_queue(1)
                offer = _foreign_handle(case, q.export_handle(), victim)
            g._objects.send([MAGIC, offer.to_bytes()], 1, LINK_OFFER)
            g.barrier()
            g.send_tensor_dict({"honest": torch.arange(3)}, 1)
            if other is not None:
                other.send_tensor_dict({"still": 2}, 1)
            g.barrier()
            if q is not None:
                q.close()
            return out
        victim = None
        if case.startswith("some") or case == "both":
            victim = _victim_queue()
            g.send_object(victim.export_handle().to_bytes(), 0)
            vdir = victim.export_handle().bell_prefix
            before = sorted(os.listdir(vdir))
        elif other is not None:
            other.recv_tensor_dict(0)
        t0 = time.monotonic()
        out += _refused(g, DecodeError, case)
        if time.monotonic() - t0 > 5:
            out.append(f"refused after {time.monotonic() - t0:.1f} s")
        if victim is not None:
            if victim._impl.ring.reader_state(0) != READER_EMPTY:
                out.append("rank 1 took the victim queue's reader slot")
            if sorted(os.listdir(vdir)) != before:
                out.append(f"the victim's channel directory changed: {before} -> "
                           f"{sorted(os.listdir(vdir))}")
        g.barrier()
        got = g.recv_tensor_dict(0)
        if list(got) != ["honest"] or not torch.equal(got["honest"], torch.arange(3)):
            out.append(f"honest dict after the offer: {got!r:.100}")
        if other is not None and other.recv_tensor_dict(0) != {"still": 2}:
            out.append("the replayed link's own group lost its link")
        g.barrier()
        if victim is not None:
            victim.close()
        return out
    finally:
        g.destroy()
        if other is not None:
            other.destroy()


def _replace(h: Any, **fields: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(h, **fields)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", _FOREIGN)
def test_an_offer_of_another_queue_is_refused(dist_pool, case):
    assert dist_pool(2).run(foreign_offer, case, timeout=100) == [[], []]


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
    except Exception as e:
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
    g = _group(rank, n, "silent-link", timeout=1.5)
    try:
        if rank == 0:
            g.send_tensor_dict({"x": torch.ones(2)}, 1)
            time.sleep(3.0)
            return {}
        g.recv_tensor_dict(0)
        return timeout_outcome(lambda: g.recv_tensor_dict(0))
    finally:
        g.destroy()


def timeout_outcome(call: Any) -> dict[str, Any]:
    """Run ``call``: ``{"error": "none"}``, or what the CommTimeout it raised said
    (text, peers) and after how many seconds."""
    from coordinator.errors import CommTimeout

    t0 = time.monotonic()
    try:
        call()
        return {"error": "none"}
    except CommTimeout as e:
        return {"error": "CommTimeout", "msg": str(e), "peers": list(e.peers),
                "s": time.monotonic() - t0}


@pytest.mark.timeout(120)
def test_a_silent_sender_times_out_by_name(dist_pool):
    res = dist_pool(2).run(silent_sender, timeout=100)[1]
    assert res["error"] == "CommTimeout", res
    assert "recv_tensor_dict" in res["msg"] and "silent-link" in res["msg"], res
    assert 0 in res["peers"], res
    assert 1.2 < res["s"] < 20, res


def _death_outcome(call: Any) -> dict[str, Any]:
    """How ``call`` ended: PeerDiedError (its peers and message) or what else, and when."""
    from coordinator.errors import PeerDiedError

    t0 = time.monotonic()
    try:
        call()
        out: dict[str, Any] = {"error": "none"}
    except PeerDiedError as e:
        out = {"error": "PeerDiedError", "peers": list(e.peers), "msg": str(e)}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    out["s"] = time.monotonic() - t0
    return out


def peer_killed(rank: int, n: int, case: str) -> dict[str, Any]:
    """``sender-after-a-dict``: rank 0 SIGKILLs itself after one dict, rank 1's next
    receive must name it. ``receiver-while-settling``: rank 1 takes rank 0's link
    offer and is killed before it attaches, rank 0's send must name it. Both well
    before the group's timeout."""
    g = _group(rank, n, f"killed-{case}", timeout=60)
    if case == "sender-after-a-dict":
        if rank == 0:
            g.send_tensor_dict({"x": torch.ones(2)}, 1)
            g.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        g.recv_tensor_dict(0)
        g.barrier()
        out = _death_outcome(lambda: g.recv_tensor_dict(0))
    else:
        if rank == 1:
            g._objects.recv(0, LINK_OFFER)
            os.kill(os.getpid(), signal.SIGKILL)
        out = _death_outcome(lambda: g.send_tensor_dict({"x": torch.ones(3)}, 1))
    g.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,victim,op", [
    pytest.param("sender-after-a-dict", 0, "recv_tensor_dict", id="sender-after-a-dict"),
    pytest.param("receiver-while-settling", 1, "send_tensor_dict", id="receiver-while-settling",
                 marks=pytest.mark.slow),  # CI time: one death per run by default
])
def test_a_dead_peer_is_named(case, victim, op):
    outcomes = spawn_group(peer_killed, 2, (case,), timeout=90)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    res = outcomes[1 - victim]
    assert res.ok, res.error
    assert res.result["error"] == "PeerDiedError", res.result
    assert victim in res.result["peers"] and op in res.result["msg"], res.result
    assert res.result["s"] < 15, res.result


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


def late_receiver_mid_stream(rank: int, n: int) -> list[str]:
    """A dict larger than the ring times out partway (the receiver is late): the
    sender's next dict must not be misread as the rest of it. Both sides raise
    ClosedError on that direction from then on."""
    from coordinator.errors import ClosedError, CommTimeout

    g = _group(rank, n, "mid-stream", timeout=1.5)
    out: list[str] = []

    def expect(kind: type, fn: Any, what: str) -> None:
        try:
            got = fn()
            out.append(f"{what}: returned {got!r:.60}")
        except kind:
            pass
        except Exception as e:
            out.append(f"{what}: {type(e).__name__} (expected {kind.__name__}): {e}")

    try:
        if rank == 0:
            g.send_tensor_dict({"settle": 1}, 1)
            expect(CommTimeout, lambda: g.send_tensor_dict(
                {"big": torch.zeros(3 << 20)}, 1), "big send")
            expect(ClosedError, lambda: g.send_tensor_dict({"small": 7}, 1), "next send")
        else:
            g.recv_tensor_dict(0)
            time.sleep(2.5)
            expect(ClosedError, lambda: g.recv_tensor_dict(0), "big receive")
            expect(ClosedError, lambda: g.recv_tensor_dict(0), "next receive")
        time.sleep(0.5)
        return out
    finally:
        g.destroy()


@pytest.mark.timeout(120)
def test_a_dict_cut_short_closes_the_direction(dist_pool):
    assert dist_pool(2).run(late_receiver_mid_stream, timeout=100) == [[], []]


def parameters_on_a_link(rank: int, n: int) -> list[Any]:
    """Rank 0 offers a link of its own and writes tensors its codec marks as
    requiring grad or as Parameters: a lone tensor for ``recv`` arrives plain (a
    lone Parameter is no tensor message: DecodeError), and a dict's inline
    Parameter arrives plain too."""
    from coordinator.errors import DecodeError
    from coordinator.p2p.link_offer import MAGIC

    g = _group(rank, n, "param-link")
    try:
        if rank == 0:
            q = _attacker_queue(1)
            g._objects.send([MAGIC, q.export_handle().to_bytes()], 1, LINK_OFFER)
            q.wait_until_ready(30)
            q.enqueue(["t1", torch.arange(3.0).requires_grad_()])
            q.enqueue(["t1", torch.nn.Parameter(torch.arange(3.0), requires_grad=False)])
            q.enqueue(["td", [["t", 2, torch.nn.Parameter(torch.ones(2), requires_grad=False)],
                              ["u", 2, torch.nn.Parameter(torch.ones(1))]], []])
            g.barrier()
            q.close()
            return []
        got = [g.recv(torch.Size([3]), torch.float32, 0)]
        with contextlib.suppress(DecodeError):  # the lone Parameter
            got.append(g.recv(torch.Size([3]), torch.float32, 0))
        got += g.recv_tensor_dict(0).values()
        g.barrier()
        return [(type(t).__name__, t.requires_grad, t.tolist()) for t in got]
    finally:
        g.destroy()


@pytest.mark.timeout(120)
def test_tensors_a_peer_marks_as_parameters_arrive_plain(dist_pool):
    got = dist_pool(2).run(parameters_on_a_link, timeout=100)
    assert got == [[], [("Tensor", False, [0.0, 1.0, 2.0]), ("Tensor", False, [1.0, 1.0]),
                        ("Tensor", False, [1.0])]]
