"""Tensor-parallel collectives as the layers call them.

Each helper is the identity for a group of one (or ``None``, the
single-process reference path). Otherwise, while ``torch.compile`` traces,
it emits the ``groupcoord::*`` custom op for the group (one opaque graph node,
no graph break; see :mod:`coordinator.custom_ops`), and in eager mode it calls
the group's collective directly, with no custom-op dispatch cost.
"""

from __future__ import annotations

import torch

from coordinator.custom_ops import traced_all_gather, traced_all_reduce, traced_reduce_scatter
from coordinator.engine.layers.weights import TPGroup

__all__ = ["tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"]


def tp_all_reduce(group: TPGroup | None, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``."""
    if group is None or group.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced_all_reduce(group, x)
    return group.all_reduce(x)


def tp_all_gather(group: TPGroup | None, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    if group is None or group.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced_all_gather(group, x, dim)
    return group.all_gather(x, dim)


def tp_reduce_scatter(group: TPGroup | None, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's equal slice along ``dim``."""
    if group is None or group.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced_reduce_scatter(group, x, dim)
    return group.reduce_scatter(x, dim)
