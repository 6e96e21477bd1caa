"""SignedCalls alone, on two real ranks over gloo (no communicator around it).

A collective that both ranks make alike carries its small payloads; one whose
headers differ, or whose call numbers differ, raises CollectiveMismatch on
both ranks; a rank's rejection makes the peer raise PeerRejectedError naming
it. The prologue runs first in every collective, with the header (or the
rejection's reason). Send/recv agree on their side of a direction the same
way. Bad constructor arguments raise TypeError/ValueError naming them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from device_comms import CollectiveMismatch, PeerRejectedError, ReduceOp
from device_comms.signatures.envelopes import as_bytes
from device_comms.signatures.signed_calls import SignedCalls, no_prologue


def _outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except PeerRejectedError as e:
        return ("PeerRejectedError", e.rank, str(e))
    except CollectiveMismatch as e:
        return ("CollectiveMismatch", str(e))


def signed_calls_alone(rank: int, world_size: int) -> dict[str, Any]:
    world = dist.group.WORLD
    seen: list[tuple[str, bool, str | None]] = []

    def prologue(op: str, header: np.ndarray | None, reason: str | None) -> bool:
        seen.append((op, header is None, reason))
        return False

    s = SignedCalls(world, "alone", rank, world_size, prologue=prologue)
    out: dict[str, Any] = {}
    shape = torch.Size([3])

    # A collective both ranks make alike: every rank's small payload arrives.
    mine = torch.full((3,), float(rank + 1))
    h = s.header("all_reduce", torch.float32, ReduceOp.SUM, 0, shape, shape)
    out["same"] = _outcome(s.call, "all_reduce", h, mine)
    out["received"] = [t.tolist() for t in s.received(mine)]
    out["payload"] = s.payload(1 - rank)[:12].view(torch.float32).tolist()
    out["cached"] = s.header("all_reduce", torch.float32, ReduceOp.SUM, 0, shape, shape) is h

    # Headers that differ (dtype): both ranks raise.
    dt = torch.float32 if rank == 0 else torch.float64
    out["dtype"] = _outcome(s.call, "all_reduce", s.header("all_reduce", dt, None, 0, shape, shape))

    # Rank 0 rejects a broadcast; rank 1 makes it.
    hb = s.header("broadcast", torch.float32, None, 0, shape, shape)
    if rank == 0:
        out["reject"] = _outcome(s.reject, "broadcast", "ValueError: input_ is bad")
    else:
        out["reject"] = _outcome(s.call, "broadcast", hb)

    # The group's call numbers: equal ones agree, different ones raise.
    s.number_calls(lambda: 41)
    out["numbered"] = _outcome(s.call, "broadcast", hb)
    s.number_calls(lambda: 42 + rank)
    out["misnumbered"] = _outcome(s.call, "broadcast", hb)
    s.number_calls(None)
    out["own-numbers"] = _outcome(s.call, "broadcast", hb)
    try:
        s.number_calls(7)
        out["number-calls-refused"] = "none"
    except TypeError as e:
        out["number-calls-refused"] = str(e)

    # Send/recv: rank 0 sends to 1 (payload inline), then rank 1 rejects its receive.
    t = torch.arange(4.0)
    hp = s.header("send/recv", torch.float32, None, 0, t.shape, t.shape)
    for label, rejected in (("p2p", False), ("p2p-reject", True)):
        if rank == 0:
            with s.p2p_side("send", 1) as side:
                out[label] = _outcome(s.p2p_call, "send", side, hp, as_bytes(t))
        else:
            with s.p2p_side("recv", 0) as side:
                if rejected:
                    out[label] = _outcome(s.p2p_call, "recv", side, None, None,
                                          "TypeError: dtype is bad")
                else:
                    out[label] = _outcome(s.p2p_call, "recv", side, hp)
                    out["p2p-data"] = side.payload().view(torch.float32).tolist()
    out["prologue"] = seen

    # Arguments the constructor refuses (no communication).
    refused = {}
    for name, kwargs in {
        "name": {"unique_name": 3},
        "rank-type": {"rank": 1.0},
        "rank-range": {"rank": 2},
        "size": {"world_size": 0},
        "prologue": {"prologue": "none"},
        "number": {"call_number": 5},
    }.items():
        args: dict[str, Any] = {"group": world, "unique_name": "x", "rank": rank,
                                "world_size": world_size, "prologue": no_prologue}
        args.update(kwargs)
        try:
            SignedCalls(**args)
            refused[name] = "none"
        except (TypeError, ValueError) as e:
            refused[name] = f"{type(e).__name__}: {e}"
    out["refused"] = refused
    return out


@pytest.mark.timeout(90)
def test_signed_calls_alone_on_two_ranks(dist_pool) -> None:
    outs = dist_pool(2).run(signed_calls_alone, timeout=75)
    for rank, out in enumerate(outs):
        assert out["same"] == ("ok", None)
        assert out["received"] == [[1.0] * 3, [2.0] * 3]
        assert out["payload"] == [float(2 - rank)] * 3
        assert out["cached"]
        assert out["dtype"][0] == "CollectiveMismatch", out["dtype"]
        if rank == 0:
            assert out["reject"] == ("ok", None)
        else:
            kind, who, text = out["reject"]
            assert (kind, who) == ("PeerRejectedError", 0) and "input_ is bad" in text
        assert out["numbered"] == ("ok", None)
        assert out["misnumbered"][0] == "CollectiveMismatch", out["misnumbered"]
        assert out["own-numbers"] == ("ok", None)
        assert "source must be callable" in out["number-calls-refused"]
        assert out["p2p"] == ("ok", False)
        if rank == 0:
            kind, who, text = out["p2p-reject"]
            assert (kind, who) == ("PeerRejectedError", 1) and "dtype is bad" in text
        else:
            assert out["p2p-data"] == [0.0, 1.0, 2.0, 3.0]
            assert out["p2p-reject"] == ("ok", True)  # the rejecting rank raises its own error
        # The prologue saw every collective first (none for send/recv).
        calls = [("all_reduce", False, None), ("all_reduce", False, None)]
        calls += ([("broadcast", True, "ValueError: input_ is bad")] if rank == 0
                  else [("broadcast", False, None)])
        calls += [("broadcast", False, None)] * 3
        assert out["prologue"] == calls
        want = {
            "name": ("TypeError", "unique_name"),
            "rank-type": ("TypeError", "rank"),
            "rank-range": ("ValueError", "rank"),
            "size": ("ValueError", "world_size"),
            "prologue": ("TypeError", "prologue"),
            "number": ("TypeError", "call_number"),
        }
        for name, (kind, word) in want.items():
            assert out["refused"][name].startswith(kind), (name, out["refused"][name])
            assert word in out["refused"][name], (name, out["refused"][name])


def released_signed_calls(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """A communicator of ``kind`` (``torch``: TorchDistributedCommunicator, ``cpu``:
    CpuCommunicator) over a group of its own, used and destroyed with the cyclic
    collector off: is it gone once dropped, and what does its SignedCalls do after
    the release?"""
    import gc
    import weakref

    from device_comms import ClosedError
    from device_comms.cpu.communicator import CpuCommunicator
    from device_comms.torch_dist.torch_communicator import TorchDistributedCommunicator

    cls = CpuCommunicator if kind == "cpu" else TorchDistributedCommunicator
    group = dist.new_group(list(range(world_size)), backend="gloo")
    gc.collect()
    gc.disable()
    try:
        comm = cls(group, torch.device("cpu"), unique_name=f"released-{kind}")
        comm.all_reduce(torch.ones(3))
        if isinstance(comm, CpuCommunicator):
            comm.barrier()
        signed = comm._signed  # the object under test, as the communicator holds it
        alive = weakref.ref(comm)
        comm.destroy()
        del comm
        out: dict[str, Any] = {"freed": alive() is None}
        shape = torch.Size([3])
        h = signed.header("all_reduce", torch.float32, ReduceOp.SUM, 0, shape, shape)
        for label, call in (("call", lambda: signed.call("all_reduce", h)),
                            ("reject", lambda: signed.reject("all_reduce", "ValueError: x"))):
            try:
                call()
                out[label] = "returned"
            except ClosedError as e:
                out[label] = str(e)
        return out
    finally:
        gc.enable()
        dist.destroy_process_group(group)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["torch", "cpu"])
def test_a_destroyed_communicator_is_freed_and_its_signed_calls_refuse(
        dist_pool, world_size: int, kind: str) -> None:
    """Destroy releases the prologue (a bound method of the communicator), so
    nothing holds the communicator in a reference cycle, and a collective that
    still reaches its SignedCalls raises ClosedError before any envelope moves."""
    for out in dist_pool(world_size).run(released_signed_calls, kind, timeout=75):
        assert out["freed"], out
        for label in ("call", "reject"):
            assert f"'released-{kind}' was destroyed during all_reduce" in out[label], out
