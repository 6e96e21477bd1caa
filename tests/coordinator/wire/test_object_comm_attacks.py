"""A hostile peer on the CPU group against the object paths of GroupCoordinator.

Rank 0 plays the attacker with raw gloo sends (headers and payloads of its
choosing); rank 1 receives with the ordinary ``recv_object`` /
``recv_tensor_dict`` / ``broadcast_object``. Every attack must end in
:class:`DecodeError` on rank 1 before it allocates what was claimed, pickled
payloads are never loaded, and the group keeps working afterwards.
"""

from __future__ import annotations

import pickle
import tracemalloc
from typing import Any

import pytest
import torch

_GIB = 1 << 30


def _send_raw(header: list[int], payload: bytes, dst: int, group: Any) -> None:
    """What a hostile member of ``group`` can send: any header, any payload."""
    import torch.distributed as dist

    dist.send(torch.tensor(header, dtype=torch.int64), dst=dst, group=group)
    if payload:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=dst, group=group)


def _encoded(obj: Any, allow_pickle: bool = False) -> tuple[list[int], bytes]:
    from shm_broadcast.codec.message_codec import Codec

    enc = Codec(allow_pickle=allow_pickle).encode(obj)
    return [len(enc.msg), enc.blob_len], bytes(enc.msg) + bytes(enc.blob_bytes())


def _attacks() -> list[tuple[str, list[int], bytes]]:
    """``(name, header, payload)`` of each hostile message rank 0 sends (a header
    of two words gets the kind its receiving call waits for)."""
    from shm_broadcast.codec import wire_format as wf

    tensor_1gib = wf.TENSOR_HEAD.pack(0, 0, 0, 0, 1) + (_GIB // 4).to_bytes(8, "little")
    import msgspec

    lie = msgspec.msgpack.encode(msgspec.msgpack.Ext(wf.EXT_TENSOR, tensor_1gib))
    pickled_header, pickled = _encoded(_Evil(), allow_pickle=True)
    td_header, td = _encoded([["x", 1, ["cpu", "float32", [-4], 0]]])
    # More bytes than any host holds, under the 62-bit bound of one tensor.
    huge_header, huge = _encoded([["x", 1, ["cpu", "uint8", [1 << 50], 0]]])
    return [
        ("negative-size", [-5, 0], b""),
        ("huge-size", [1 << 50, 0], b""),
        ("under-1TiB-above-host-memory", [(1 << 40) - 64, 0], b""),
        ("huge-failure-text", [1 << 20, -1], b""),
        ("garbage", [7, 0], b"\xc1\xc1\xc1\xc1\xc1\xc1\xc1"),
        ("30-bytes-claiming-1GiB", [len(lie), 0], lie),
        ("pickle", pickled_header, pickled),
        ("tensor-dict-shape-(-4,)", td_header, td),
        ("tensor-dict-of-1PiB", huge_header, huge),
        ("unknown-kind", [0, 0, 9], b""),
        ("negative-kind", [0, 0, -3], b""),
    ]


class _Evil:
    """Unpickling this would run ``print`` (a stand-in for any code)."""

    def __reduce__(self) -> tuple:
        return (print, ("pwned: code ran in the receiver",))


def hostile_peer(rank: int, world_size: int) -> list[str]:
    """Rank 0 attacks, rank 1 must refuse every message and stay usable."""
    from coordinator.errors import DecodeError
    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.p2p.link_offer import MAGIC
    from coordinator.wire.object_comm import DICT_META, LINK_OFFER, OBJECT

    # A fresh group: the first recv_tensor_dict of a direction reads the sender's
    # link offer over the CPU group (coordinator.p2p.link_offer); the attacker offers none.
    offered = False
    world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name="hostile", timeout=60)
    fails: list[str] = []
    loads, pickle.loads = pickle.loads, _refuse
    try:
        for name, header, payload in _attacks():
            if rank == 0:
                if name.startswith("tensor-dict") and not offered:
                    # Settle the direction on the CPU group, so the attack meets
                    # the metadata checks of that path (not the offer's).
                    world._objects.send([MAGIC, None], 1, LINK_OFFER)
                    offered = True
                kind = DICT_META if name.startswith("tensor-dict") else OBJECT
                _send_raw(header if len(header) == 3 else [*header, kind], payload, dst=1,
                          group=world.cpu_group)
            else:
                recv = (world.recv_tensor_dict if name.startswith("tensor-dict")
                        else world.recv_object)
                tracemalloc.start()
                try:
                    got = recv(0)
                    fails.append(f"{name}: decoded {got!r:.100}")
                except DecodeError:
                    pass
                except Exception as e:
                    fails.append(f"{name}: {type(e).__name__}: {e}")
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                if peak > (64 << 20):
                    fails.append(f"{name}: allocated {peak} bytes before refusing")
            world.barrier()
        # still in step: an ordinary exchange works
        got = world.broadcast_object({"ok": (1, 2)} if rank == 0 else None, 0)
        if got != {"ok": (1, 2)}:
            fails.append(f"after the attacks: {got!r}")
    finally:
        pickle.loads = loads
        world.destroy()
    return fails


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("pickle.loads called on bytes from a peer")


