"""Rank functions for tests/device_comms/test_rejected_calls.py (module-level, importable).

One rank passes arguments only it can see are wrong; its peers make the same
call with valid arguments. Each rank records what it raised and how long it
took, then runs valid collectives to show the group still works.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, DeviceCommunicator, PeerRejectedError, TorchDistributedCommunicator

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
