"""The gloo group under a groupcoord process group.

Our :class:`~device_comms.cpu.communicator.CpuCommunicator` is built over a
gloo ``ProcessGroup`` of the same ranks (set-up, metadata, the ops it runs on
gloo) and calls ``torch.distributed`` functions with it, which look the group
up in torch's bookkeeping (``get_rank``, ``get_process_group_ranks``,
``get_backend``). The backend's creator cannot call ``dist.new_group`` (it runs
inside one, on the member ranks only, and before the default group exists
when it serves ``init_process_group``), so :func:`build` makes the group the
way ``_new_process_group_helper`` does, from the creator's store under its
own key prefix, and enters it in torch's ``_world`` maps that those functions
(and ``torch.profiler``, which reads every group's backend config) read;
:func:`forget` takes it out again. The group is not in ``_world.pg_names``, so
torch never lists it among the user's groups (nor shuts it down before our
communicator).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["STORE_PREFIX", "build", "forget"]

#: Key prefix of the gloo group's rendezvous within the creator's store (which
#: torch already prefixes with the group's name and device).
STORE_PREFIX = "groupcoord-gloo/"
_GLOO = dist.ProcessGroup.BackendType.GLOO


def build(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    global_ranks: Sequence[int],
    name: str,
) -> tuple[dist.ProcessGroup, dist.ProcessGroupGloo]:
    """A gloo group of the creator's ranks, known to ``torch.distributed``.

    Collective over the group's ranks (gloo connects them through ``store``).

    Args:
        store: The creator's store.
        rank: This process's rank in the group.
        size: The group's size.
        timeout: Every gloo wait's bound.
        global_ranks: The group's ranks in the default group, in group-rank
            order (``range(size)`` for the default group itself).
        name: The group's name (for errors; torch's registry does not hold it).

    Returns:
        ``(group, backend)``: the ``ProcessGroup`` and its gloo backend.
    """
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    gloo = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    pg = dist.ProcessGroup(prefixed, rank, size)
    pg._set_default_backend(_GLOO)  # noqa: SLF001 - how torch's helper assembles a group
    pg._register_backend(torch.device("cpu"), _GLOO, gloo)  # noqa: SLF001 - as above
    pg._set_group_name(c10d.GroupName(f"{name}/{STORE_PREFIX.rstrip('/')}"))  # noqa: SLF001 - as above
    world = c10d._world  # noqa: SLF001 - torch keeps group ranks and backends only there
    world.pg_map[pg] = (dist.Backend.GLOO, prefixed)
    world.pg_group_ranks[pg] = {g: r for r, g in enumerate(global_ranks)}
    # every group in pg_map has a backend config (torch.profiler reads each one's)
    world.pg_backend_config[pg] = "cpu:gloo"
    return pg, gloo


def forget(pg: dist.ProcessGroup) -> None:
    """Take ``pg`` out of torch's bookkeeping (idempotent)."""
    world = c10d._world  # noqa: SLF001 - see build()
    world.pg_map.pop(pg, None)
    world.pg_group_ranks.pop(pg, None)
    world.pg_backend_config.pop(pg, None)