@pytest.mark.timeout(120)
def test_hostile_peer_messages_are_refused_with_decode_error(dist_pool):
    results = dist_pool(2).run(hostile_peer, timeout=100)
    assert results == [[], []]


def claim_without_bytes(rank: int, world_size: int) -> list[Any]:
    """Rank 0 claims a 16 GiB object and sends one piece of it; rank 1's memory
    must grow with that piece, not with the claim, until its wait ends: it
    times out, or sees rank 0's connections close once rank 0 destroyed its
    group."""
    import threading

    import psutil

    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.wire.object_comm import OBJECT, PIECE_BYTES

    world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name="claim", timeout=4)
    out: list[Any] = []
    try:
        if rank == 0:
            _send_raw([16 * _GIB, 0, OBJECT], bytes(PIECE_BYTES), dst=1, group=world.cpu_group)
            world._objects.send("go", 1)  # a later call of the peer: never read as the object
        else:
            proc, peak, done = psutil.Process(), [0], threading.Event()
            before = proc.memory_info().vms

            def sample() -> None:
                while not done.wait(0.005):
                    peak[0] = max(peak[0], proc.memory_info().vms - before)

            watcher = threading.Thread(target=sample)
            watcher.start()
            try:
                world.recv_object(0)
                out.append("returned")
            except Exception as e:
                out.append(type(e).__name__)
            finally:
                done.set()
                watcher.join()
            out.append(peak[0] < 4 * _GIB)
    finally:
        world.destroy()
    return out


@pytest.mark.timeout(90)
def test_a_claimed_size_is_allocated_only_as_its_bytes_arrive(dist_pool):
    from coordinator.errors import ClosedError, CommTimeout

    results = dist_pool(2).run(claim_without_bytes, timeout=80)
    kind, small = results[1]
    assert kind in (CommTimeout.__name__, ClosedError.__name__, "DecodeError") and small, results


def inline_parameters(rank: int, world_size: int) -> list[Any]:
    """Rank 0 sends dict metadata holding inline tensors (which an honest sender puts
    only in queue messages) marked Parameter, one requiring grad; rank 1 receives
    with recv_tensor_dict and irecv_tensor_dict."""
    from coordinator.group.group_coordinator import GroupCoordinator
    from coordinator.p2p.link_offer import MAGIC
    from coordinator.wire.object_comm import DICT_META, LINK_OFFER
    from coordinator.wire.tensor_dict_format import INLINE

    world = GroupCoordinator([list(range(world_size))], rank, "gloo", True,
                             group_name="inline", timeout=60)
    try:
        if rank == 0:
            world._objects.send([MAGIC, None], 1, LINK_OFFER)  # the direction: CPU group
            meta = [["p", INLINE, torch.nn.Parameter(torch.ones(2))],
                    ["q", INLINE, torch.nn.Parameter(torch.ones(3), requires_grad=False)]]
            for _ in range(2):
                world._objects.send(meta, 1, DICT_META)
            return []
        got = [world.recv_tensor_dict(0), world.irecv_tensor_dict(0).wait(30)]
        return [(k, type(t).__name__, t.requires_grad, t.tolist())
                for d in got for k, t in d.items()]
    finally:
        world.destroy()


@pytest.mark.timeout(120)
def test_inline_tensors_of_a_peer_arrive_plain(dist_pool):
    """Receivers get plain tensors outside autograd, whatever the metadata claims
    (the CPU-group path returned the peer's Parameter as it was decoded)."""
    plain = [("p", "Tensor", False, [1.0, 1.0]), ("q", "Tensor", False, [1.0, 1.0, 1.0])]
    assert dist_pool(2).run(inline_parameters, timeout=100) == [[], plain * 2]
