"""Tensor-parallel collectives as the layers call them.

Each helper is the identity for a group of one (or ``None``, the
single-process reference path) and otherwise calls the group's collective.
:class:`~coordinator.group_coordinator.GroupCoordinator` routes those calls
through the ``groupcoord::*`` custom ops while ``torch.compile`` traces, so a
compiled layer sees one opaque node per collective and no graph break; in eager
mode they run the communicator directly.
"""

from __future__ import annotations

import torch

from coordinator.layers.weights import TPGroup

__all__ = ["tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"]


def tp_all_reduce(group: TPGroup | None, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``."""
    if group is None or group.world_size == 1:
        return x
    return group.all_reduce(x)


def tp_all_gather(group: TPGroup | None, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    if group is None or group.world_size == 1:
        return x
    return group.all_gather(x, dim)


def tp_reduce_scatter(group: TPGroup | None, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's equal slice along ``dim``."""
    if group is None or group.world_size == 1:
        return x
    return group.reduce_scatter(x, dim)
