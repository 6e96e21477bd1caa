"""Collectives over the current tensor-parallel group, by vLLM's names
(``vllm.distributed.communication_op``); :mod:`coordinator.parallel_state`
exports them too."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from coordinator.errors import NotInitializedError
from coordinator.group.group_coordinator import GroupCoordinator
from coordinator.group.registry import REGISTRY
from device_comms import ReduceOp

__all__ = [
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_reduce_scatter",
    "tensor_model_parallel_gather",
    "broadcast_tensor_dict",
]


def _tp() -> GroupCoordinator:
    group = REGISTRY.tp
    if group is None:
        raise NotInitializedError(
            "the tensor model parallel group is not initialised; call "
            "coordinator.parallel_state.initialize_model_parallel(...) first")
    return group


def tensor_model_parallel_all_reduce(input_: torch.Tensor,
                                     op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over the TP group."""
    return _tp().all_reduce(input_, op)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """All-gather over the TP group."""
    return _tp().all_gather(input_, dim)


def tensor_model_parallel_reduce_scatter(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reduce-scatter over the TP group."""
    return _tp().reduce_scatter(input_, dim)


def tensor_model_parallel_gather(
    input_: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """Gather onto TP rank ``dst``."""
    return _tp().gather(input_, dst, dim)


def broadcast_tensor_dict(tensor_dict: dict[Any, Any] | None = None,
                          src: int = 0) -> dict[Any, Any] | None:
    """Broadcast a tensor dict over the TP group; without torch.distributed (one
    process) the dict itself, as in vLLM."""
    if REGISTRY.tp is None and not dist.is_initialized():
        return tensor_dict
    return _tp().broadcast_tensor_dict(tensor_dict, src)
