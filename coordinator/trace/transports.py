"""Which transport carried a recorded call, named when a dump is written.

A group's :class:`TransportNamer` is its trace's ``transport_of``: it reads
an entry's op (and its peer, shape and dtype) at dump time, so that recording
a call costs nothing for it. It knows the group's communicator only by public
facts captured when the group is built (they hold for the group's life), and
never keeps the communicator itself:

* the CPU communicator (``name == "cpu"``) by its ``mode``: ``"shm"`` (one
  node: the shared-memory engine's ops are ``shm``, ``scatter`` and
  ``all_to_all`` go over ``gloo``), ``"hierarchical"`` (several nodes:
  ``all_reduce`` is ``hierarchical``, the rest ``gloo``) or ``"gloo"``;
* the CUDA communicator (``"cuda"``): ``pynccl``, ``all_reduce`` of a tensor
  its ``custom_ar`` takes (its dtypes, at most ``max_size`` bytes, a multiple
  of 16) ``custom_allreduce``, and ``scatter`` / ``all_to_all``
  (torch.distributed over the device group) ``torch``;
* torch.distributed's communicator (``"torch"``): ``gloo`` on CPU, ``nccl`` over
  an NCCL device group, else ``torch``; any other communicator: ``torch``.

Calls beside the communicator: barriers and objects point to point go over
the CPU group (``gloo``); object broadcasts and tensor-dict metadata over the
CPU communicator of a CPU group (as its ``broadcast``), ``gloo`` on a GPU
group; point-to-point tensors and dicts of a CPU group over the direction's
shared-memory link when it settled on one (``shm``), else the communicator's
``send``/``recv``. A broadcast through the group's message queue names
``queue`` itself, when it is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from coordinator.trace.recorder import IN_DTYPES, IN_SIZES, PEER

__all__ = ["TransportNamer"]

#: The ops the CPU communicator's shared-memory engine runs (one node).
_SHM_OPS = frozenset({"all_reduce", "reduce", "all_gather", "all_gatherv", "reduce_scatter",
                      "reduce_scatterv", "broadcast", "gather", "all_to_allv",
                      "all_gatherv_rows"})
#: Calls whose bytes go through the CPU communicator's broadcast.
_OBJECT_BROADCASTS = frozenset({"broadcast_object", "broadcast_object_list",
                                "broadcast_tensor_dict"})
#: Calls over the CPU group whatever the communicator.
_CPU_GROUP_OPS = frozenset({"barrier", "send_object", "recv_object"})
#: Point-to-point calls that take a shared-memory link when their direction has one.
_LINKED_OPS = frozenset({"send", "recv", "isend", "irecv", "send_tensor_dict",
                         "recv_tensor_dict", "isend_tensor_dict", "irecv_tensor_dict"})
#: What the CUDA communicator leaves to torch.distributed.
_CUDA_TORCH_OPS = frozenset({"scatter", "all_to_all"})


class TransportNamer:
    """The ``transport_of`` of one group's trace (see the module docstring).

    Args:
        comm: The group's communicator (read now, not kept).
        device: The group's device.
        linked: ``linked(op, peer)``: whether point-to-point call ``op`` with
            group rank ``peer`` goes over a shared-memory link; None: never.
    """

    def __init__(self, comm: Any, device: torch.device,
                 linked: Callable[[str, int], bool] | None = None) -> None:
        self._kind = str(getattr(comm, "name", "") or "")
        self._mode = str(getattr(comm, "mode", "") or "")
        self._cpu = device.type == "cpu"
        self._linked = linked
        car = getattr(comm, "custom_ar", None) if self._kind == "cuda" else None
        self._car_max = int(getattr(car, "max_size", 0) or 0) if car is not None else 0
        self._torch_name = "gloo" if self._cpu else _torch_backend(comm)

    def __call__(self, op: str, entry: list[Any]) -> str:
        """The transport of ``entry``, a call ``op`` of this group."""
        if op in _CPU_GROUP_OPS:
            return "gloo"
        if op in _OBJECT_BROADCASTS:
            return self.of_comm("broadcast", entry) if self._cpu else "gloo"
        if op in _LINKED_OPS:
            if self._cpu and self._linked is not None and self._linked(op, entry[PEER]):
                return "shm"
            return self.of_comm("send", entry)
        return self.of_comm(op, entry)

    def of_comm(self, op: str, entry: list[Any]) -> str:
        """The transport the communicator uses for its ``op``."""
        kind = self._kind
        if kind == "cpu":
            if self._mode == "shm":
                return "shm" if op in _SHM_OPS else "gloo"
            if self._mode == "hierarchical" and op == "all_reduce":
                return "hierarchical"
            return "gloo"
        if kind == "cuda":
            if op in _CUDA_TORCH_OPS:
                return "torch"
            if op == "all_reduce" and self._car_max and _custom_ar_takes(entry, self._car_max):
                return "custom_allreduce"
            return "pynccl"
        if kind == "torch":
            return self._torch_name
        return "torch"


def _torch_backend(comm: Any) -> str:
    """``nccl`` when torch.distributed's communicator runs over an NCCL group, else ``torch``."""
    try:
        backend = torch.distributed.get_backend(comm.device_group)
    except Exception:  # not a torch.distributed group, or none at all
        return "torch"
    return "nccl" if str(backend).lower() == "nccl" else "torch"


def _custom_ar_takes(entry: list[Any], max_size: int) -> bool:
    """Whether the custom all-reduce takes a tensor of the entry's shape and dtype
    (contiguity, which the entry does not keep, assumed)."""
    from device_comms.cuda.custom_allreduce.eligibility import ALIGNMENT, SUPPORTED_DTYPES

    size, dtype = entry[IN_SIZES], entry[IN_DTYPES]
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES or size is None:
        return False
    n = math.prod(size) * dtype.itemsize
    return 0 < n <= max_size and not n % ALIGNMENT
