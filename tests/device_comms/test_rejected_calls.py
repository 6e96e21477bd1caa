"""A rank that rejects its own arguments does not leave its peers waiting.

Only one rank passes a wrong argument (its own size entry, the broadcast
source's tensor...). It raises its TypeError/ValueError; the peers, which made
the same call validly, raise PeerRejectedError naming that rank within a
second or two, and the group keeps working. Shared memory and plain gloo,
2 and 3 ranks, every rank as the offender.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import (
    CollectiveMismatch,
    CommunicatorClosed,
    CpuCommunicator,
    DeviceCommError,
    DeviceCommunicator,
    PeerRejectedError,
    TorchDistributedCommunicator,
)


def test_peer_rejected_error_is_in_the_family() -> None:
    assert issubclass(PeerRejectedError, CollectiveMismatch)
    assert issubclass(PeerRejectedError, DeviceCommError)
    assert issubclass(PeerRejectedError, ValueError)
    e = PeerRejectedError("g", "broadcast", 2, "ValueError: input_ must be contiguous")
    assert "rank 2" in str(e) and "contiguous" in str(e) and "Fix the call on rank 2" in str(e)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_rank_rejects_and_peers_raise_promptly(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(rejected_calls, timeout=75)
    n = world_size
    for rank, out in enumerate(outs):
        assert out["mode"] == "shm"
        for path in ("shm", "gloo"):
            for name, (_, word) in CASES.items():
                for bad in range(n):
                    got, total, bcast = out[f"{path}|{name}|{bad}"]
                    where = f"{path} {name} offender {bad}, rank {rank}"
                    if rank == bad:
                        assert got[0] in ("ValueError", "TypeError"), f"{where}: {got}"
                        assert word in got[1], f"{where}: {got[1]!r} lacks {word!r}"
                    else:
                        assert got[0] == "PeerRejectedError", f"{where}: {got}"
                        assert got[3] == bad and f"rank {bad}" in got[1], f"{where}: {got[1]}"
                        assert word in got[1], f"{where}: reason missing in {got[1]!r}"
                        assert got[2] < 2.0, f"{where}: took {got[2]:.2f}s"
                    assert total == [float(n)] * 2, f"{where}: next all_reduce gave {total}"
                    assert bcast == [float(bad)] * 2, f"{where}: next broadcast gave {bcast}"
            assert "src" in out[f"{path}|agreed"], out[f"{path}|agreed"]
            want = [float(r) for r in range(n) for _ in range(r + 1)]
            assert out[f"{path}|final"] == want, (path, out[f"{path}|final"])


# ---------------------------------------------------------------------- on the ranks
# One rank passes arguments only it can see are wrong; its peers make the same
# call with valid arguments. Each rank records what it raised and how long it
# took, then runs valid collectives to show the group still works.
Call = Callable[[DeviceCommunicator, int, int, int], Any]


def _gatherv(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    rows = 3 if rank == bad else 2  # own entry of the agreed sizes is 2
    return comm.all_gatherv(torch.ones(rows, 4), 0, [2] * n)


def _gatherv_list(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    second = torch.ones(1 if rank == bad else 2, 4)  # only the second tensor is wrong
    return comm.all_gatherv([torch.ones(2, 4), second], 0, [2] * n)


def _bcast_noncontig_src(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    x = torch.arange(12.0).reshape(4, 3)
    buf = x.t() if rank == bad else torch.zeros(3, 4)  # bad is the source
    return comm.broadcast(buf, bad)


def _bcast_not_tensor_src(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    return comm.broadcast([1.0, 2.0] if rank == bad else torch.zeros(2), bad)


def _bcast_noncontig_receiver(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    src = (bad + 1) % n
    buf = torch.zeros(4, 3).t() if rank == bad else torch.zeros(3, 4)
    return comm.broadcast(buf, src)


def _rsv_own_total(comm: DeviceCommunicator, rank: int, n: int, bad: int) -> Any:
    rows = n + 1 if rank == bad else n  # sizes sum to n on every rank
    return comm.reduce_scatterv(torch.ones(rows, 2), 0, [1] * n)


CASES: dict[str, tuple[Call, str]] = {  # name -> (call, word the offending rank's error names)
    "all_gatherv/own-size": (_gatherv, "sizes["),
    "all_gatherv/own-size-list": (_gatherv_list, "input_[1]"),
    "broadcast/src-non-contiguous": (_bcast_noncontig_src, "contiguous"),
    "broadcast/src-not-tensor": (_bcast_not_tensor_src, "input_"),
    "broadcast/receiver-non-contiguous": (_bcast_noncontig_receiver, "contiguous"),
    "reduce_scatterv/own-total": (_rsv_own_total, "sizes"),
}


def rejected_calls(rank: int, world_size: int) -> dict[str, Any]:
    """Every case with every rank as the offender, on the shm and the plain gloo path."""
    world = dist.group.WORLD
    comms = {
        "shm": CpuCommunicator(world, torch.device("cpu"), unique_name="rej-shm"),
        "gloo": TorchDistributedCommunicator(world, torch.device("cpu"), unique_name="rej-gloo"),
    }
    out: dict[str, Any] = {"mode": comms["shm"].mode}
    n = world_size
    for path, comm in comms.items():
        for name, (call, _) in CASES.items():
            for bad in range(n):
                t0 = time.monotonic()
                try:
                    call(comm, rank, n, bad)
                    got: tuple = ("none", "", 0.0)
                except PeerRejectedError as e:
                    got = ("PeerRejectedError", str(e), time.monotonic() - t0, e.rank)
                except (TypeError, ValueError) as e:
                    got = (type(e).__name__, str(e), time.monotonic() - t0)
                # The group still works: a reduction and a data-moving op.
                total = comm.all_reduce(torch.ones(2)).tolist()
                b = torch.full((2,), float(rank))
                comm.broadcast(b, bad)
                out[f"{path}|{name}|{bad}"] = (got, total, b.tolist())
        # Agreed bad arguments (every rank rejects): each raises its own error.
        try:
            comm.broadcast(torch.zeros(2), n)
            out[f"{path}|agreed"] = "none"
        except ValueError as e:
            out[f"{path}|agreed"] = str(e)
        out[f"{path}|final"] = comm.all_gatherv(torch.full((rank + 1,), float(rank)), 0,
                                                list(range(1, n + 1))).tolist()
    for comm in comms.values():
        comm.destroy()
    return out


# ------------------------------------------- lists of different lengths (all_gatherv)
def list_lengths(rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``odd`` passes a shorter list (one tensor, or none); the others two.
    Before the count was agreed, the short rank returned after its own calls
    and the others waited for calls it never made."""
    world = dist.group.WORLD
    comms = {
        "shm": CpuCommunicator(world, torch.device("cpu"), unique_name="len-shm"),
        "gloo": TorchDistributedCommunicator(world, torch.device("cpu"), unique_name="len-gloo"),
    }
    out: dict[str, Any] = {}
    for path, comm in comms.items():
        for odd in range(world_size):
            for short in (1, 0):
                xs = [torch.full((2,), float(rank)) for _ in range(short if rank == odd else 2)]
                t0 = time.monotonic()
                try:
                    comm.all_gatherv(xs, 0)
                    got: tuple = ("none", "", 0.0)
                except CollectiveMismatch as e:
                    got = (type(e).__name__, str(e), time.monotonic() - t0)
                total = comm.all_reduce(torch.ones(2)).tolist()
                out[f"{path}|{odd}|{short}"] = (got, total)
        same = comm.all_gatherv([torch.full((1,), float(rank))] * 2, 0)
        out[f"{path}|same"] = [t.tolist() for t in same]
    for comm in comms.values():
        comm.destroy()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lists_of_different_lengths_raise_on_every_rank(dist_pool, world_size: int) -> None:
    outs = dist_pool(world_size).run(list_lengths, timeout=75)
    for rank, out in enumerate(outs):
        for path in ("shm", "gloo"):
            for odd in range(world_size):
                for short in (1, 0):
                    (kind, text, took), total = out[f"{path}|{odd}|{short}"]
                    where = f"{path} odd rank {odd} short {short}, rank {rank}"
                    assert kind == "CollectiveMismatch", f"{where}: {kind} {text}"
                    assert "lists of" in text and took < 2.0, f"{where}: {text} {took:.2f}s"
                    assert total == [float(world_size)] * 2, f"{where}: then {total}"
            assert out[f"{path}|same"] == [[float(r) for r in range(world_size)]] * 2


