"""The CPU transports the communicator tests run an op on, built by name.

``shm`` (the shared-memory engine), ``shm-pieces`` (the same with tiny slots,
so most calls take many windows), ``hier`` (:class:`CpuCommunicator` told
that the ranks sit on two nodes), ``gloo`` (plain
:class:`TorchDistributedCommunicator`) and ``cuda-standin``
(:class:`CudaCommunicator`'s hooks over the gloo stand-in for NCCL).
"""

from __future__ import annotations

from typing import Any

import torch

from device_comms import CpuCommunicator, TorchDistributedCommunicator

__all__ = ["TINY_WS", "make_comm"]

TINY_WS = 4 << 10  # slots of a few hundred bytes: "shm-pieces"


def make_comm(transport: str, rank: int, n: int, pg: Any, name: str) -> Any:
    """A communicator of ``transport`` over ``pg`` (rank ``rank`` of ``n``)."""
    cpu = torch.device("cpu")
    if transport == "shm":
        return CpuCommunicator(pg, cpu, unique_name=name, timeout=20)
    if transport == "shm-pieces":
        return CpuCommunicator(pg, cpu, unique_name=name, workspace_bytes=TINY_WS, timeout=20)
    if transport == "hier":
        return CpuCommunicator(pg, cpu, unique_name=name, node_id=f"h{rank * 2 // n}",
                               workspace_bytes=TINY_WS, timeout=20)
    if transport == "gloo":
        return TorchDistributedCommunicator(pg, cpu, unique_name=name)
    if transport == "cuda-standin":
        return _cuda_standin(pg, f"{name}-cuda")
    raise ValueError(f"unknown transport {transport!r}")


def _cuda_standin(pg: Any, name: str) -> Any:
    """CudaCommunicator over the gloo stand-in for NCCL (see the pynccl tests); its
    ``fake`` records the NCCL calls."""
    from device_comms import CudaCommunicator
    from device_comms.cuda.pynccl import PyNcclCommunicator
    from tests.device_comms.cuda.pynccl._gloo_nccl import GlooNccl

    class CpuCuda(CudaCommunicator):
        def _make_pynccl(self) -> PyNcclCommunicator:
            self.fake = GlooNccl(self.cpu_group)
            return PyNcclCommunicator(self.cpu_group, self.device, library=self.fake)

    return CpuCuda(pg, torch.device("cpu"), unique_name=name, use_custom_allreduce=False)
