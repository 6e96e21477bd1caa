"""Aborting a CUDA communicator from another thread, on CPU processes.

:class:`CudaCommunicator` and :class:`PyNcclCommunicator` run on CPU tensors
with NCCL replaced by the gloo stand-in of
:mod:`tests.device_comms.cuda.pynccl._gloo_nccl`: ``abort(error)`` aborts the
NCCL communicator (``ncclCommAbort``) and breaks the communicator; an abort
waits for a launch in progress on another thread (the launch lock), at most
``LAUNCH_WAIT_S``, then aborts anyway; an abort with nothing in flight does
not wait.
"""

from __future__ import annotations

import threading
from time import monotonic
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CudaCommunicator
from device_comms.cuda.pynccl import PyNcclCommunicator
from device_comms.cuda.pynccl.communicator import LAUNCH_WAIT_S
from device_comms.errors import BrokenCommunicator, CommTimeout, CommunicatorClosed
from tests.device_comms.cuda.pynccl._gloo_nccl import GlooNccl


class _CpuCuda(CudaCommunicator):
    """CudaCommunicator on CPU tensors, NCCL replaced by the gloo stand-in (tests only)."""

    def _make_pynccl(self) -> PyNcclCommunicator:
        self.fake = GlooNccl(self.cpu_group)
        return PyNcclCommunicator(self.cpu_group, self.device, library=self.fake)


def _abort_cases(rank: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = torch.ones(3)
    comm = _CpuCuda(dist.group.WORLD, torch.device("cpu"))
    out["before"] = comm.all_reduce(x).tolist()
    comm.abort(CommTimeout("the watchdog's reason", peers=[1 - rank]))
    out["nccl"] = (comm.fake.closed_with, comm.pynccl is not None and comm.pynccl.closed)
    try:
        comm.all_reduce(x)
    except BrokenCommunicator as e:
        out["next"] = (str(e), list(e.peers))
    comm.destroy()  # nothing left to release
    out["destroyed"] = comm.closed

    nccl = PyNcclCommunicator(dist.group.WORLD, "cpu", library=GlooNccl())
    entered, release = threading.Event(), threading.Event()

    def launch_blocked() -> None:  # holds the launch lock as a launch stuck in NCCL would
        with nccl.grouped():
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=launch_blocked)
    holder.start()
    entered.wait(10)
    t0 = monotonic()
    out["aborted"] = nccl.abort()
    out["waited"] = monotonic() - t0
    release.set()
    holder.join(10)
    out["again"] = nccl.abort()
    try:
        nccl.all_reduce(x)
    except CommunicatorClosed as e:
        out["after"] = str(e)

    lib = GlooNccl()
    free = PyNcclCommunicator(dist.group.WORLD, "cpu", library=lib)
    t0 = monotonic()
    free.abort()
    out["free"] = (monotonic() - t0, lib.closed_with)
    return out


@pytest.mark.timeout(90)
def test_abort_from_another_thread(dist_pool: Any) -> None:
    for rank, r in enumerate(dist_pool(2).run(_abort_cases, timeout=60)):
        assert r["before"] == [2.0] * 3
        assert r["nccl"] == ("abort", True), r
        text, peers = r["next"]
        assert "was aborted" in text and "the watchdog's reason" in text and peers == [1 - rank]
        assert r["destroyed"]
        assert r["aborted"] and not r["again"], r
        assert LAUNCH_WAIT_S - 0.05 <= r["waited"] <= LAUNCH_WAIT_S + 1.0, r["waited"]
        assert "was closed" in r["after"], r
        assert r["free"][0] < LAUNCH_WAIT_S / 2 and r["free"][1] == "abort", r