# -------------------------------- the public reject of a send/recv (DeviceCommunicator.reject)
def public_p2p_reject(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 rejects its send to 1 while 1 receives; then rank 1 rejects its receive
    from 0 while 0 sends. Then a good transfer each way, the arguments ``reject``
    refuses, and a closed communicator."""
    world = dist.group.WORLD
    comms = {
        "shm": CpuCommunicator(world, torch.device("cpu"), unique_name="prej-shm"),
        "gloo": TorchDistributedCommunicator(world, torch.device("cpu"), unique_name="prej-gloo"),
    }
    out: dict[str, Any] = {"mode": comms["shm"].mode}
    peer = 1 - rank
    for path, comm in comms.items():
        for rejecter, op in ((0, "send"), (1, "recv")):
            t0 = time.monotonic()
            try:
                if rank == rejecter:
                    err = ValueError(f"{op} argument bad on purpose")
                    comm.reject(op, err, peer)
                    got: tuple = ("told", getattr(err, "__notes__", []))
                elif op == "send":
                    comm.recv((2,), torch.float32, rejecter)
                    got = ("none",)
                else:
                    comm.send(torch.ones(2), rejecter)
                    got = ("none",)
            except PeerRejectedError as e:
                got = ("PeerRejectedError", str(e), e.rank, time.monotonic() - t0)
            out[f"{path}|{op}"] = got
        # The pair still works, both ways.
        for src in (0, 1):
            if rank == src:
                comm.send(torch.arange(3.0) + src, 1 - src)
            else:
                out[f"{path}|after|{src}"] = comm.recv((3,), torch.float32, src).tolist()
        err = ValueError("x")
        refused: dict[str, str] = {}
        for name, args in {
            "op-type": (1, err),
            "op-unknown": ("all_reducee", err),
            "error-type": ("send", "not an exception", peer),
            "peer-missing": ("recv", err),
            "peer-self": ("send", err, rank),
            "peer-outside": ("send", err, 2),
            "peer-type": ("recv", err, True),
            "peer-on-collective": ("all_reduce", err, peer),
        }.items():
            try:
                comm.reject(*args)
                refused[name] = "none"
            except (TypeError, ValueError) as e:
                refused[name] = f"{type(e).__name__}: {e}"
        try:
            comm.number_calls(5)
            refused["number_calls"] = "none"
        except TypeError as e:
            refused["number_calls"] = f"TypeError: {e}"
        out[f"{path}|refused"] = refused
        comm.destroy()
        try:
            comm.reject("send", err, peer)
            out[f"{path}|closed"] = "none"
        except CommunicatorClosed as e:
            out[f"{path}|closed"] = f"closed: {e}"
    return out


@pytest.mark.timeout(90)
def test_public_reject_of_a_send_or_recv_makes_the_peer_raise(dist_pool) -> None:
    outs = dist_pool(2).run(public_p2p_reject, timeout=75)
    for rank, out in enumerate(outs):
        assert out["mode"] == "shm"
        for path in ("shm", "gloo"):
            for rejecter, op in ((0, "send"), (1, "recv")):
                got = out[f"{path}|{op}"]
                where = f"{path} {op} rejected by rank {rejecter}, rank {rank}"
                if rank == rejecter:
                    assert got == ("told", []), f"{where}: {got}"
                else:
                    assert got[0] == "PeerRejectedError", f"{where}: {got}"
                    assert got[2] == rejecter and f"rank {rejecter}" in got[1], f"{where}: {got}"
                    assert f"{op} argument bad on purpose" in got[1], f"{where}: {got[1]}"
                    assert got[3] < 5.0, f"{where}: took {got[3]:.2f}s"
            if rank == 1:
                assert out[f"{path}|after|0"] == [0.0, 1.0, 2.0]
            else:
                assert out[f"{path}|after|1"] == [1.0, 2.0, 3.0]
            refused = out[f"{path}|refused"]
            want = {
                "op-type": ("TypeError", "op"),
                "op-unknown": ("ValueError", "'all_reducee'"),
                "error-type": ("TypeError", "error must be an exception"),
                "peer-missing": ("ValueError", "peer is required"),
                "peer-self": ("ValueError", "is this rank"),
                "peer-outside": ("ValueError", "peer"),
                "peer-type": ("TypeError", "peer"),
                "peer-on-collective": ("ValueError", "peer is only for"),
                "number_calls": ("TypeError", "source must be callable"),
            }
            for name, (kind, word) in want.items():
                assert refused[name].startswith(kind) and word in refused[name], (
                    f"{path} {name}, rank {rank}: {refused[name]}")
            assert out[f"{path}|closed"].startswith("closed: "), out[f"{path}|closed"]
