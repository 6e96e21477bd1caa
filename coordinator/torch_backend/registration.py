"""Registration of the ``"groupcoord"`` backend with ``torch.distributed``.

:func:`register` (run when :mod:`coordinator` is imported) calls
``dist.Backend.register_backend("groupcoord", ..., extended_api=True,
devices=["cpu"])``. torch then calls :func:`create` on the member ranks of
every ``init_process_group``/``new_group`` that names the backend, alone
(``"groupcoord"``) or for the CPU (``"cpu:groupcoord"``). The extended API
hands the creator the group's global ranks and name besides the store, rank,
size and timeout.

Registering does not make groupcoord torch's default for CPU tensors (gloo
stays the default of ``init_process_group()`` without a backend).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from coordinator.torch_backend.process_group import BACKEND_NAME, GroupcoordProcessGroup

__all__ = ["register", "create"]


def create(options: Any, backend_options: Any = None) -> GroupcoordProcessGroup:
    """torch's creator for a ``"groupcoord"`` group (extended API).

    Args:
        options: torch's ``_DistributedBackendOptions``: ``store``,
            ``group_rank``, ``group_size``, ``timeout``, ``group_id``,
            ``global_ranks_in_group`` (empty for the default group).
        backend_options: ``pg_options`` given to ``new_group`` (unused: the
            communicator reads its settings from the environment).
    """
    timeout = options.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(milliseconds=float(timeout))
    return GroupcoordProcessGroup(
        options.store, options.group_rank, options.group_size, timeout,
        list(options.global_ranks_in_group), str(options.group_id))


def register() -> None:
    """Register ``"groupcoord"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # noqa: SLF001 - torch's registry
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])
